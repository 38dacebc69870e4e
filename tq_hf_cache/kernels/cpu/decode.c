/* The packed history's part of decode attention on the CPU, reading the packed codes once (no dequantized copy).
 *
 * Layout (packing.py): a vector of D codes of BITS bits is D * BITS / 8 bytes, code j at bits [j BITS, j BITS + BITS)
 * of its little-endian bit string, so each group of 8 codes is BITS whole bytes. D is a multiple of 8.
 *
 * Both functions work on BH = batch x KV heads independent heads; head i uses the table
 * tables + (i % heads) * table_stride (stride 0: one shared codebook). Tokens go in chunks (`chunk_of`), one chunk
 * per task; the chunks depend on the token count only, so that the result does not depend on the number of threads:
 * the value sums are added chunk by chunk in a fixed order.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CHUNK 256     /* tokens a task, at least */
#define MAX_CHUNKS 64 /* tasks a head, at most: bounds the value partials (heads x 64 x rows x d floats) */
#define MAX_D 512

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VECTOR_DECODE 1
#endif

/* What decodes one head's codes: its table whose entry e holds the centroids of the W codes packed in the B * W bits
 * of e (W divides 8), and, in AVX2 builds, its centroids in registers (up to 32) or in an array (gathers). */
typedef struct {
    const float *tab;
#ifdef VECTOR_DECODE
    __m256 t[4];
    __m256i ctl, shift, mask;
    float cent[256];
#endif
} decoder;

static void decoder_init(decoder *dec, const float *tab, int bits) {
    dec->tab = tab;
#ifndef VECTOR_DECODE
    (void)bits;
#else
    static const int ENTRY_CODES[9] = {0, 4, 4, 4, 2, 2, 2, 1, 1}; /* W by width (reference._ROW_COORDS) */
    const int w = ENTRY_CODES[bits], n = 1 << bits;
    for (int k = 0; k < 256; k++) dec->cent[k] = k < n ? tab[k * w] : 0.0f; /* entry k < 2^B: codes k, 0, 0, ... */
    for (int m = 0; m < 4; m++) dec->t[m] = _mm256_loadu_ps(dec->cent + 8 * m);
    /* lane j takes the two bytes holding code j of a group (8-byte word broadcast to both 128-bit halves), then
     * shifts the code down and masks it */
    int8_t ctl[32];
    int32_t shift[8];
    for (int j = 0; j < 8; j++) {
        const int o = bits * j / 8;
        ctl[4 * j] = (int8_t)o;
        ctl[4 * j + 1] = (int8_t)(o + 1); /* byte 8 (o = 7, 8 bits) is masked off below */
        ctl[4 * j + 2] = ctl[4 * j + 3] = (int8_t)0x80;
        shift[j] = bits * j % 8;
    }
    dec->ctl = _mm256_loadu_si256((const __m256i *)ctl);
    dec->shift = _mm256_loadu_si256((const __m256i *)shift);
    dec->mask = _mm256_set1_epi32(n - 1);
#endif
}

#ifdef VECTOR_DECODE
/* The 8 centroids of 8 codes (one per 32-bit lane): a permute for up to 3 bits, permutes and blends on the codes'
 * bits 3 and 4 up to 5 bits, a gather above. */
static inline __m256 lookup(const decoder *dec, __m256i i, int bits) {
    if (bits <= 3) return _mm256_permutevar8x32_ps(dec->t[0], i);
    const __m256 b3 = _mm256_castsi256_ps(_mm256_slli_epi32(i, 28));
    const __m256 lo = _mm256_blendv_ps(_mm256_permutevar8x32_ps(dec->t[0], i), _mm256_permutevar8x32_ps(dec->t[1], i), b3);
    if (bits == 4) return lo;
    if (bits == 5) {
        const __m256 hi =
            _mm256_blendv_ps(_mm256_permutevar8x32_ps(dec->t[2], i), _mm256_permutevar8x32_ps(dec->t[3], i), b3);
        return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(i, 27)));
    }
    return _mm256_i32gather_ps(dec->cent, i, 4);
}

/* The 8 centroids of the group of codes at p */
static inline __m256 vgroup(const uint8_t *p, const decoder *dec, int bits, int tail) {
    __m128i x;
    if (tail) {
        uint64_t w = 0;
        memcpy(&w, p, (size_t)bits);
        x = _mm_cvtsi64_si128((long long)w);
    } else {
        x = _mm_loadl_epi64((const __m128i *)p);
    }
    const __m256i i = _mm256_and_si256(
        _mm256_srlv_epi32(_mm256_shuffle_epi8(_mm256_broadcastq_epi64(x), dec->ctl), dec->shift), dec->mask);
    return lookup(dec, i, bits);
}

/* The lane sums of four vectors */
static inline __m128 sum4(__m256 a, __m256 b, __m256 c, __m256 e) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, e));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
#endif

#ifndef VECTOR_DECODE
/* The D centroids of one packed vector, in builds without AVX2: a group of 8 codes (B bytes) is read as one 8-byte
 * word, past the row's end into the next row (which must exist: `tail` 0), or byte by byte (`tail` 1, for a head's
 * last rows; slower: the bytes meet again in one register through memory), and cut into 8 / W table entries. */
#define DEFINE_DECODE(B, W)                                                                                \
    static void decode_##B(const uint8_t *row, const decoder *dec, float *out, int d, int tail) {         \
        const float *tab = dec->tab;                                                                     \
        for (int g = 0; g < d / 8; g++) {                                                                \
            uint64_t w = 0;                                                                              \
            if (tail)                                                                                    \
                memcpy(&w, row + g * B, B);                                                              \
            else                                                                                         \
                memcpy(&w, row + g * B, 8);                                                              \
            float *o = out + g * 8;                                                                      \
            for (int e = 0; e < 8 / W; e++)                                                              \
                memcpy(o + e * W, tab + ((w >> (B * W * e)) & ((1u << (B * W)) - 1)) * W, 4 * W);       \
        }                                                                                                \
    }
DEFINE_DECODE(1, 4)
DEFINE_DECODE(2, 4)
DEFINE_DECODE(3, 4)
DEFINE_DECODE(4, 2)
DEFINE_DECODE(5, 2)
DEFINE_DECODE(6, 2)
DEFINE_DECODE(7, 1)
DEFINE_DECODE(8, 1)

typedef void (*decode_fn)(const uint8_t *, const decoder *, float *, int, int);
static const decode_fn DECODE[9] = {0, decode_1, decode_2, decode_3, decode_4, decode_5, decode_6, decode_7, decode_8};

/* q . kv over d (a multiple of 8) in 8 lanes, which the compiler keeps in one vector register */
static inline float dot(const float *q, const float *kv, int d) {
    float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int k = 0; k < d; k += 8)
        for (int l = 0; l < 8; l++) lane[l] += q[k + l] * kv[k + l];
    return ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7]));
}
#endif

/* 1 where the build decodes with AVX2 (what the tests compare with a scalar build) */
int tq_vector_decode(void) {
#ifdef VECTOR_DECODE
    return 1;
#else
    return 0;
#endif
}


static inline int chunk_of(int tokens) {
    const int even = (int)(((int64_t)tokens + MAX_CHUNKS - 1) / MAX_CHUNKS);
    return even > CHUNK ? even : CHUNK;
}

/* Task `task`'s head i and tokens [t0, t1) */
static inline void task_of(int64_t task, int chunks, int chunk, int tokens, int *i, int *t0, int *t1) {
    *i = (int)(task / chunks);
    *t0 = (int)(task % chunks) * chunk;
    *t1 = tokens - *t0 > chunk ? *t0 + chunk : tokens;
}

/* Bad arguments: a nonzero code; the caller checks every shape first, so this only guards the memory. */
static int check(int bh, int heads, int rows, int tokens, int d, int bits, int threads) {
    if (bh < 0 || heads <= 0 || rows <= 0 || tokens < 0 || d <= 0 || d > MAX_D || d % 8 || bits < 1 || bits > 8 ||
        threads < 1)
        return 1;
    return 0;
}

/* One head's scores over tokens [t0, t1): out[r * out_sr + t] (= or +=) norms[t] * (q[r] . c[codes[t]]). */
static void scores_task(const uint8_t *codes, int64_t codes_st, const float *norms, const float *q, int64_t q_sr,
                        const decoder *dec, float *out, int64_t out_sr, int rows, int t0, int t1, int tokens, int d,
                        int bits, int accumulate) {
    const int64_t reach = 8 - bits; /* bytes the last group's word reads past a row */
    float kv[MAX_D];
#ifdef VECTOR_DECODE
    for (int t = t0; t < t1; t++) {
        const uint8_t *row = codes + t * codes_st;
        const int tail = (tokens - 1 - t) * codes_st < reach;
        for (int g = 0; g < d / 8; g++) _mm256_storeu_ps(kv + 8 * g, vgroup(row + g * bits, dec, bits, tail));
        const __m128 n = _mm_set1_ps(norms[t]);
        for (int r0 = 0; r0 < rows; r0 += 4) { /* four rows at a time (the last ones repeated past `rows`) */
            const float *q0 = q + r0 * q_sr;
            const float *q1 = r0 + 1 < rows ? q0 + q_sr : q0, *q2 = r0 + 2 < rows ? q0 + 2 * q_sr : q0;
            const float *q3 = r0 + 3 < rows ? q0 + 3 * q_sr : q0;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int k = 0; k < d; k += 8) {
                const __m256 v = _mm256_loadu_ps(kv + k);
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + k), v, a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q1 + k), v, a1);
                a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q2 + k), v, a2);
                a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q3 + k), v, a3);
            }
            float sc[4];
            _mm_storeu_ps(sc, _mm_mul_ps(sum4(a0, a1, a2, a3), n));
            for (int j = 0; j < 4 && r0 + j < rows; j++) {
                float *o = out + (r0 + j) * out_sr + t;
                *o = accumulate ? *o + sc[j] : sc[j];
            }
        }
    }
#else
    const decode_fn decode = DECODE[bits];
    for (int t = t0; t < t1; t++) {
        decode(codes + t * codes_st, dec, kv, d, (tokens - 1 - t) * codes_st < reach);
        for (int r = 0; r < rows; r++) {
            const float sc = norms[t] * dot(q + r * q_sr, kv, d);
            float *o = out + r * out_sr + t;
            *o = accumulate ? *o + sc : sc;
        }
    }
#endif
}

/* One head's value sums over tokens [t0, t1): acc[r * d + k] = sum_t p[r * p_sr + t] norms[t] c[codes[t]][k]. */
static void values_task(const uint8_t *codes, int64_t codes_st, const float *norms, const float *p, int64_t p_sr,
                        const decoder *dec, float *acc, int rows, int t0, int t1, int tokens, int d, int bits) {
    const int64_t reach = 8 - bits;
#ifdef VECTOR_DECODE
    /* 3 rows x 4 groups (32 coordinates) of sums in registers across the tokens, block by block (rows and groups past
     * the end repeat the last ones and are not stored) */
    const int groups = d / 8;
    for (int g0 = 0; g0 < groups; g0 += 4) {
        int g[4];
        for (int u = 0; u < 4; u++) g[u] = g0 + u < groups ? g0 + u : groups - 1;
        for (int r0 = 0; r0 < rows; r0 += 3) {
            const int r1 = r0 + 1 < rows ? r0 + 1 : r0, r2 = r0 + 2 < rows ? r0 + 2 : r0;
            __m256 a[3][4];
            for (int j = 0; j < 3; j++)
                for (int u = 0; u < 4; u++) a[j][u] = _mm256_setzero_ps();
            for (int t = t0; t < t1; t++) {
                const uint8_t *row = codes + t * codes_st;
                const int tail = (tokens - 1 - t) * codes_st < reach;
                __m256 k[4];
                for (int u = 0; u < 4; u++) k[u] = vgroup(row + g[u] * bits, dec, bits, tail);
                const float n = norms[t];
                const __m256 w0 = _mm256_set1_ps(p[r0 * p_sr + t] * n), w1 = _mm256_set1_ps(p[r1 * p_sr + t] * n);
                const __m256 w2 = _mm256_set1_ps(p[r2 * p_sr + t] * n);
                for (int u = 0; u < 4; u++) {
                    a[0][u] = _mm256_fmadd_ps(w0, k[u], a[0][u]);
                    a[1][u] = _mm256_fmadd_ps(w1, k[u], a[1][u]);
                    a[2][u] = _mm256_fmadd_ps(w2, k[u], a[2][u]);
                }
            }
            for (int j = 0; j < 3 && r0 + j < rows; j++)
                for (int u = 0; u < 4 && g0 + u < groups; u++) _mm256_storeu_ps(acc + (r0 + j) * d + 8 * g[u], a[j][u]);
        }
    }
#else
    const decode_fn decode = DECODE[bits];
    float kv[MAX_D];
    memset(acc, 0, sizeof(float) * (size_t)rows * (size_t)d);
    for (int t = t0; t < t1; t++) {
        decode(codes + t * codes_st, dec, kv, d, (tokens - 1 - t) * codes_st < reach);
        for (int r = 0; r < rows; r++) {
            const float w = p[r * p_sr + t] * norms[t];
            float *a = acc + r * d;
            for (int k = 0; k < d; k++) a[k] += w * kv[k];
        }
    }
#endif
}

/* out[i, r, t] = norms[i, t] * (q[i, r, :] . c[codes[i, t, :]]) for t < tokens (added to out where `accumulate`).
 * Strides in elements (bytes for codes); q rows and the codes of a vector are contiguous, and codes_st >= D BITS / 8. */
int tq_packed_scores(const uint8_t *codes, int64_t codes_sh, int64_t codes_st, const float *norms,
                     int64_t norms_sh, const float *q, int64_t q_sh, int64_t q_sr, const float *tables,
                     int64_t table_stride, float *out, int64_t out_sh, int64_t out_sr, int bh, int heads,
                     int rows, int tokens, int d, int bits, int accumulate, int threads) {
    if (check(bh, heads, rows, tokens, d, bits, threads)) return 1;
    const int chunk = chunk_of(tokens), chunks = (tokens + chunk - 1) / chunk;
    const int64_t tasks = (int64_t)bh * chunks;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t task = 0; task < tasks; task++) {
        int i, t0, t1;
        decoder dec;
        task_of(task, chunks, chunk, tokens, &i, &t0, &t1);
        decoder_init(&dec, tables + (int64_t)(i % heads) * table_stride, bits);
        scores_task(codes + i * codes_sh, codes_st, norms + i * norms_sh, q + i * q_sh, q_sr, &dec,
                    out + i * out_sh, out_sr, rows, t0, t1, tokens, d, bits, accumulate);
    }
    return 0;
}

/* out[i, r, :] = sum_t p[i, r, t] norms[i, t] c[codes[i, t, :]] (out: BH x rows x d, contiguous, overwritten). */
int tq_packed_values(const uint8_t *codes, int64_t codes_sh, int64_t codes_st, const float *norms,
                     int64_t norms_sh, const float *p, int64_t p_sh, int64_t p_sr, const float *tables,
                     int64_t table_stride, float *out, int bh, int heads, int rows, int tokens, int d,
                     int bits, int threads) {
    if (check(bh, heads, rows, tokens, d, bits, threads)) return 1;
    const int chunk = chunk_of(tokens), chunks = (tokens + chunk - 1) / chunk;
    const int64_t tasks = (int64_t)bh * chunks, per = (int64_t)rows * d;
    float *part = tasks ? malloc(sizeof(float) * tasks * per) : NULL;
    if (tasks && !part) return 2;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t task = 0; task < tasks; task++) {
        int i, t0, t1;
        decoder dec;
        task_of(task, chunks, chunk, tokens, &i, &t0, &t1);
        decoder_init(&dec, tables + (int64_t)(i % heads) * table_stride, bits);
        values_task(codes + i * codes_sh, codes_st, norms + i * norms_sh, p + i * p_sh, p_sr, &dec,
                    part + task * per, rows, t0, t1, tokens, d, bits);
    }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int i = 0; i < bh; i++) {
        float *o = out + i * per;
        memset(o, 0, sizeof(float) * per);
        for (int ch = 0; ch < chunks; ch++) {
            const float *a = part + ((int64_t)i * chunks + ch) * per;
            for (int64_t k = 0; k < per; k++) o[k] += a[k];
        }
    }
    free(part);
    return 0;
}
