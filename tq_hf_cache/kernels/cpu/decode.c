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

/* The D centroids of one packed vector from a table whose entry e holds the centroids of the W codes packed in the
 * B * W bits of e (W divides 8): a group of 8 codes (B bytes) is 8 / W lookups of W floats. A group is read as one
 * 8-byte word, past the row's end into the next row (which must exist: `tail` 0), or byte by byte (`tail` 1, for a
 * head's last row; slower: the bytes meet again in one register through memory). */
#define DEFINE_DECODE(B, W)                                                                                \
    static inline void decode_##B(const uint8_t *row, const float *tab, float *out, int d, int tail) {    \
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

typedef void (*decode_fn)(const uint8_t *, const float *, float *, int, int);
static const decode_fn DECODE[9] = {0, decode_1, decode_2, decode_3, decode_4, decode_5, decode_6, decode_7, decode_8};

/* q . kv over d (a multiple of 8) in 8 lanes, which the compiler keeps in one vector register */
static inline float dot(const float *q, const float *kv, int d) {
    float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int k = 0; k < d; k += 8)
        for (int l = 0; l < 8; l++) lane[l] += q[k + l] * kv[k + l];
    return ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7]));
}

static inline int chunk_of(int tokens) {
    const int even = (int)(((int64_t)tokens + MAX_CHUNKS - 1) / MAX_CHUNKS);
    return even > CHUNK ? even : CHUNK;
}

/* Bad arguments: a nonzero code; the caller checks every shape first, so this only guards the memory. */
static int check(int bh, int heads, int rows, int tokens, int d, int bits, int threads) {
    if (bh < 0 || heads <= 0 || rows <= 0 || tokens < 0 || d <= 0 || d > MAX_D || d % 8 || bits < 1 || bits > 8 ||
        threads < 1)
        return 1;
    return 0;
}

/* out[i, r, t] = norms[i, t] * (q[i, r, :] . c[codes[i, t, :]]) for t < tokens (added to out where `accumulate`).
 * Strides in elements (bytes for codes); q rows and the codes of a vector are contiguous, and codes_st >= D BITS / 8. */
int tq_packed_scores(const uint8_t *codes, int64_t codes_sh, int64_t codes_st, const float *norms,
                     int64_t norms_sh, const float *q, int64_t q_sh, int64_t q_sr, const float *tables,
                     int64_t table_stride, float *out, int64_t out_sh, int64_t out_sr, int bh, int heads,
                     int rows, int tokens, int d, int bits, int accumulate, int threads) {
    if (check(bh, heads, rows, tokens, d, bits, threads)) return 1;
    const decode_fn decode = DECODE[bits];
    const int chunk = chunk_of(tokens), chunks = (tokens + chunk - 1) / chunk;
    const int64_t reach = 8 - bits; /* bytes the last group's word reads past a row */
    const int64_t tasks = (int64_t)bh * chunks;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t task = 0; task < tasks; task++) {
        const int i = (int)(task / chunks), t0 = (int)(task % chunks) * chunk;
        const int t1 = tokens - t0 > chunk ? t0 + chunk : tokens;
        const float *c = tables + (int64_t)(i % heads) * table_stride;
        float kv[MAX_D];
        for (int t = t0; t < t1; t++) {
            decode(codes + i * codes_sh + t * codes_st, c, kv, d, (tokens - 1 - t) * codes_st < reach);
            const float n = norms[i * norms_sh + t];
            for (int r = 0; r < rows; r++) {
                const float *qr = q + i * q_sh + r * q_sr;
                const float s = n * dot(qr, kv, d);
                float *o = out + i * out_sh + r * out_sr + t;
                *o = accumulate ? *o + s : s;
            }
        }
    }
    return 0;
}

/* out[i, r, :] = sum_t p[i, r, t] norms[i, t] c[codes[i, t, :]] (out: BH x rows x d, contiguous, overwritten). */
int tq_packed_values(const uint8_t *codes, int64_t codes_sh, int64_t codes_st, const float *norms,
                     int64_t norms_sh, const float *p, int64_t p_sh, int64_t p_sr, const float *tables,
                     int64_t table_stride, float *out, int bh, int heads, int rows, int tokens, int d,
                     int bits, int threads) {
    if (check(bh, heads, rows, tokens, d, bits, threads)) return 1;
    const decode_fn decode = DECODE[bits];
    const int chunk = chunk_of(tokens), chunks = (tokens + chunk - 1) / chunk;
    const int64_t reach = 8 - bits; /* bytes the last group's word reads past a row */
    const int64_t tasks = (int64_t)bh * chunks, per = (int64_t)rows * d;
    float *part = tasks ? malloc(sizeof(float) * tasks * per) : NULL;
    if (tasks && !part) return 2;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t task = 0; task < tasks; task++) {
        const int i = (int)(task / chunks), t0 = (int)(task % chunks) * chunk;
        const int t1 = tokens - t0 > chunk ? t0 + chunk : tokens;
        const float *c = tables + (int64_t)(i % heads) * table_stride;
        float *acc = part + task * per;
        float kv[MAX_D];
        memset(acc, 0, sizeof(float) * per);
        for (int t = t0; t < t1; t++) {
            decode(codes + i * codes_sh + t * codes_st, c, kv, d, (tokens - 1 - t) * codes_st < reach);
            const float n = norms[i * norms_sh + t];
            for (int r = 0; r < rows; r++) {
                const float w = p[i * p_sh + r * p_sr + t] * n;
                float *a = acc + r * d;
                for (int k = 0; k < d; k++) a[k] += w * kv[k];
            }
        }
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
