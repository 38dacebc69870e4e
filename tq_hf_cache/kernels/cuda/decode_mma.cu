// Decode attention over TurboQuant-packed keys and values (sm_80+, tuned for sm_90), in one launch: `tq_decode`
// computes, per (batch, KV head), the packed history's split-K partials on tensor cores (mma.sync m16n8k16), each CTA
// rotating the query itself (by butterflies where the rotation is a randomized Hadamard transform, `HAD`, else by Pi
// on tensor cores, `QueryRot`: one round trip, overlapped with its table fill), and the exact copies' partial in
// parallel CTAs (on tensor cores for fp16 / bf16 copies, `exact_mma`); the last CTA to finish merges them, rotates
// the values back once and writes the output.
//
// Compiled at first use by NVRTC (no headers) with -D: D, KB, VB (bits), NQ (query n-tiles: 8 * NQ >= G * n),
// MASK_KIND (0 none, 1 bool / 2 additive per row), MASK_DT (0 u8, 1 f16, 2 bf16, 3 f32), MASK_ROW (1: a bool mask
// whose one row serves all the CTA's rows, contiguous and 2-byte aligned), KN_F32, VN_F32 (norm
// dtypes), KR, VR (copies of each pair table), STATIC, VEC (widest load, bytes), NVEC (norms loaded in pairs),
// STAGES, WARPS (8 or 16), and those of the exact part below.
//
// Registers, not shared memory, carry the codes into the MMA operands, with no reshuffle:
// - Scores S = Q K^T (M = 16 query rows, N = 8 tokens, K = 16 channels). Lane (g = lane / 4, l4 = lane % 4) holds,
//   for token g of an n-tile, B registers of channels {2 l4, 2 l4 + 1} and {2 l4 + 8, 2 l4 + 9} of each k-step.
//   The dot product does not care which channel sits in which k-slot as long as Q agrees, so lane l4 takes the
//   contiguous channels [l4 D/4, (l4 + 1) D/4) of its token: pair p (channels l4 D/4 + 2p, + 1) is k-step p / 2,
//   register p % 2, and Q's A registers read the same channels. One contiguous load per token and lane.
// - Values O^T = V^T P^T (M = 16 channels, N = 8 queries, K = 16 tokens): P^T's B registers are exactly S's C
//   registers (the FA2 reuse, transposed), and V^T's A registers pair two tokens of one channel; lane g takes the
//   contiguous channels [g D/8, (g + 1) D/8) of its four tokens, pair j of them is m-tile j (rows g and g + 8), and
//   one PRMT per register pairs the two tokens. The output channel order is undone when the partial is stored.
// - A code pair (2 * bits bits) indexes a table of half2 centroid pairs in shared memory, one copy per lane (KR / VR
//   copies: conflict-free at 32), so one LDS yields two values; the index is shifted and OR-ed with the lane's copy
//   offset in one LOP3. Norms scale S after the MMA (keys) and P before it (values).

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;

struct Params {
  const unsigned char* kp; i64 skpb, skph;
  const void* kn; i64 sknb, sknh;
  const unsigned char* vp; i64 svpb, svph;
  const void* vn; i64 svnb, svnh;
  const u32* ktab; i64 ktab_sh;       // (heads', 4^KB) half2 pair tables, head stride in entries (0: shared)
  const u32* vtab; i64 vtab_sh;
  const unsigned char* mask; i64 smb, smh, smi, smt;  // element strides
  float* acc; float* ml;              // partials: acc (slots, ROWS, D), ml (slots, 2, ROWS); slot = bh (splits + nx) + s
  const i64* len_ptr; const i64* from_ptr;
  int hkv, group, nq, lq, sinks, num_splits, mask_elt, slots;
  int fold;  // > 0: the last split's CTA takes the exact copies, which count as `fold` packed tokens in placing the
             // splits; 0: they have CTAs num_splits .. of their own
  const void* qx; i64 sqb, sqh, sqn;  // (B, Hq, n, D) the query as given, element strides
  const float* pi;                    // (D, D) the rotation
  const void* sk; i64 sskb, sskh;     // exact copies: sinks and window, (B, Hkv, slots, D), token stride D
  const void* sv; i64 ssvb, ssvh;
  const void* rk; i64 srkb, srkh;
  const void* rv; i64 srvb, srvh;
  void* out; i64 sob, son, soh;       // (B, n, Hq, D)
  int* counters;                      // (B Hkv) arrivals, zero between launches
  int lr, window;
  float scale_log2;
  const uint4* pif;                   // (D / 8, 32, D / 16, 2) half2: Pi in the rotation MMA's B fragment order
  const uint2* pih;                   // (D, D / 4) Pi as fp16, four of a row a load: the merge's rotation (PIH)
  const u32* sgn;                     // HAD: (D / 32) the signs s of Pi = H diag(s) / sqrt(D), bit c set: s_c = -1
  int nx;                             // the exact copies' partials a (batch, KV head): slots num_splits ..; their
                                      // own CTAs (but one where fold), each a part of the tokens
};

#ifndef WARPS  // 8, or 16 in one CTA an SM (where two CTAs of 8 would hold fewer copies of the tables)
#define WARPS 8
#endif
#ifndef STAGES
#define STAGES 3
#endif
#ifndef MIN_CTAS  // two CTAs of 8 warps an SM where the registers allow (128 a thread)
#define MIN_CTAS ((NQ == 1 && D <= 128 && WARPS == 8) ? 2 : 1)
#endif
#define NEG_INF __int_as_float(0xff800000)
#define LOG2E 1.4426950408889634f
#define KPT (D * KB / 8)
#define VPT (D * VB / 8)
#define KSPAN (D / 4 * KB / 8)
#define VSPAN (D / 8 * VB / 8)
#define KS (D / 16)
#define KENT (1 << (2 * KB))
#define VENT (1 << (2 * VB))
#define VPLANES ((VB == 2 || VB == 4 || VB == 8) ? 8 / VB : 8)

__device__ __forceinline__ u32 shf_r(u32 lo, u32 hi, u32 n) {
  u32 r;
  asm("shf.r.wrap.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(lo), "r"(hi), "r"(n));
  return r;
}
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
  u32 r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ u32 pack_h2(float lo, float hi) {
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ float h2f(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ void mma(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The SPAN bytes at byte `start` of a packed row of ROWB bytes, as NW little-endian words starting at bit 0.
template <int SPAN, int ROWB>
struct Span {
  static constexpr int NW = (SPAN + 3) / 4;
  static constexpr bool ALIGNED = SPAN % 4 == 0;
};

template <int SPAN, int ROWB>
__device__ __forceinline__ void load_span(const unsigned char* row, int start, u32 (&w)[Span<SPAN, ROWB>::NW]) {
  constexpr int NW = Span<SPAN, ROWB>::NW;
  if constexpr (VEC >= 16 && SPAN % 16 == 0 && ROWB % 16 == 0) {
    const uint4* p = reinterpret_cast<const uint4*>(row + start);
#pragma unroll
    for (int i = 0; i < NW / 4; ++i) {
      uint4 v = p[i];
      w[4 * i] = v.x; w[4 * i + 1] = v.y; w[4 * i + 2] = v.z; w[4 * i + 3] = v.w;
    }
  } else if constexpr (VEC >= 8 && SPAN % 8 == 0 && ROWB % 8 == 0) {
    const uint2* p = reinterpret_cast<const uint2*>(row + start);
#pragma unroll
    for (int i = 0; i < NW / 2; ++i) {
      uint2 v = p[i];
      w[2 * i] = v.x; w[2 * i + 1] = v.y;
    }
  } else if constexpr (SPAN % 4 == 0) {
    const u32* p = reinterpret_cast<const u32*>(row + start);
#pragma unroll
    for (int i = 0; i < NW; ++i) w[i] = p[i];
  } else {  // a span that starts inside a word: whole words, then realigned (the last word may lie past the row: the
           // next row or part of a tile in the ring, in shared memory; its bits go unused)
    const u32* p = reinterpret_cast<const u32*>(row);
    const int a = start >> 2;
    const u32 sh = (start & 3) * 8;
    u32 raw[NW + 1];
#pragma unroll
    for (int i = 0; i <= NW; ++i) raw[i] = p[a + i];
#pragma unroll
    for (int i = 0; i < NW; ++i) w[i] = shf_r(raw[i], raw[i + 1], sh);
  }
}

// (a & b) | c in one LOP3 (left to itself, ptxas splits it in two in some builds of this kernel: 73 more a tile)
template <u32 B>
__device__ __forceinline__ u32 lop3_and_or(u32 a, u32 c) {
  u32 r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "n"(B), "r"(c));
  return r;
}

// Byte offset in a pair table (copies interleaved: entry e, copy c at word e * R + c) of code pair p (2 * B bits at
// bit 2 * B * p of w), for the lane whose copy offset (bytes) is `lanebits`.
template <int B, int LOGR, int NW>
__device__ __forceinline__ u32 pair_offset(const u32 (&w)[NW], int p, u32 lanebits) {
  constexpr int B2 = 2 * B;
  constexpr int SH = LOGR + 2;
  const int bit = B2 * p;
  const int wi = bit >> 5, off = bit & 31;
  u32 x;
  if (off + B2 <= 32) {
    x = off >= SH ? (w[wi] >> (off - SH)) : (w[wi] << (SH - off));
  } else {
    x = shf_r(w[wi], w[wi + 1], off - SH);
  }
  return lop3_and_or<((1u << B2) - 1) << SH>(x, lanebits);
}

__device__ __forceinline__ float load_norm(const void* p, i64 i, bool f32) {
  return f32 ? reinterpret_cast<const float*>(p)[i] : h2f(reinterpret_cast<const u16*>(p)[i]);
}

__device__ __forceinline__ float mask_value(const unsigned char* m, i64 off) {  // off in elements
  // additive masks in base 2; boolean ones as 0 (attend) / -inf
#if MASK_DT == 0
  return m[off] ? 0.0f : NEG_INF;
#elif MASK_DT == 1
  return h2f(reinterpret_cast<const u16*>(m)[off]) * LOG2E;
#elif MASK_DT == 2
  return __uint_as_float(static_cast<u32>(reinterpret_cast<const u16*>(m)[off]) << 16) * LOG2E;
#else
  return reinterpret_cast<const float*>(m)[off] * LOG2E;
#endif
}

#define LOGKR (KR == 32 ? 5 : KR == 16 ? 4 : KR == 8 ? 3 : KR == 4 ? 2 : KR == 2 ? 1 : 0)
#define LOGVR (VR == 32 ? 5 : VR == 16 ? 4 : VR == 8 ? 3 : VR == 4 ? 2 : VR == 2 ? 1 : 0)
#define NMROWS (NQ == 1 ? 1 : 2)   // S rows a lane uses: g, and g + 8 when NQ == 2
#ifndef MASK_ROW
#define MASK_ROW 0
#endif

// A tile's mask at this lane's four tokens j (tb + 2 l4 + (j & 1) + 8 (j >> 1)): where one bool row serves every
// row (a decode step's causal or padding mask), its four bytes (two 16-bit loads, no per-row work: 948 instructions
// a tile against the general path's 1018-1040 and no mask's 910, k5v3); else each S row's values, exponent base 2
struct MaskTile {
#if MASK_ROW
  u32 bytes;
#else
  float v[NMROWS][4];
#endif
};


// Shared memory (dynamic, STAGE_BYTES + KTAB_BYTES + VTAB_BYTES): each warp's ring of STAGES tiles (cp.async), then
// the two pair tables; a lookup's address is the table's (warp-uniform) base plus one LOP3 of the code pair's bits and
// the lane's copy; after the loop, the warps' partials.
#define KTAB_BYTES (4 * KENT * KR)
#define VTAB_BYTES (4 * VENT * VR)
#define KNB (KN_F32 ? 4 : 2)
#define VNB (VN_F32 ? 4 : 2)
#define TILE_BYTES (((16 * (KPT + VPT + KNB + VNB)) + 15) / 16 * 16)
#define STAGE_BYTES (WARPS * STAGES * TILE_BYTES)
// QREG: the query's fragments in registers, loaded once, not an LDS.128 a k-step and tile (at head dim 128 a
// quarter of the loop's shared-memory wavefronts). With one query n-tile the fragments' rows g + 8 are zeros and
// unused, so QPAIR (the launcher's choice) packs two k-steps in one register quad: k-step 2j in rows g (a0, a2),
// 2j + 1 in rows g + 8 (a1, a3), each into scores of its own whose other rows are discarded: 16 registers at head
// dim 128, not 32.
#ifndef QPAIR
#define QPAIR 0
#endif
#if QPAIR && !(NQ == 1 && D <= 128)
#error "QPAIR takes one query n-tile at head dims up to 128"
#endif
#ifndef QREG
#define QREG (D == 64 || QPAIR)
#endif
#define CHUNK ((VEC >= 16 && KPT % 16 == 0 && VPT % 16 == 0) ? 16 : (VEC >= 8 && KPT % 8 == 0 && VPT % 8 == 0) ? 8 : 4)

template <int N>
__device__ __forceinline__ void cp_async(u32 d, const void* src) {  // d: a shared address
  if constexpr (N == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src));
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(d), "l"(src), "n"(N));
  }
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

__device__ __forceinline__ u32 shared_addr(const void* p) {
  u32 r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}
__device__ __forceinline__ u32 lds(u32 addr) {
  u32 r;
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(r) : "r"(addr));
  return r;
}

template <bool F32>
__device__ __forceinline__ void load_pair(const unsigned char* base, int i, float& a, float& b) {  // elements i, i + 1
  if constexpr (F32) {
    const float2 v = *reinterpret_cast<const float2*>(base + 4 * i);
    a = v.x; b = v.y;
  } else {
    const u32 v = *reinterpret_cast<const u32*>(base + 2 * i);
    a = h2f(static_cast<u16>(v & 0xffff)); b = h2f(static_cast<u16>(v >> 16));
  }
}


// R copies of each of N table entries (copy c of entry e at word e R + c), 16 bytes a store where R >= 4: `load` the
// entries into registers (issued with the CTA's other first loads: one round trip for all), then `store` them. Warp w
// stores the w-th part of the table in order (conflict-free), its lanes having loaded its entries one each, and
// shuffles give each store its entry (holding a load for every store would take registers the loop needs).
template <int N, int R, int LOGR>
struct TableFill {
  static constexpr int W = R >= 4 ? 4 : 1, S = R / W, TOTAL = N * R / W, NT = WARPS * 32;
  static constexpr bool SIMPLE = TOTAL <= NT;  // (powers of two: else a whole number of stores a thread)
  static constexpr int FPW = TOTAL / WARPS, EPW = SIMPLE ? 1 : FPW / S;  // stores and entries a warp
  static constexpr int LOADS = (EPW + 31) / 32;
  u32 v[LOADS];
  __device__ __forceinline__ void load(const u32* src, int tid) {
    const int warp = tid >> 5, lane = tid & 31;
    if constexpr (SIMPLE) {
      v[0] = tid < TOTAL ? __ldg(src + ((W * tid) >> LOGR)) : 0u;
    } else {
#pragma unroll
      for (int m = 0; m < LOADS; ++m)
        v[m] = (EPW % 32 == 0 || lane + 32 * m < EPW) ? __ldg(src + warp * EPW + lane + 32 * m) : 0u;
    }
  }
  __device__ __forceinline__ void put(u32* dst, int i, u32 x) const {
    if constexpr (W == 4) reinterpret_cast<uint4*>(dst)[i] = make_uint4(x, x, x, x);
    else dst[i] = x;
  }
  __device__ __forceinline__ void store(u32* dst, int tid) const {
    const int warp = tid >> 5, lane = tid & 31;
    if constexpr (SIMPLE) {
      if (tid < TOTAL) put(dst, tid, v[0]);
    } else {
#pragma unroll
      for (int k = 0; k < FPW / 32; ++k) {
        const int e = (32 * k + lane) / S;  // the warp's entry of this lane's store
        put(dst, warp * FPW + 32 * k + lane, __shfl_sync(0xffffffffu, v[(32 * k) / S / 32], e % 32));
      }
    }
  }
};

// ------------------------------------------------------------------------------------------------------------------
// The exact copies, the partials and the merge. More -D: Q_DT / X_DT / O_DT (0 f16, 1 bf16, 2 f32: the query, the
// exact copies, the output), ROWS (stored partial rows, a power of two >= G * n).

#ifndef ROWS
#define ROWS 16
#endif
#ifndef Q_DT
#define Q_DT 0
#endif
#ifndef X_DT
#define X_DT 0
#endif
#ifndef O_DT
#define O_DT 0
#endif
#define DPL (D / 32)  // channels per lane in the SIMT parts

template <int DT>
__device__ __forceinline__ float to_f32(const void* p, i64 i) {
  if constexpr (DT == 0) return h2f(reinterpret_cast<const u16*>(p)[i]);
  else if constexpr (DT == 1) return __uint_as_float(static_cast<u32>(reinterpret_cast<const u16*>(p)[i]) << 16);
  else return reinterpret_cast<const float*>(p)[i];
}

// qs[r * D + c] = scale_log2 * q_r[c] for r < live (row r = query r % nq of head h * group + r / nq), 0 up to NR
template <int NR>
__device__ __forceinline__ void load_query(const void* q, i64 sqb, i64 sqh, i64 sqn, int group, int nq, float scale,
                                           int b, int h, int live, float* qs) {
  for (int e = threadIdx.x; e < NR * D; e += WARPS * 32) {
    const int r = e / D, c = e % D;
    qs[e] = r < live ? to_f32<Q_DT>(q, b * sqb + static_cast<i64>(h * group + r / nq) * sqh +
                                           static_cast<i64>(r % nq) * sqn + c) * scale
                     : 0.0f;
  }
}

// The packed part's warps write their accumulators to shared memory in rows of PSTRIDE floats, channel c of a row at
// position (c % (D / 8)) * 8 + c / (D / 8): lane (g, l4)'s stores then land in 32 distinct banks (position g + 8 m,
// rows 2 l4 PSTRIDE apart, PSTRIDE = 4 mod 16). In channel order they hit two banks: 16-way conflicts, 4.3 us of a
// 16-warp CTA's epilogue on the H100.
#define PSTRIDE (D + 4)

// The first partial slot of a (batch, KV head): its packed splits' come first (+ 0 .. num_splits - 1), then the exact
// copies' nx parts
__device__ __forceinline__ i64 partial_base(const Params& p, int bh) {
  return static_cast<i64>(bh) * (p.num_splits + p.nx);
}

// The CTA's partial from its warps' (max, sum, accumulator) in shared memory (RQ rows each): (M, l) to ml and the
// accumulator rescaled to M to acc, at `slot`. PACKED: the packed part's (rows of PSTRIDE in the order above,
// rotated: stored by planes, the channel order the merge reads); else the exact part's (rows of D in channel order).
// Four positions a thread, one LDS.128 from each warp's row: the shared-memory pipe, not the arithmetic, bounds
// this, and four positions load the warps' maxima and sums once for four values (0.2-0.35 us a 1 x 4k call, H100).
template <int RQ, bool PACKED>
__device__ __forceinline__ void store_partial(const float* wm, const float* wl, const float* wa, const Params& p,
                                              i64 slot, int live) {
  constexpr int S = PACKED ? PSTRIDE : D;
  for (int e = 4 * threadIdx.x; e < ROWS * D; e += 4 * WARPS * 32) {
    const int r = e / D, i = e % D;  // i: the first of the thread's four positions in a row of wa
    float M = NEG_INF;
    if (r < live) {
#pragma unroll
      for (int w = 0; w < WARPS; ++w) M = fmaxf(M, wm[w * RQ + r]);
    }
    const float Mu = M == NEG_INF ? 0.0f : M;
    float l = 0.0f, a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (r < live) {
#pragma unroll
      for (int w = 0; w < WARPS; ++w) {
        const float f = ex2(wm[w * RQ + r] - Mu);
        l += f * wl[w * RQ + r];
        const float4 v = *reinterpret_cast<const float4*>(wa + (w * RQ + r) * S + i);
        a[0] += f * v.x; a[1] += f * v.y; a[2] += f * v.z; a[3] += f * v.w;
      }
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int x = PACKED ? ((i + k) % 8) * (D / 8) + (i + k) / 8 : i + k;  // its channel
      const int col = PACKED ? (x % VPLANES) * (D / VPLANES) + x / VPLANES : x;
      p.acc[(slot * ROWS + r) * D + col] = a[k];
    }
    if (i == 0) {
      p.ml[slot * 2 * ROWS + r] = M;
      p.ml[slot * 2 * ROWS + ROWS + r] = l;
    }
  }
}

// The query rows rotated and scaled (scale_log2 Pi q, fp16) on tensor cores, written as the score MMA's A fragments
// (fragment order: k-step s, lane, 4 words) in shared memory. Rows: A[r][c] = scale_log2 q_r[c] (row r = query r % n
// of head h G + r / n; zero from G n on), lane l4's k-slots being the contiguous channels [l4 D/4, (l4 + 1) D/4) (four
// a k-step: one vector load each); B = Pi^T, from `pif`, in that channel order, its columns ordered so that output
// n-tiles 2s and 2s + 1 land in the lanes and registers of the score MMA's k-step s. Warp w computes k-steps w,
// w + WARPS. The operands of its first k-step are loaded before the tables are filled, so that both round trips
// overlap.
struct QueryRot {
  u32 a[KS][4];          // A registers of rotation k-step kk: rows g, g + 8; channels l4 D/4 + 4 kk + {0, 1}, + {2, 3}
  uint4 u[KS / 2], v[KS / 2];  // B registers of n-tiles 2s, 2s + 1 (s = warp), two k-steps a load
};

// x = the 4 elements at q + o (zeros where !ok), one load where QV (the rows allow loads of 4 elements)
#ifndef QV
#define QV 0
#endif
template <int DT>
__device__ __forceinline__ void load4(const void* q, i64 o, bool ok, float (&x)[4]) {
  if (!ok) {
    x[0] = x[1] = x[2] = x[3] = 0.0f;
  } else if constexpr (QV && DT == 2) {
    const float4 v = *reinterpret_cast<const float4*>(reinterpret_cast<const float*>(q) + o);
    x[0] = v.x; x[1] = v.y; x[2] = v.z; x[3] = v.w;
  } else if constexpr (QV) {
    const uint2 v = *reinterpret_cast<const uint2*>(reinterpret_cast<const u16*>(q) + o);
    const u16 h[4] = {static_cast<u16>(v.x & 0xffff), static_cast<u16>(v.x >> 16), static_cast<u16>(v.y & 0xffff),
                      static_cast<u16>(v.y >> 16)};
#pragma unroll
    for (int k = 0; k < 4; ++k) x[k] = DT == 0 ? h2f(h[k]) : __uint_as_float(static_cast<u32>(h[k]) << 16);
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) x[k] = to_f32<DT>(q, o + k);
  }
}

__device__ __forceinline__ const uint4* rotation_b(const Params& p, int s, int lane) {
  return p.pif + (static_cast<i64>(2 * s) * 32 + lane) * (KS / 2);
}

__device__ __forceinline__ void rotation_load(const Params& p, int bh, int warp, int lane, QueryRot& r) {
  const int b = bh / p.hkv, h = bh % p.hkv, g = lane >> 2, l4 = lane & 3;
  const int live = p.group * p.nq;
  i64 rowoff[2];
  bool rok[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = g + 8 * i;
    rok[i] = row < live;
    const int rr = rok[i] ? row : 0;
    rowoff[i] = b * p.sqb + static_cast<i64>(h * p.group + rr / p.nq) * p.sqh + static_cast<i64>(rr % p.nq) * p.sqn;
  }
  if (warp >= KS) return;  // (the warps without a k-step of their own: D = 64, 128)
#pragma unroll
  for (int kk = 0; kk < KS; ++kk)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float x[4];
      load4<Q_DT>(p.qx, rowoff[i] + l4 * (D / 4) + 4 * kk, rok[i], x);
      r.a[kk][i] = pack_h2(x[0] * p.scale_log2, x[1] * p.scale_log2);
      r.a[kk][2 + i] = pack_h2(x[2] * p.scale_log2, x[3] * p.scale_log2);
    }
  {
    const uint4* b0 = rotation_b(p, warp, lane);
#pragma unroll
    for (int k2 = 0; k2 < KS / 2; ++k2) {
      r.u[k2] = __ldg(b0 + k2);
      r.v[k2] = __ldg(b0 + 32 * (KS / 2) + k2);
    }
  }
}

__device__ __forceinline__ void rotation_step(const QueryRot& r, const uint4 (&u)[KS / 2], const uint4 (&v)[KS / 2],
                                              u32 addr) {
  float c0[4] = {0.0f, 0.0f, 0.0f, 0.0f}, c1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int k2 = 0; k2 < KS / 2; ++k2) {
    mma(c0, r.a[2 * k2][0], r.a[2 * k2][1], r.a[2 * k2][2], r.a[2 * k2][3], u[k2].x, u[k2].y);
    mma(c0, r.a[2 * k2 + 1][0], r.a[2 * k2 + 1][1], r.a[2 * k2 + 1][2], r.a[2 * k2 + 1][3], u[k2].z, u[k2].w);
    mma(c1, r.a[2 * k2][0], r.a[2 * k2][1], r.a[2 * k2][2], r.a[2 * k2][3], v[k2].x, v[k2].y);
    mma(c1, r.a[2 * k2 + 1][0], r.a[2 * k2 + 1][1], r.a[2 * k2 + 1][2], r.a[2 * k2 + 1][3], v[k2].z, v[k2].w);
  }
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(pack_h2(c0[0], c0[1])),
               "r"(pack_h2(c0[2], c0[3])), "r"(pack_h2(c1[0], c1[1])), "r"(pack_h2(c1[2], c1[3])) : "memory");
}

__device__ __forceinline__ void rotation_store(const Params& p, const QueryRot& r, u32 qsm, int warp, int lane) {
  if (warp < KS) rotation_step(r, r.u, r.v, qsm + (warp * 32 + lane) * 16);
#pragma unroll
  for (int s = warp + WARPS; s < KS; s += WARPS) {  // head dim 256: the warp's second k-step
    uint4 u[KS / 2], v[KS / 2];
    const uint4* b0 = rotation_b(p, s, lane);
#pragma unroll
    for (int k2 = 0; k2 < KS / 2; ++k2) {
      u[k2] = __ldg(b0 + k2);
      v[k2] = __ldg(b0 + 32 * (KS / 2) + k2);
    }
    rotation_step(r, u, v, qsm + (s * 32 + lane) * 16);
  }
}

#ifndef HAD  // 1: Pi = H diag(s) / sqrt(D), a randomized Hadamard transform (`p.sgn`): the query and the merge rotate
             // by butterflies across a warp and read no Pi; else by Pi, a dense matrix (`pif`, `pih`)
#define HAD 0
#endif
#ifndef PIH  // 1: the merge rotates by Pi's fp16 copy (half the bytes from L2 on the call's last CTA), else its fp32
#define PIH 1
#endif

// x <- H x, the unnormalized Walsh-Hadamard transform of a D-vector held by a warp, lane L holding channels
// L DPL + i in x[i]: log2(DPL) butterfly stages in registers, then five across lanes (one shuffle a value each)
__device__ __forceinline__ void fwht_warp(float (&x)[DPL], int lane) {
#pragma unroll
  for (int h = 1; h < DPL; h <<= 1)
#pragma unroll
    for (int i = 0; i < DPL; ++i)
      if (!(i & h)) {
        const float a = x[i], b = x[i + h];
        x[i] = a + b;
        x[i + h] = a - b;
      }
#pragma unroll
  for (int m = 1; m < 32; m <<= 1) {
    const bool up = lane & m;
#pragma unroll
    for (int i = 0; i < DPL; ++i) {
      const float y = __shfl_xor_sync(0xffffffffu, x[i], m);
      x[i] = up ? y - x[i] : x[i] + y;
    }
  }
}

// The word of `p.sgn` that holds this lane's signs (channels lane DPL + i)
__device__ __forceinline__ u32 lane_signs(const Params& p, int lane) { return __ldg(p.sgn + ((lane * DPL) >> 5)); }

// x[i] *= scale s_c for this lane's channels c = lane DPL + i, their signs in `w` (`lane_signs`)
__device__ __forceinline__ void signs_scale(u32 w, float (&x)[DPL], int lane, float scale) {
  w >>= (lane * DPL) & 31;
#pragma unroll
  for (int i = 0; i < DPL; ++i) x[i] = __uint_as_float(__float_as_uint(x[i] * scale) ^ (((w >> i) & 1u) << 31));
}

// HAD: the query rotated by butterflies instead (scale_log2 Pi q = scale_log2 H (s * q) / sqrt(D)), stored as the
// same A fragments. Warp w rotates rows w, w + WARPS (zeros from G n on); `load` requests a row's DPL elements a lane
// as raw words (converted in `store`, after the tables are stored: one round trip with theirs).
#define HROWS (16 / WARPS)
#define QCE (DPL < 4 ? DPL : 4)                               // query elements a load (QV)
#define QWPL (Q_DT == 2 ? QCE : QCE / 2)                      // 32-bit words a load (QV)
#define QW (QV ? DPL / QCE * QWPL : DPL)                      // registers a lane's elements arrive in
struct QueryHad {
  u32 w[HROWS][QW];
  u32 sg;  // the lane's signs
};

__device__ __forceinline__ void had_load(const Params& p, int bh, int warp, int lane, QueryHad& r) {
  const int b = bh / p.hkv, h = bh % p.hkv, live = p.group * p.nq;
  r.sg = lane_signs(p, lane);
#pragma unroll
  for (int j = 0; j < HROWS; ++j) {
    const int row = warp + WARPS * j;
    if (row >= live) {
#pragma unroll
      for (int k = 0; k < QW; ++k) r.w[j][k] = 0u;
      continue;
    }
    const i64 o = b * p.sqb + static_cast<i64>(h * p.group + row / p.nq) * p.sqh +
                  static_cast<i64>(row % p.nq) * p.sqn + lane * DPL;  // (elements)
    if constexpr (QV) {
      const unsigned char* src = reinterpret_cast<const unsigned char*>(p.qx) + o * (Q_DT == 2 ? 4 : 2);
#pragma unroll
      for (int c = 0; c < DPL / QCE; ++c) {
        const unsigned char* s = src + c * QWPL * 4;
        if constexpr (QWPL == 4) {
          const uint4 v = *reinterpret_cast<const uint4*>(s);
          r.w[j][4 * c] = v.x; r.w[j][4 * c + 1] = v.y; r.w[j][4 * c + 2] = v.z; r.w[j][4 * c + 3] = v.w;
        } else if constexpr (QWPL == 2) {
          const uint2 v = *reinterpret_cast<const uint2*>(s);
          r.w[j][2 * c] = v.x; r.w[j][2 * c + 1] = v.y;
        } else {
          r.w[j][c] = *reinterpret_cast<const u32*>(s);
        }
      }
    } else {
#pragma unroll
      for (int k = 0; k < DPL; ++k)
        r.w[j][k] = Q_DT == 2 ? reinterpret_cast<const u32*>(p.qx)[o + k] : reinterpret_cast<const u16*>(p.qx)[o + k];
    }
  }
}

__device__ __forceinline__ float q_elt(u32 bits) {  // a 16-bit query element in the low half of `bits`
  return Q_DT == 0 ? h2f(static_cast<u16>(bits & 0xffff)) : __uint_as_float(bits << 16);
}

__device__ __forceinline__ void had_store(const Params& p, const QueryHad& r, u32 qsm, int warp, int lane) {
#pragma unroll
  for (int j = 0; j < HROWS; ++j) {
    const int row = warp + WARPS * j;
    float x[DPL];
#pragma unroll
    for (int i = 0; i < DPL; ++i) {
      if constexpr (Q_DT == 2) x[i] = __uint_as_float(r.w[j][i]);
      else if constexpr (QV) x[i] = q_elt(r.w[j][i / 2] >> (16 * (i & 1)));
      else x[i] = q_elt(r.w[j][i]);
    }
    signs_scale(r.sg, x, lane, p.scale_log2 * rsqrtf(static_cast<float>(D)));
    fwht_warp(x, lane);
    // channel c = lane DPL + i is lane l4 = c / (D / 4)'s k-step (c % (D / 4)) / 4, register pair (c % 4) / 2
#pragma unroll
    for (int i = 0; i < DPL; i += 2) {
      const int rem = (lane & 7) * DPL + i, s = rem >> 2, k2 = (rem >> 1) & 1;
      const u32 addr = qsm + ((s * 32 + (row & 7) * 4 + (lane >> 3)) * 4 + 2 * k2 + (row >> 3)) * 4;
      asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(pack_h2(x[i], x[i + 1])) : "memory");
    }
  }
}

// One split of the packed history (the sinks excluded; `cuda.split_range` places the splits alike, sinks aside), the
// warps interleaved by 16-token tiles; the CTA's partial goes to slot `split` in the rotated domain, by planes.
__device__ __forceinline__ void packed_part(const Params& p, unsigned char* smem, int split, int bh) {
  const int b = bh / p.hkv, h = bh % p.hkv;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, l4 = lane & 3;

  const int lq = STATIC ? static_cast<int>(*p.from_ptr) : p.lq;  // (used after the loads below are out)
  // the pair tables of this KV head, KR / VR copies (copy c of entry e at word e * R + c)
  const u32 ktb = shared_addr(smem) + STAGE_BYTES, vtb = ktb + KTAB_BYTES;
  TableFill<KENT, KR, LOGKR> kfill;
  TableFill<VENT, VR, LOGVR> vfill;
  kfill.load(p.ktab + h * p.ktab_sh, tid);
  vfill.load(p.vtab + h * p.vtab_sh, tid);
#if HAD
  QueryHad qr;  // (the query's loads with the tables': one round trip)
  had_load(p, bh, warp, lane, qr);
#else
  QueryRot qr;  // (the query's loads and Pi's with the tables': one round trip)
  rotation_load(p, bh, warp, lane, qr);
#endif
  kfill.store(reinterpret_cast<u32*>(smem + STAGE_BYTES), tid);
  vfill.store(reinterpret_cast<u32*>(smem + STAGE_BYTES + KTAB_BYTES), tid);
  const int ls = min(p.sinks, lq);
  // the history (and, where the last split's CTA takes the exact copies too, p.fold tokens more) in equal parts, cut
  // at the nearest multiples of 16 (whole tiles, dealt to the warps in turn); the last split ends at the history's end
  const i64 span = lq + (p.num_splits > 1 ? p.fold : 0);
  auto cut = [&](int s) {  // (in 32 bits where they hold the product: a 64-bit division is a long subroutine)
    const i64 x = span * s;
    const i64 c = x < 0xffffffffll ? static_cast<i64>(static_cast<u32>(x) / static_cast<u32>(p.num_splits))
                                   : x / p.num_splits;
    return static_cast<int>((c + 8) & ~15);
  };
  const int start = max(min(cut(split), lq), ls);
  const int end = split == p.num_splits - 1 ? lq : min(cut(split + 1), lq);
  const int live = p.group * p.nq;
  // the last 16-row tile inside the buffer (slots >= 16; even with NVEC, as the launcher checks: norm pairs)
  const int last_tb = p.slots - 16;

  // Q's A registers of k-step s (rows g, g + 8; channels l4 D/4 + 4s + {0, 1} (a0, a1) and + {2, 3} (a2, a3)) in
  // shared memory after the tables, in fragment order (k-step, lane: 4 words): one LDS.128 each in the loop, or
  // (QREG) once before it
  const u32 qsm = shared_addr(smem) + STAGE_BYTES + KTAB_BYTES + VTAB_BYTES;

  const unsigned char* kbase = p.kp + b * p.skpb + h * p.skph;
  const unsigned char* vbase = p.vp + b * p.svpb + h * p.svph;
  const i64 knoff = b * p.sknb + h * p.sknh, vnoff = b * p.svnb + h * p.svnh;
  // mask rows of this lane's S rows (g, g + 8): row r is query r % n of query head h * G + r / n
  const unsigned char* mrow[NMROWS];
  bool rok[NMROWS];
#pragma unroll
  for (int i = 0; i < NMROWS; ++i) {
    const int r = g + 8 * i;
    rok[i] = r < live;
    const int rr = rok[i] ? r : 0;
    mrow[i] = p.mask + (b * p.smb + static_cast<i64>(h * p.group + rr / p.nq) * p.smh +
                        static_cast<i64>(rr % p.nq) * p.smi) * p.mask_elt;
  }

  // this lane's copy of each table, as a byte offset in it: a code pair's bits OR into it, the table's base is added
  const u32 klane = static_cast<u32>(lane & (KR - 1)) << 2;
  const u32 vlane = static_cast<u32>(lane & (VR - 1)) << 2;

  float acc[KS][NQ][4];
#pragma unroll
  for (int j = 0; j < KS; ++j)
#pragma unroll
    for (int n = 0; n < NQ; ++n) acc[j][n][0] = acc[j][n][1] = acc[j][n][2] = acc[j][n][3] = 0.0f;
  float m_i[NMROWS], l_i[NMROWS];
#pragma unroll
  for (int i = 0; i < NMROWS; ++i) { m_i[i] = NEG_INF; l_i[i] = 0.0f; }

  // a tile: rows [tb, tb + 16) of the packed keys and values and their norms, copied whole into a stage; each lane's
  // sources and destination are set once, a tile adds its offset
  unsigned char* ring = smem + warp * STAGES * TILE_BYTES;
  const u32 dst0 = shared_addr(ring) + lane * CHUNK;
  const u32 ndst0 = shared_addr(ring) + 16 * (KPT + VPT) + 4 * lane;
  const unsigned char* gk0 = kbase + lane * CHUNK;
  const unsigned char* gv0 = vbase + lane * CHUNK;
  const unsigned char* gkn0 = reinterpret_cast<const unsigned char*>(p.kn) + knoff * KNB + 4 * lane;
  const unsigned char* gvn0 = reinterpret_cast<const unsigned char*>(p.vn) + vnoff * VNB + 4 * lane;
  auto issue = [&](int t, int stage) {
    const i64 tb = min(t, last_tb);
    const u32 st = dst0 + stage * TILE_BYTES;
    const unsigned char* gk = gk0 + tb * KPT;
    const unsigned char* gv = gv0 + tb * VPT;
#pragma unroll
    for (int c = 0; c < (16 * KPT / CHUNK + 31) / 32; ++c)
      if (lane + 32 * c < 16 * KPT / CHUNK) cp_async<CHUNK>(st + 32 * c * CHUNK, gk + 32 * c * CHUNK);
#pragma unroll
    for (int c = 0; c < (16 * VPT / CHUNK + 31) / 32; ++c)
      if (lane + 32 * c < 16 * VPT / CHUNK) cp_async<CHUNK>(st + 16 * KPT + 32 * c * CHUNK, gv + 32 * c * CHUNK);
    if constexpr (NVEC) {  // norms: 4-byte pieces (tb is even)
      const u32 nst = ndst0 + stage * TILE_BYTES;
      if (lane < 4 * KNB) cp_async<4>(nst, gkn0 + tb * KNB);
      if (lane < 4 * VNB) cp_async<4>(nst + 16 * KNB, gvn0 + tb * VNB);
    }
  };

  u32 qa[QREG ? (QPAIR ? KS / 2 : KS) : 1][4];
  auto compute = [&](int t, const unsigned char* st, const MaskTile& mk) {
    const int tb = min(t, last_tb);
    const int t0 = tb + 2 * l4;
    u32 kw[2][Span<KSPAN, KPT>::NW];
    load_span<KSPAN, KPT>(st + g * KPT, l4 * KSPAN, kw[0]);
    load_span<KSPAN, KPT>(st + (g + 8) * KPT, l4 * KSPAN, kw[1]);
    float kn[4], vn[4];
    if constexpr (NVEC) {
      const unsigned char* sn = st + 16 * (KPT + VPT);
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {  // rows 2 l4 + 8 h2 and the next one: one load each
        load_pair<KN_F32>(sn, 2 * l4 + 8 * h2, kn[2 * h2], kn[2 * h2 + 1]);
        load_pair<VN_F32>(sn + 16 * KNB, 2 * l4 + 8 * h2, vn[2 * h2], vn[2 * h2 + 1]);
      }
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) {  // norms not in pairs (not in the ring): one load each, from global memory
        const i64 i = t0 + (j & 1) + 8 * (j >> 1);
        kn[j] = load_norm(p.kn, knoff + i, KN_F32);
        vn[j] = load_norm(p.vn, vnoff + i, VN_F32);
      }
    }
    // scores of rows tb .. tb + 15: two n-tiles of 8
    float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
    float s1[QPAIR ? 2 : 1][4] = {};  // (QPAIR) the odd k-steps' scores, in rows g + 8
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      u32 a0, a1, a2, a3;
      if constexpr (QREG) {
        const int j = QPAIR ? ks >> 1 : ks;
        a0 = qa[j][0]; a1 = qa[j][1]; a2 = qa[j][2]; a3 = qa[j][3];
      } else {
        asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(a0), "=r"(a1), "=r"(a2), "=r"(a3)
                     : "r"(qsm + (ks * 32 + lane) * 16));
      }
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        const u32 b0 = lds(ktb + pair_offset<KB, LOGKR>(kw[n], 2 * ks, klane));
        const u32 b1 = lds(ktb + pair_offset<KB, LOGKR>(kw[n], 2 * ks + 1, klane));
        if constexpr (QPAIR)
          mma((ks & 1) ? s1[n] : s[n], a0, a1, a2, a3, b0, b1);
        else
          mma(s[n], a0, a1, a2, a3, b0, b1);
      }
    }
    if constexpr (QPAIR)
#pragma unroll
      for (int n = 0; n < 2; ++n) { s[n][0] += s1[n][2]; s[n][1] += s1[n][3]; }
    u32 vw[4][Span<VSPAN, VPT>::NW];
#pragma unroll
    for (int j = 0; j < 4; ++j) load_span<VSPAN, VPT>(st + 16 * KPT + (2 * l4 + (j & 1) + 8 * (j >> 1)) * VPT,
                                                      g * VSPAN, vw[j]);
    // this lane's tokens j: tb + 2 l4 + (j & 1) + 8 (j >> 1); row i's score is s[j >> 1][2 i + (j & 1)]
    const int lo = max(t, start);
    bool tok_ok[4];
#pragma unroll
    for (int j = 0; j < 4; ++j)  // lo <= tok < end, one unsigned compare
      tok_ok[j] = static_cast<u32>(t0 + (j & 1) + 8 * (j >> 1) - lo) < static_cast<u32>(end - lo);
#if MASK_ROW
#pragma unroll
    for (int j = 0; j < 4; ++j) tok_ok[j] = tok_ok[j] && ((mk.bytes >> (8 * j)) & 0xffu);
#endif
    float alpha[NMROWS];
    bool moved = false;
    u32 pb[NMROWS][2];
#pragma unroll
    for (int i = 0; i < NMROWS; ++i) {
      float x[4];
      float mx = NEG_INF;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float v = s[j >> 1][2 * i + (j & 1)] * kn[j];
#if MASK_KIND != 0 && !MASK_ROW
        v += mk.v[i][j];
#endif
        x[j] = (tok_ok[j] && rok[i]) ? v : NEG_INF;
        mx = fmaxf(mx, x[j]);
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m_i[i], mx);
      const float m_use = m_new == NEG_INF ? 0.0f : m_new;
      alpha[i] = ex2(m_i[i] - m_use);
      moved |= m_i[i] != NEG_INF && m_new != m_i[i];
      m_i[i] = m_new;
      float pv[4], sum = 0.0f;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float pj = ex2(x[j] - m_use);
        sum += pj;
        pv[j] = x[j] == NEG_INF ? 0.0f : pj * vn[j];
      }
      l_i[i] = l_i[i] * alpha[i] + sum;
      pb[i][0] = pack_h2(pv[0], pv[1]);
      pb[i][1] = pack_h2(pv[2], pv[3]);
    }
    // rescale the accumulators when a finite running max moved (a row that has seen no token, or a row past the
    // live ones, has an accumulator of zeros: its alpha of 0 needs no rescale): acc column 2 l4 (+1) of query n-tile
    // n is query 8 n + 2 l4 (+1), whose alpha lives in lanes 4 (2 l4 (+1)) (S row g = that query, i = n)
    if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
      for (int n = 0; n < NQ; ++n) {
        const float a0 = __shfl_sync(0xffffffffu, alpha[n], 8 * l4);
        const float a1 = __shfl_sync(0xffffffffu, alpha[n], 8 * l4 + 4);
#pragma unroll
        for (int mt = 0; mt < KS; ++mt) {
          acc[mt][n][0] *= a0; acc[mt][n][1] *= a1; acc[mt][n][2] *= a0; acc[mt][n][3] *= a1;
        }
      }
    }
    // O^T += V^T P^T: m-tile mt is code pair mt of the lane's channel span (rows g, g + 8)
#pragma unroll
    for (int mt = 0; mt < KS; ++mt) {
      u32 L[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) L[j] = lds(vtb + pair_offset<VB, LOGVR>(vw[j], mt, vlane));
      const u32 a0 = prmt(L[0], L[1], 0x5410), a1 = prmt(L[0], L[1], 0x7632);
      const u32 a2 = prmt(L[2], L[3], 0x5410), a3 = prmt(L[2], L[3], 0x7632);
#pragma unroll
      for (int n = 0; n < NQ; ++n) mma(acc[mt][n], a0, a1, a2, a3, pb[n][0], pb[n][1]);
    }
  };

  // MASK_ROW: the mask's one row as 16-bit words (two tokens each)
  const u16* mrow16 = reinterpret_cast<const u16*>(mrow[0]);
  auto load_mask = [&](int t, MaskTile& mk) {
#if MASK_ROW  // the row's tokens 2 l4, + 1 and 8 + 2 l4, + 1 of the tile (tiles start at even tokens)
    const int w = (min(t, last_tb) >> 1) + l4;
    mk.bytes = static_cast<u32>(mrow16[w]) | (static_cast<u32>(mrow16[w + 4]) << 16);
#elif MASK_KIND != 0
    const int t0 = min(t, last_tb) + 2 * l4;
#pragma unroll
    for (int i = 0; i < NMROWS; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j)
        mk.v[i][j] = mask_value(mrow[i], static_cast<i64>(t0 + (j & 1) + 8 * (j >> 1)) * p.smt);
#endif
  };

  // tiles of 16 rows from a multiple of 16, warps interleaved; each warp keeps STAGES - 1 tiles in flight
  const int step = 16 * WARPS;
  const int t0 = (start & ~15) + 16 * warp;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (t0 + s * step < end) issue(t0 + s * step, s);
    cp_commit();
  }
#if HAD
  had_store(p, qr, qsm, warp, lane);
#else
  rotation_store(p, qr, qsm, warp, lane);
#endif
  __syncthreads();  // the tables and the query fragments written
  if constexpr (QPAIR)
#pragma unroll
    for (int j = 0; j < KS / 2; ++j) {  // words 0 and 2 (rows g) of k-steps 2j and 2j + 1
      const u32 e = qsm + (2 * j * 32 + lane) * 16, o = e + 32 * 16;
      qa[j][0] = lds(e); qa[j][1] = lds(o); qa[j][2] = lds(e + 8); qa[j][3] = lds(o + 8);
    }
  else if constexpr (QREG)
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
      asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(qa[ks][0]), "=r"(qa[ks][1]), "=r"(qa[ks][2]),
                   "=r"(qa[ks][3]) : "r"(qsm + (ks * 32 + lane) * 16));
  MaskTile mk, mk_next;
  if (t0 < end) load_mask(t0, mk);
  int stage = 0;
  for (int t = t0; t < end; t += step) {
    const int tn = t + (STAGES - 1) * step;
    if (tn < end) issue(tn, stage == 0 ? STAGES - 1 : stage - 1);
    cp_commit();
    if (t + step < end) load_mask(t + step, mk_next);
    cp_wait<STAGES - 1>();
    __syncwarp();
    compute(t, ring + stage * TILE_BYTES, mk);
    __syncwarp();  // every lane is done with this stage before it is refilled
#if MASK_KIND != 0
    mk = mk_next;
#endif
    stage = stage == STAGES - 1 ? 0 : stage + 1;
  }
  cp_wait<0>();

  // merge the warps' partials in shared memory (the tables are done with), then store the CTA's partial
#pragma unroll
  for (int i = 0; i < NMROWS; ++i) {
    l_i[i] += __shfl_xor_sync(0xffffffffu, l_i[i], 1);
    l_i[i] += __shfl_xor_sync(0xffffffffu, l_i[i], 2);
  }
  __syncthreads();
  constexpr int RQ = 8 * NQ;
  float* wm = reinterpret_cast<float*>(smem);            // (WARPS, RQ)
  float* wl = wm + WARPS * RQ;                           // (WARPS, RQ)
  float* wa = wl + WARPS * RQ;                           // (WARPS, RQ, PSTRIDE), rotated channels, see PSTRIDE
  if (l4 == 0) {
#pragma unroll
    for (int i = 0; i < NMROWS; ++i) {
      wm[warp * RQ + g + 8 * i] = m_i[i];
      wl[warp * RQ + g + 8 * i] = l_i[i];
    }
  }
#pragma unroll
  for (int mt = 0; mt < KS; ++mt)
#pragma unroll
    for (int n = 0; n < NQ; ++n) {
      const int q0 = 8 * n + 2 * l4;  // channels g D/8 + 2 mt (+ 1), at positions 16 mt (+ 8) + g
      float* a = wa + (warp * RQ + q0) * PSTRIDE + 16 * mt + g;
      a[0] = acc[mt][n][0];
      a[PSTRIDE] = acc[mt][n][1];
      a[8] = acc[mt][n][2];
      a[PSTRIDE + 8] = acc[mt][n][3];
    }
  __syncthreads();
  store_partial<RQ, true>(wm, wl, wa, p, partial_base(p, bh) + split, live);
}

// The exact copies (sinks, then the window) with the unrotated query, in batches of XB tokens copied whole into shared
// memory first (cp.async, XVEC bytes a copy: one round trip a batch, where loads by the warps that use them took one
// per few tokens), then by warps (an online softmax each, XTPI tokens a step: one update per row for all of them);
// part x's partial goes to slot num_splits + x.
#ifndef XB
#define XB 64
#endif
#ifndef XVEC
#define XVEC 16
#endif
#define XBYTES (X_DT == 2 ? 4 : 2)

// The packed tokens lq, the exact copies' window tokens lr and sinks ls of this call (a static cache's, read on the
// device)
__device__ __forceinline__ void exact_lengths(const Params& p, int& lq, int& lr, int& ls) {
  lq = p.lq; lr = p.lr; ls = p.sinks;
  if (STATIC) {
    const int T = static_cast<int>(*p.len_ptr);
    lq = static_cast<int>(*p.from_ptr);
    lr = T - lq;
    ls = min(ls, lq);
  }
}

// Part x of nx of the ne exact tokens, [lo, hi): cut at the nearest multiples of 16 (whole tiles), the last ending at ne
__device__ __forceinline__ void exact_range(int ne, int x, int nx, int& lo, int& hi) {
  lo = min(((ne * x) / nx + 8) & ~15, ne);
  hi = x == nx - 1 ? ne : min(((ne * (x + 1)) / nx + 8) & ~15, ne);
}

// Exact token ee's key or value row: ee < ls is sink ee; else position lq + (ee - ls), at window slot pos % window
// (static) or pos - lq
__device__ __forceinline__ const unsigned char* exact_row(const Params& p, int b, int h, int lq, int ls, int ee,
                                                          bool value) {
  if (ee < ls) {
    const i64 o = b * (value ? p.ssvb : p.sskb) + h * (value ? p.ssvh : p.sskh) + static_cast<i64>(ee) * D;
    return reinterpret_cast<const unsigned char*>(value ? p.sv : p.sk) + o * XBYTES;
  }
  const int pos = lq + ee - ls;
  const int slot = STATIC ? pos % p.window : pos - lq;
  const i64 o = b * (value ? p.srvb : p.srkb) + h * (value ? p.srvh : p.srkh) + static_cast<i64>(slot) * D;
  return reinterpret_cast<const unsigned char*>(value ? p.rv : p.rk) + o * XBYTES;
}
// Tokens a warp takes a step in the exact part: ROWS x XTPI scores fill at most a warp's lanes once reduced, and the
// keys and values of a step take at most 64 registers
#define XTPI_CAP(a, b) ((a) < (b) ? (a) : (b))
#define XTPI XTPI_CAP(XTPI_CAP(8, 32 / ROWS), 32 / DPL)
#define XV (ROWS * XTPI)                     // scores a step (a power of two, at most 32)
#define XSH (XV == 32 ? 0 : XV == 16 ? 1 : XV == 8 ? 2 : XV == 4 ? 3 : XV == 2 ? 4 : 5)  // lane L holds score L >> XSH

// The DPL elements of this lane's channels of a row in shared memory, as floats (one load where they allow)
__device__ __forceinline__ void load_dpl(const unsigned char* row, int lane, float (&x)[DPL]) {
  if constexpr (X_DT == 2) {
#pragma unroll
    for (int k = 0; k < DPL; k += 2) {
      const float2 v = reinterpret_cast<const float2*>(row)[lane * DPL / 2 + k / 2];
      x[k] = v.x; x[k + 1] = v.y;
    }
  } else {
#pragma unroll
    for (int k = 0; k < DPL; k += 2) {
      const u32 v = reinterpret_cast<const u32*>(row)[lane * DPL / 2 + k / 2];
      x[k] = to_f32<X_DT>(&v, 0);
      x[k + 1] = to_f32<X_DT>(&v, 1);
    }
  }
}

// The sums over a warp's lanes of N values a lane, transposed: at each xor step a lane keeps half of its values and
// sends the other half to its partner (one shuffle per kept value), so that lane L ends with the sum of value
// L >> (5 - log2 N) in v[0] (five shuffles a value would take 5 N).
template <int N, int LVL>
__device__ __forceinline__ void xreduce(float* v, int lane) {
  if constexpr (LVL < 5) {
    constexpr int M = 16 >> LVL;
    if constexpr (N > 1) {
      const bool up = lane & M;
#pragma unroll
      for (int i = 0; i < N / 2; ++i) {
        const float send = up ? v[i] : v[N / 2 + i], keep = up ? v[N / 2 + i] : v[i];
        v[i] = keep + __shfl_xor_sync(0xffffffffu, send, M);
      }
      xreduce<N / 2, LVL + 1>(v, lane);
    } else {
      v[0] += __shfl_xor_sync(0xffffffffu, v[0], M);
      xreduce<1, LVL + 1>(v, lane);
    }
  }
}
// A dense rotation's Pi, read by the merge (its fp16 rows where PIH): into L2 now, 128-byte lines
__device__ __forceinline__ void prefetch_pi(const Params& p, int tid) {
#if !HAD
  for (int i = tid; i < D * D / (PIH ? 64 : 32); i += WARPS * 32)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(PIH ? static_cast<const void*>(p.pih + 16 * i) : p.pi + 32 * i));
#endif
}

__device__ __forceinline__ void exact_simt(const Params& p, unsigned char* smem, int bh, int x, int nx) {
  float* qs = reinterpret_cast<float*>(smem);  // (ROWS, D) the query, scaled for exp2
  float* wm = qs + ROWS * D;                   // (WARPS, ROWS)
  float* wl = wm + WARPS * ROWS;               // (WARPS, ROWS)
  unsigned char* xs = reinterpret_cast<unsigned char*>(wl + WARPS * ROWS);  // (XB, 2, D) a batch's keys and values
  float* wacc = reinterpret_cast<float*>(xs);  // after the batches: (WARPS, ROWS, D) the warps' partials
  const int b = bh / p.hkv, h = bh % p.hkv;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int live = p.group * p.nq;
  prefetch_pi(p, tid);
  int lq, lr, ls;
  exact_lengths(p, lq, lr, ls);
  const int T = lq + lr;

  // A step: the warp's XTPI tokens. Lane L ends with score L >> XSH of the step (row xr, token xu) and keeps the
  // online softmax's max of that row and its sum over its own tokens (the row's lanes add theirs at the end); every
  // lane keeps the accumulator of its DPL channels for every row.
  const int xi = lane >> XSH, xr = xi / XTPI, xu = xi % XTPI;
  float m_x = NEG_INF, l_x = 0.0f, a[ROWS][DPL];
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
#pragma unroll
    for (int k = 0; k < DPL; ++k) a[r][k] = 0.0f;
  auto row_of = [&](int ee, bool value) { return exact_row(p, b, h, lq, ls, ee, value); };
  int e_lo, ne;
  exact_range(ls + lr, x, nx, e_lo, ne);
  for (int e0 = e_lo; e0 < ne; e0 += XB) {
    const int nb = min(XB, ne - e0);
    constexpr int CPR = D * XBYTES / (XVEC > 0 ? XVEC : 4);  // copies a row
    for (int c = tid; c < nb * 2 * CPR; c += WARPS * 32) {
      const int e = c / (2 * CPR), v = (c / CPR) & 1, k = c % CPR;
      const unsigned char* src = row_of(e0 + e, v);
      unsigned char* dst = xs + (2 * e + v) * D * XBYTES;
      if constexpr (XVEC > 0) {
        cp_async<XVEC>(shared_addr(dst + k * XVEC), src + k * XVEC);
      } else {  // rows not 4-byte aligned: two bytes at a time
        reinterpret_cast<u16*>(dst)[2 * k] = reinterpret_cast<const u16*>(src)[2 * k];
        reinterpret_cast<u16*>(dst)[2 * k + 1] = reinterpret_cast<const u16*>(src)[2 * k + 1];
      }
    }
    cp_commit();
    if (e0 == e_lo)  // (after the first batch's copies are out: both round trips at once)
      load_query<ROWS>(p.qx, p.sqb, p.sqh, p.sqn, p.group, p.nq, p.scale_log2, b, h, live, qs);
    cp_wait<0>();
    __syncthreads();  // the batch (and, the first time, the query) in shared memory
    for (int t0 = warp; t0 < nb; t0 += WARPS * XTPI) {  // tokens t0 + WARPS u, u < XTPI
      float kx[XTPI][DPL], vx[XTPI][DPL];
#pragma unroll
      for (int u = 0; u < XTPI; ++u) {
        const int e = min(t0 + WARPS * u, nb - 1);
        const unsigned char* kr = xs + 2 * e * D * XBYTES;
        load_dpl(kr, lane, kx[u]);
        load_dpl(kr + D * XBYTES, lane, vx[u]);
      }
      // this lane's part of every (row, token) score, then the sums over the lanes, transposed (`xreduce`)
      float sc[ROWS * XTPI];
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        float q[DPL];
#pragma unroll
        for (int k = 0; k < DPL; ++k) q[k] = qs[r * D + lane * DPL + k];
#pragma unroll
        for (int u = 0; u < XTPI; ++u) {
          float v = 0.0f;
#pragma unroll
          for (int k = 0; k < DPL; ++k) v += q[k] * kx[u][k];
          sc[r * XTPI + u] = v;
        }
      }
      xreduce<ROWS * XTPI, 0>(sc, lane);
      float x = sc[0];  // score (xr, xu)
      {  // (the mask is read for live rows and tokens only: no row or column past its end)
        const int e = t0 + WARPS * xu, ee = e0 + e;
        const int pos = ee < ls ? ee : lq + ee - ls;
        const int qi = xr % p.nq;
        if (e >= nb || xr >= live) {
          x = NEG_INF;
        } else {
#if MASK_KIND == 0
          if (pos > T - p.nq + qi) x = NEG_INF;
#else
          const int hh = h * p.group + xr / p.nq;
          x += mask_value(p.mask + (b * p.smb + hh * p.smh + static_cast<i64>(qi) * p.smi) * p.mask_elt,
                          static_cast<i64>(pos) * p.smt);
#endif
        }
      }
      float mx = x;
#pragma unroll
      for (int o = 1 << XSH; o < (XTPI << XSH); o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float m_new = fmaxf(m_x, mx);
      const float m_use = m_new == NEG_INF ? 0.0f : m_new;
      const float alpha = ex2(m_x - m_use);
      const float pr = ex2(x - m_use);
      m_x = m_new;
      l_x = l_x * alpha + pr;
      // every row's rescale and probabilities to every lane: a[r] = a[r] alpha_r + sum_u p(r, u) v_u
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        if (r >= live) continue;
        const float al = __shfl_sync(0xffffffffu, alpha, (r * XTPI) << XSH);
        float pu[XTPI];
#pragma unroll
        for (int u = 0; u < XTPI; ++u) pu[u] = __shfl_sync(0xffffffffu, pr, (r * XTPI + u) << XSH);
#pragma unroll
        for (int k = 0; k < DPL; ++k) {
          float v = a[r][k] * al;
#pragma unroll
          for (int u = 0; u < XTPI; ++u) v += pu[u] * vx[u][k];
          a[r][k] = v;
        }
      }
    }
    __syncthreads();  // the batch read before the next one (or the warps' partials) overwrites it
  }
#pragma unroll
  for (int o = 1 << XSH; o < (XTPI << XSH); o <<= 1) l_x += __shfl_xor_sync(0xffffffffu, l_x, o);  // the row's sum
  if (xu == 0 && (lane & ((1 << XSH) - 1)) == 0) { wm[warp * ROWS + xr] = m_x; wl[warp * ROWS + xr] = l_x; }
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    float* dst = wacc + (warp * ROWS + r) * D + lane * DPL;  // vector stores (scalar ones: 4-way bank conflicts)
    if constexpr (DPL % 4 == 0) {
#pragma unroll
      for (int k = 0; k < DPL; k += 4)
        reinterpret_cast<float4*>(dst)[k / 4] = make_float4(a[r][k], a[r][k + 1], a[r][k + 2], a[r][k + 3]);
    } else {
#pragma unroll
      for (int k = 0; k < DPL; k += 2) reinterpret_cast<float2*>(dst)[k / 2] = make_float2(a[r][k], a[r][k + 1]);
    }
  }
  __syncthreads();
  store_partial<ROWS, false>(wm, wl, wacc, p, partial_base(p, bh) + p.num_splits + x, live);
}

// The exact copies on tensor cores where they are fp16 or bf16 (XMMA): S = Q K^T and O^T = V^T P^T by mma.m16n8k16
// in the copies' type, in the packed part's fragment layout (the scores' C registers are P^T's B registers), with the
// key and value fragments read by ldmatrix (the values' transposed) from rows of XSTRIDE bytes: 16 bytes of padding
// put the 8 rows of a matrix in distinct banks. Warp w takes the 16-token tiles w, w + WARPS, ... of each batch;
// the query's A fragments (scaled for exp2, in the copies' type) are stored once in fragment order.
#define XMMA (X_DT != 2)
#define XSTRIDE (D * 2 + 16)

__device__ __forceinline__ void mma_x(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
#if X_DT == 1
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
  mma(c, a0, a1, a2, a3, b0, b1);
#endif
}

__device__ __forceinline__ u32 pack_x(float lo, float hi) {  // two values in the copies' 16-bit type
#if X_DT == 1
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return pack_h2(lo, hi);
#endif
}

template <bool TRANS>
__device__ __forceinline__ void ldsm4(u32 addr, u32 (&r)[4]) {
  if constexpr (TRANS)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

__device__ __forceinline__ void exact_mma(const Params& p, unsigned char* smem, int bh_, int x, int nx) {
  int bh;  // (opaque: values derived from it here and in the packed part after it in the last split's CTA are not
           // kept from one to the other, which would spill in the packed loop)
  asm volatile("mov.b32 %0, %1;" : "=r"(bh) : "r"(bh_));
  static_assert(!XMMA || XB % 16 == 0, "the exact copies' batches are whole 16-token tiles");
  constexpr int RQ = 8 * NQ;
  float* wm = reinterpret_cast<float*>(smem);   // (WARPS, RQ)
  float* wl = wm + WARPS * RQ;                  // (WARPS, RQ)
  const u32 qf = shared_addr(wl + WARPS * RQ);  // (KS, 32 lanes, 4 words) the query's A fragments
  unsigned char* xs = reinterpret_cast<unsigned char*>(wl + WARPS * RQ) + 32 * D;  // XB key rows, then XB value rows
  float* wa = reinterpret_cast<float*>(xs);     // after the batches: (WARPS, RQ, D) the warps' partials
  const int b = bh / p.hkv, h = bh % p.hkv;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, l4 = lane & 3;
  const int live = p.group * p.nq;
  int lq, lr, ls;
  exact_lengths(p, lq, lr, ls);
  const int T = lq + lr;
  auto row_of = [&](int ee, bool value) { return exact_row(p, b, h, lq, ls, ee, value); };

  float acc[KS][NQ][4];
#pragma unroll
  for (int j = 0; j < KS; ++j)
#pragma unroll
    for (int n = 0; n < NQ; ++n) acc[j][n][0] = acc[j][n][1] = acc[j][n][2] = acc[j][n][3] = 0.0f;
  float m_i[NMROWS], l_i[NMROWS];
#pragma unroll
  for (int i = 0; i < NMROWS; ++i) { m_i[i] = NEG_INF; l_i[i] = 0.0f; }

  prefetch_pi(p, tid);
  const u32 xk = shared_addr(xs), xv = xk + XB * XSTRIDE;
  // the (batch, KV head)'s sink and window rows (keys, values): a token's row is one of them plus its slot's 2 D bytes
  const unsigned char* sinkb[2] = {
      reinterpret_cast<const unsigned char*>(p.sk) + (b * p.sskb + h * p.sskh) * 2,
      reinterpret_cast<const unsigned char*>(p.sv) + (b * p.ssvb + h * p.ssvh) * 2};
  const unsigned char* windowb[2] = {
      reinterpret_cast<const unsigned char*>(p.rk) + (b * p.srkb + h * p.srkh) * 2,
      reinterpret_cast<const unsigned char*>(p.rv) + (b * p.srvb + h * p.srvh) * 2};
  const int r0 = STATIC ? lq % p.window : 0;
  int e_lo, ne;
  exact_range(ls + lr, x, nx, e_lo, ne);
  for (int e0 = e_lo; e0 < ne; e0 += XB) {
    const int nb = min(XB, ne - e0);
    constexpr int CPR = D * 2 / (XVEC > 0 ? XVEC : 4);  // copies a row
    if constexpr (XVEC > 0 && (WARPS * 32) % CPR == 0) {  // a thread copies piece k of every (WARPS 32 / CPR)-th row
      const int k = tid % CPR;
      for (int rr = tid / CPR; rr < 2 * nb; rr += WARPS * 32 / CPR) {  // row rr: token rr / 2's key or value
        const int e = rr >> 1, v = rr & 1, ee = e0 + e;
        const unsigned char* src;
        if (ee < ls) {
          src = sinkb[v] + static_cast<i64>(ee) * (2 * D);
        } else {  // (a static window: position lq's slot r0, then in turn; the window holds lr <= window of them)
          int slot = ee - ls + r0;
          if (STATIC && slot >= p.window) slot -= p.window;
          src = windowb[v] + static_cast<i64>(slot) * (2 * D);
        }
        cp_async<XVEC>((v ? xv : xk) + e * XSTRIDE + k * XVEC, src + k * XVEC);
      }
    } else {
      for (int c = tid; c < nb * 2 * CPR; c += WARPS * 32) {
        const int e = c / (2 * CPR), v = (c / CPR) & 1, k = c % CPR;
        const unsigned char* src = row_of(e0 + e, v);
        const u32 dst = (v ? xv : xk) + e * XSTRIDE;
        if constexpr (XVEC > 0) {
          cp_async<XVEC>(dst + k * XVEC, src + k * XVEC);
        } else {  // rows not 4-byte aligned: two bytes at a time
          const u16* s16 = reinterpret_cast<const u16*>(src);
          const u32 w0 = s16[2 * k] | (static_cast<u32>(s16[2 * k + 1]) << 16);
          asm volatile("st.shared.b32 [%0], %1;" ::"r"(dst + 4 * k), "r"(w0) : "memory");
        }
      }
    }
    // the value rows past the batch up to its last tile's end: zeros (stale shared memory could hold NaN: 0 x NaN)
    for (int i = nb * D / 8 + tid; i < ((nb + 15) & ~15) * D / 8; i += WARPS * 32)
      asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};" ::"r"(xv + (i / (D / 8)) * XSTRIDE + (i % (D / 8)) * 16),
                   "r"(0u) : "memory");
    cp_commit();
    if (e0 == e_lo) {  // (after the first batch's copies are out: both round trips at once) the query's fragments: word
                    // (ks, lane (g, l4), j) = rows g + 8 (j & 1), channels 16 ks + 2 l4 + 8 (j >> 1) + {0, 1}
      constexpr int NI = KS * 128 / (WARPS * 32);  // words a thread (all its loads out before any is used)
      u32 raw[NI][2];
#pragma unroll
      for (int n = 0; n < NI; ++n) {
        const int i = n * WARPS * 32 + tid, j = i & 3, ln = (i >> 2) & 31, ks = i >> 7;
        const int r = (ln >> 2) + 8 * (j & 1), c = 16 * ks + 2 * (ln & 3) + 8 * (j >> 1);
        raw[n][0] = raw[n][1] = 0u;
        if (r < live) {
          const i64 o = b * p.sqb + static_cast<i64>(h * p.group + r / p.nq) * p.sqh +
                        static_cast<i64>(r % p.nq) * p.sqn + c;
#pragma unroll
          for (int k = 0; k < 2; ++k)
            raw[n][k] = Q_DT == 2 ? reinterpret_cast<const u32*>(p.qx)[o + k] : reinterpret_cast<const u16*>(p.qx)[o + k];
        }
      }
#pragma unroll
      for (int n = 0; n < NI; ++n) {
        float x[2];
#pragma unroll
        for (int k = 0; k < 2; ++k) x[k] = (Q_DT == 2 ? __uint_as_float(raw[n][k]) : q_elt(raw[n][k])) * p.scale_log2;
        asm volatile("st.shared.b32 [%0], %1;" ::"r"(qf + 4 * (n * WARPS * 32 + tid)), "r"(pack_x(x[0], x[1]))
                     : "memory");
      }
    }
    cp_wait<0>();
    __syncthreads();  // the batch (and, the first time, the query's fragments) in shared memory
    for (int t = 16 * warp; t < nb; t += 16 * WARPS) {
      float sc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
      for (int kp = 0; kp < KS / 2; ++kp) {  // k-steps 2 kp, 2 kp + 1: one ldmatrix.x4 an n-tile
        u32 a[2][4];
#pragma unroll
        for (int u = 0; u < 2; ++u)
          asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(a[u][0]), "=r"(a[u][1]), "=r"(a[u][2]),
                       "=r"(a[u][3]) : "r"(qf + ((2 * kp + u) * 32 + lane) * 16));
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          u32 kb[4];  // matrix lane / 8: tokens t + 8 n + (0..7), channels 32 kp + 8 (lane / 8) + (0..7)
          ldsm4<false>(xk + (t + 8 * n + (lane & 7)) * XSTRIDE + 64 * kp + 16 * (lane >> 3), kb);
          mma_x(sc[n], a[0][0], a[0][1], a[0][2], a[0][3], kb[0], kb[1]);
          mma_x(sc[n], a[1][0], a[1][1], a[1][2], a[1][3], kb[2], kb[3]);
        }
      }
      // this lane's tokens j: t + 2 l4 + (j & 1) + 8 (j >> 1); row i's score is sc[j >> 1][2 i + (j & 1)]
      float alpha[NMROWS];
      bool moved = false;
      u32 pb[NMROWS][2];
#pragma unroll
      for (int i = 0; i < NMROWS; ++i) {
        const int r = g + 8 * i, qi = r % p.nq;
        const bool rok = r < live;
        float x[4], mx = NEG_INF;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int e = t + 2 * l4 + (j & 1) + 8 * (j >> 1), ee = e0 + e;
          const int pos = ee < ls ? ee : lq + ee - ls;
          float v = sc[j >> 1][2 * i + (j & 1)];
#if MASK_KIND == 0
          const bool ok = pos <= T - p.nq + qi;
#else
          const bool ok = true;
          if (e < nb && rok)  // (row r: query qi of head h G + r / n)
            v += mask_value(p.mask + (b * p.smb + static_cast<i64>(h * p.group + r / p.nq) * p.smh +
                                      static_cast<i64>(qi) * p.smi) * p.mask_elt, static_cast<i64>(pos) * p.smt);
#endif
          x[j] = (e < nb && rok && ok) ? v : NEG_INF;
          mx = fmaxf(mx, x[j]);
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m_i[i], mx);
        const float m_use = m_new == NEG_INF ? 0.0f : m_new;
        alpha[i] = ex2(m_i[i] - m_use);
        moved |= m_i[i] != NEG_INF && m_new != m_i[i];
        m_i[i] = m_new;
        float pv[4], sum = 0.0f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          pv[j] = ex2(x[j] - m_use);
          sum += pv[j];
        }
        l_i[i] = l_i[i] * alpha[i] + sum;
        pb[i][0] = pack_x(pv[0], pv[1]);
        pb[i][1] = pack_x(pv[2], pv[3]);
      }
      if (__any_sync(0xffffffffu, moved)) {  // (as the packed part: query 8 n + 2 l4 (+ 1)'s alpha)
#pragma unroll
        for (int n = 0; n < NQ; ++n) {
          const float a0 = __shfl_sync(0xffffffffu, alpha[n], 8 * l4);
          const float a1 = __shfl_sync(0xffffffffu, alpha[n], 8 * l4 + 4);
#pragma unroll
          for (int mt = 0; mt < KS; ++mt) {
            acc[mt][n][0] *= a0; acc[mt][n][1] *= a1; acc[mt][n][2] *= a0; acc[mt][n][3] *= a1;
          }
        }
      }
#pragma unroll
      for (int mt = 0; mt < KS; ++mt) {  // matrix lane / 8: tokens t + 8 (lane / 16) + (0..7), channels 16 mt +
        u32 va[4];                        // 8 (lane / 8 % 2) + (0..7), transposed: V^T's A registers
        ldsm4<true>(xv + (t + 8 * (lane >> 4) + (lane & 7)) * XSTRIDE + 32 * mt + 16 * ((lane >> 3) & 1), va);
#pragma unroll
        for (int n = 0; n < NQ; ++n) mma_x(acc[mt][n], va[0], va[1], va[2], va[3], pb[n][0], pb[n][1]);
      }
    }
    __syncthreads();  // the batch read before the next one (or the warps' partials) overwrites it
  }
#pragma unroll
  for (int i = 0; i < NMROWS; ++i) {
    l_i[i] += __shfl_xor_sync(0xffffffffu, l_i[i], 1);
    l_i[i] += __shfl_xor_sync(0xffffffffu, l_i[i], 2);
    if (l4 == 0) {
      wm[warp * RQ + g + 8 * i] = m_i[i];
      wl[warp * RQ + g + 8 * i] = l_i[i];
    }
  }
#pragma unroll
  for (int mt = 0; mt < KS; ++mt)
#pragma unroll
    for (int n = 0; n < NQ; ++n) {  // O[query 8 n + 2 l4 (+ 1)][channel 16 mt + g (+ 8)]
      float* a = wa + (warp * RQ + 8 * n + 2 * l4) * D + 16 * mt + g;
      a[0] = acc[mt][n][0];
      a[D] = acc[mt][n][1];
      a[8] = acc[mt][n][2];
      a[D + 8] = acc[mt][n][3];
    }
  __syncthreads();
  store_partial<RQ, false>(wm, wl, wa, p, partial_base(p, bh) + p.num_splits + x, live);
}

// By the last CTA of a (batch, KV head) to store its partial: the packed partials merged in the rotated domain and
// rotated back once (y Pi), then combined with the exact copies' partial and written. This runs once per call on one
// CTA, so its latency is the whole call's: every load that does not depend on the packed partials (this thread's
// rows of Pi, the exact partial) is issued first, the maxima and sums take one pass, and the partials are read from
// L2 (.cg: other CTAs wrote them) four channels a load, 16 loads in flight.
#define NV (D / 4)                 // float4 columns of a row
#define CG (HAD ? 1 : WARPS * 32 / NV)  // channel groups of the rotation (thread (cg, xv) = (tid / NV, tid % NV))
#define CPG (D / CG)               // channels a group sums
// rows of Pi a thread loads before the partials (fewer where its ROWS accumulators need the registers), and in each
// later step of the rotation
#define PRE (ROWS <= 4 ? (CPG < 16 ? CPG : 16) : ROWS <= 8 ? (CPG < 8 ? CPG : 8) : 0)
#define UNROLL (PRE > 0 ? PRE : (CPG < 8 ? CPG : 8))
#define EPT ((ROWS * D + WARPS * 32 - 1) / (WARPS * 32))  // output elements a thread writes
#define XPRE (ROWS <= 8)  // the exact partial's values loaded before the packed partials too
#ifndef NXMAX  // the most exact copies' parts (`cuda.exact_parts`)
#define NXMAX 1
#endif
// lanes a column of the pass over the splits
#define MH (ROWS * NV * 4 <= WARPS * 32 ? 4 : ROWS * NV * 2 <= WARPS * 32 ? 2 : 1)
#ifndef MDIRECT  // 1: the pass reads a thread's splits straight into registers (`cuda.merge_direct`), 0: staged in
#define MDIRECT 0    // shared memory
#endif
#ifndef MSPLITS  // splits' partials staged in shared memory at a time (`cuda.merge_splits`)
#define MSPLITS 1
#endif
// (M, L, y) and a partial (m, l, a) of the same row and channels, each scaled to its own max, merged in place
__device__ __forceinline__ void combine(float& M, float& L, float (&y)[4], float m, float l, const float (&a)[4]) {
  const float Mn = fmaxf(M, m), Mu = Mn == NEG_INF ? 0.0f : Mn;
  const float al = ex2(M - Mu), w = ex2(m - Mu);
  L = L * al + w * l;
#pragma unroll
  for (int k = 0; k < 4; ++k) y[k] = y[k] * al + w * a[k];
  M = Mn;
}

__device__ __forceinline__ void merge_last(const Params& p, unsigned char* smem, int bh, int bq) {
  float* ys = reinterpret_cast<float*>(smem);  // (ROWS, D) the merged packed partial, rotated
  float* red = ys + ROWS * D;                  // (CG, ROWS, D) the channel groups' parts of ys Pi
  float* mp = red + CG * ROWS * D;             // (ROWS) the packed max, then (ROWS) the packed sum
  const int b = bq, h = bh - bq * p.hkv;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int live = p.group * p.nq, ns = p.num_splits;
  const i64 base = partial_base(p, bh), ex = base + ns;
  const int xv = tid % NV, cg = tid / NV;
#if PIH
  typedef uint2 PiRow;  // Pi[c, 4 xv .. 4 xv + 3]
  const PiRow* pir = p.pih;
#else
  typedef float4 PiRow;
  const PiRow* pir = reinterpret_cast<const float4*>(p.pi);
#endif
  auto pi4 = [](const PiRow& v) {
#if PIH
    return make_float4(h2f(static_cast<u16>(v.x & 0xffff)), h2f(static_cast<u16>(v.x >> 16)),
                       h2f(static_cast<u16>(v.y & 0xffff)), h2f(static_cast<u16>(v.y >> 16)));
#else
    return v;
#endif
  };
  PiRow w0[UNROLL];
#if HAD
  const u32 sg = lane_signs(p, lane);
#endif
  if constexpr (PRE > 0 && !HAD) {
#pragma unroll
    for (int k = 0; k < PRE; ++k) w0[k] = __ldg(pir + (cg * CPG + k) * NV + xv);
  }
  float xa[EPT], xm[EPT], xl[EPT];
  auto exact_value = [&](int i) {  // the exact partials (nx parts, combined) at this thread's output element i
    const int e = tid + i * WARPS * 32, r = e / D;
    float a[NXMAX], m[NXMAX], l[NXMAX];
#pragma unroll
    for (int x = 0; x < NXMAX; ++x) {  // (every load out before any is used)
      const bool ok = x < p.nx && e < ROWS * D && r < live;
      const i64 s = ex + x;
      a[x] = ok ? __ldcg(p.acc + (s * ROWS + r) * D + e % D) : 0.0f;
      m[x] = ok ? __ldcg(p.ml + s * 2 * ROWS + r) : NEG_INF;
      l[x] = ok ? __ldcg(p.ml + s * 2 * ROWS + ROWS + r) : 0.0f;
    }
    xa[i] = a[0]; xm[i] = m[0]; xl[i] = l[0];
#pragma unroll
    for (int x = 1; x < NXMAX; ++x) {
      const float M = fmaxf(xm[i], m[x]), Mu = M == NEG_INF ? 0.0f : M;
      const float al = ex2(xm[i] - Mu), w = ex2(m[x] - Mu);
      xa[i] = xa[i] * al + w * a[x];
      xl[i] = xl[i] * al + w * l[x];
      xm[i] = M;
    }
  };
  if constexpr (XPRE) {
#pragma unroll
    for (int i = 0; i < EPT; ++i) exact_value(i);
  }
  // one pass over the splits, online, by MH lanes 8 apart a column (each takes every MH-th split; shuffles combine
  // them; each column of a row finds the same max and sum, its first writes them), a quarter warp reading 128
  // contiguous bytes of one split's row. MDIRECT: a thread's loads out MLD splits at a time, into registers. Else
  // the partials come into shared memory MSPLITS splits at a time, every copy in flight at once
  // (adjacent lanes of a column read rows 2 KB apart there, one bank, 4-way conflicts: 0.24 us of a 16-warp merge of
  // 15 splits, H100).
  constexpr int NIT = ROWS * NV * MH, IPT = (NIT + WARPS * 32 - 1) / (WARPS * 32);  // columns' parts, a thread's
  float* sacc = mp + ((2 * ROWS + 3) & ~3);  // (MSPLITS, ROWS, D) the staged partials, then (MSPLITS, 2, ROWS)
  float* sml = sacc + MSPLITS * ROWS * D;
  float M[IPT], L[IPT], y[IPT][4];
#pragma unroll
  for (int i = 0; i < IPT; ++i) {
    M[i] = NEG_INF; L[i] = 0.0f;
    y[i][0] = y[i][1] = y[i][2] = y[i][3] = 0.0f;
  }
  const u32 sa = shared_addr(sacc);
  // thread part i's row r, its column's lane hf and its float4 column cv
  auto column = [&](int i, int& it, int& r, int& hf, int& cv) {
    it = tid + i * WARPS * 32;
    r = it / (MH * NV);
    hf = (it >> 3) % MH;
    cv = (it & 7) + 8 * ((it / (8 * MH)) % (NV / 8));
  };
  constexpr int MLD = IPT == 1 ? 8 : 4;  // splits a thread's column part loads at once on the direct path
  if (MDIRECT) {
    // straight from L2 into registers (.cg), MLD splits' loads out before any is used, at constant offsets from one
    // base (an instruction each): a round trip per MLD splits, no copies through shared memory and no barrier
#pragma unroll
    for (int i = 0; i < IPT; ++i) {
      int it, r, hf, cv;
      column(i, it, r, hf, cv);
      if (it >= NIT || r >= live) continue;
      const float4* ga = reinterpret_cast<const float4*>(p.acc + (base + hf) * (ROWS * D)) + r * NV + cv;
      const float* gm = p.ml + (base + hf) * (2 * ROWS) + r;
      for (int s0 = hf; s0 < ns; s0 += MH * MLD, ga += MLD * MH * ROWS * NV, gm += MLD * MH * 2 * ROWS) {
        float4 a[MLD];
        float m[MLD], l[MLD];
#pragma unroll
        for (int k = 0; k < MLD; ++k) {
          if (s0 + k * MH < ns) {
            a[k] = __ldcg(ga + k * MH * ROWS * NV);
            m[k] = __ldcg(gm + k * MH * 2 * ROWS);
            l[k] = __ldcg(gm + k * MH * 2 * ROWS + ROWS);
          }
        }
#pragma unroll
        for (int k = 0; k < MLD; ++k) {
          if (s0 + k * MH < ns) {
            const float av[4] = {a[k].x, a[k].y, a[k].z, a[k].w};
            combine(M[i], L[i], y[i], m[k], l[k], av);
          }
        }
      }
    }
  } else {
    for (int c0 = 0; c0 < ns; c0 += MSPLITS) {
      const int n = min(MSPLITS, ns - c0);
      const float* ga = p.acc + (base + c0) * ROWS * D;
      const float* gm = p.ml + (base + c0) * 2 * ROWS;
      for (int i = tid; i < n * ROWS * D / 4; i += WARPS * 32) cp_async<16>(sa + 16 * i, ga + 4 * i);  // (.cg: L2)
      cp_commit();
      // (from L2 too: other CTAs wrote them in this launch, and an L1 line of them, read by an earlier merge on this
      // SM, could be stale; copies narrower than 16 bytes would go through L1)
      for (int i = tid; i < n * 2 * ROWS; i += WARPS * 32) sml[i] = __ldcg(gm + i);
      cp_wait<0>();
      __syncthreads();  // the chunk in shared memory
#pragma unroll
      for (int i = 0; i < IPT; ++i) {
        int it, r, hf, cv;
        column(i, it, r, hf, cv);
        if (it >= NIT || r >= live) continue;
        for (int s = hf; s < n; s += MH) {
          const float4 a = reinterpret_cast<const float4*>(sacc + (s * ROWS + r) * D)[cv];
          const float av[4] = {a.x, a.y, a.z, a.w};
          combine(M[i], L[i], y[i], sml[s * 2 * ROWS + r], sml[s * 2 * ROWS + ROWS + r], av);
        }
      }
      if (c0 + MSPLITS < ns) __syncthreads();  // read before the next chunk overwrites it
    }
  }
#pragma unroll
  for (int i = 0; i < IPT; ++i) {
    int it, r, hf, cv;
    column(i, it, r, hf, cv);
    if (it >= NIT) continue;  // (NIT is a multiple of 32: whole warps)
#pragma unroll
    for (int o = 8; o < 8 * MH; o <<= 1) {  // (a column's lanes)
      float yo[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) yo[k] = __shfl_xor_sync(0xffffffffu, y[i][k], o);
      const float Mo = __shfl_xor_sync(0xffffffffu, M[i], o), Lo = __shfl_xor_sync(0xffffffffu, L[i], o);
      combine(M[i], L[i], y[i], Mo, Lo, yo);
    }
    if (r >= live || hf != 0) continue;
    if (cv == 0) {
      mp[r] = M[i];
      mp[ROWS + r] = L[i];
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int col = 4 * cv + k;
      ys[r * D + (col % (D / VPLANES)) * VPLANES + col / (D / VPLANES)] = y[i][k];
    }
  }
  __syncthreads();
#if HAD
  for (int r = warp; r < live; r += WARPS) {  // red[r] = ys[r] Pi = H ys[r] * s / sqrt(D), a warp a row
    float x[DPL];
#pragma unroll
    for (int i = 0; i < DPL; ++i) x[i] = ys[r * D + lane * DPL + i];
    fwht_warp(x, lane);
    signs_scale(sg, x, lane, rsqrtf(static_cast<float>(D)));
#pragma unroll
    for (int i = 0; i < DPL; ++i) red[r * D + lane * DPL + i] = x[i];
  }
#else
  {  // red[cg, r, 4 xv ..] = sum over the group's channels c of ys[r, c] Pi[c, 4 xv ..]
    float4 y[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) y[r] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 1
    for (int c0 = 0; c0 < CPG; c0 += UNROLL) {  // (one step's loads in flight: the accumulators need the registers)
      float4 w[UNROLL];
#pragma unroll
      for (int k = 0; k < UNROLL; ++k)
        w[k] = pi4(PRE > 0 && c0 == 0 ? w0[k] : __ldg(pir + (cg * CPG + c0 + k) * NV + xv));
#pragma unroll
      for (int k = 0; k < UNROLL; ++k)
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          if (r >= live) continue;
          const float q = ys[r * D + cg * CPG + c0 + k];
          y[r].x += q * w[k].x; y[r].y += q * w[k].y; y[r].z += q * w[k].z; y[r].w += q * w[k].w;
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
      if (r < live) reinterpret_cast<float4*>(red + (cg * ROWS + r) * D)[xv] = y[r];
  }
#endif
  __syncthreads();

  // out[r, x] = (wp (ys Pi)[r, x] + we acc_e[r, x]) / (wp Lp + we l_e)
#pragma unroll
  for (int i = 0; i < EPT; ++i) {
    const int e = tid + i * WARPS * 32, r = e / D, x = e % D;
    if (e >= ROWS * D || r >= live) continue;
    if constexpr (!XPRE) exact_value(i);
    float y = 0.0f;
#pragma unroll
    for (int cg = 0; cg < CG; ++cg) y += red[(cg * ROWS + r) * D + x];
    const float M = fmaxf(xm[i], mp[r]);
    const float Mu = M == NEG_INF ? 0.0f : M;
    const float wp = ex2(mp[r] - Mu), we = ex2(xm[i] - Mu);
    const float num = (wp == 0.0f ? 0.0f : wp * y) + we * xa[i];
    const float den = wp * mp[ROWS + r] + we * xl[i];
    const float o = den > 0.0f ? num / den : (den == den ? 0.0f : den);
    int qn = 0, qh = r;  // query r % nq of head h G + r / nq (no division in a decode step's one query)
    if (p.nq != 1) qn = r % p.nq, qh = r / p.nq;
    const i64 oi = b * p.sob + static_cast<i64>(qn) * p.son + static_cast<i64>(h * p.group + qh) * p.soh + x;
    if constexpr (O_DT == 0) {
      reinterpret_cast<u16*>(p.out)[oi] = static_cast<u16>(pack_h2(o, 0.0f) & 0xffff);
    } else if constexpr (O_DT == 1) {
      u32 bits = __float_as_uint(o);
      bits += 0x7fff + ((bits >> 16) & 1);  // round to nearest even (NaN stays NaN: its payload is nonzero)
      if (o != o) bits = 0x7fc00000u;
      reinterpret_cast<u16*>(p.out)[oi] = static_cast<u16>(bits >> 16);
    } else {
      reinterpret_cast<float*>(p.out)[oi] = o;
    }
  }
}

// Grid (batch x KV heads, num_splits + (fold ? 0 : nx)): CTA s < num_splits of a (batch, KV head) takes split s of the
// packed history; the exact copies have CTAs num_splits .. num_splits + nx - 1 of their own (part x each), or, where
// the plan folds them (a GPU full of long splits: no SM to spare), the last split's CTA takes them first, its split
// shorter by p.fold tokens. Each CTA stores
// its partials, and the last to do so merges them all (one counter per (batch, KV head), left at zero for the next
// launch). The (batch, KV head) is the grid's x, so that CTAs go out split by split: where two CTAs share an SM the
// first one placed runs faster, and each (batch, KV head) gets both kinds (and where the grid is more than the GPU
// holds at once, the CTAs that wait are the last splits of every one).
// part x of nx of the exact copies (the last split's CTA, where it takes them: 0 of 1)
__device__ __forceinline__ void exact_part(const Params& p, unsigned char* smem, int bh, int x, int nx) {
#if XMMA
  exact_mma(p, smem, bh, x, nx);
#else
  exact_simt(p, smem, bh, x, nx);
#endif
}

#ifndef FOLD  // 1: a plan that folds (p.fold > 0) may run; 0: it never does, and the kernel leaves out the folded
#define FOLD 1  // CTA's own copies of the exact and packed parts (40 % of its code, fetched cold inside a model)
#endif

extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_CTAS) tq_decode(const Params p) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int last;
  const int bh = blockIdx.x, split = blockIdx.y;
  __shared__ int bq;  // the batch row bh / hkv for the merge, found at entry (a division off its chain)
  if (threadIdx.x == 0) bq = bh / p.hkv;
  if (split >= p.num_splits) {
    exact_part(p, smem, bh, split - p.num_splits, p.nx);
  } else if (FOLD && p.fold && split == p.num_splits - 1) {  // (its own copy of the packed part: the loop carries
    exact_part(p, smem, bh, 0, 1);                                // nothing of the exact part's registers)
    __syncthreads();  // the exact partial is out of shared memory
    packed_part(p, smem, split, bh);
  } else {
    packed_part(p, smem, split, bh);
  }
  __syncthreads();  // the CTA's partials stored: the barrier orders every thread's stores before thread 0's arrival
  if (threadIdx.x == 0) {
    int before;  // acq_rel: releases this CTA's partials, and acquires all the others' for the last CTA
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(before) : "l"(p.counters + bh) : "memory");
    last = before == p.num_splits + (p.fold ? 0 : p.nx) - 1;
    if (last) atomicExch(p.counters + bh, 0);
  }
  __syncthreads();
  if (!last) return;
  merge_last(p, smem, bh, bq);
}
