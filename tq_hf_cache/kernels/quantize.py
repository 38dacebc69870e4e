"""Fused TurboQuant quantize: x (B, H, T, D) -> packed indices + norm, one pass, nothing but them written.

One program takes BLOCK_T tokens of one (batch, head): it loads the (BLOCK_T, D) tile once, rotates it, takes
the norms, finds each coordinate's cell (the number of codebook boundaries strictly below it, like
torch.bucketize), packs the indices LSB-first (packing.py's layout) and stores words and norms at the
caller's strided slots. No intermediate tensor goes through global memory.

Rotation. For the randomized Hadamard rotation Pi = H diag(s) / sqrt(D), sqrt(D) * Pi holds only +-1, so
the rotation is one tensor-core dot (wgmma on Hopper) of the raw x tile against that +-1 matrix
(ROT_PM1_DOT): fp16/bf16 x is exact in its own type and every product is exact, leaving only fp32
accumulation rounding. The norm comes from the rotated rows (||x M|| = sqrt(D) ||x||), so x feeds the dot
only. The matrix's columns are in `_common.mma_column_order`: each thread of the accumulator layout then
holds D/4 consecutive coordinates and packs them in registers. fp32 x is split into three bf16 terms that
sum to it exactly (three dots). It beat a butterfly transform in registers on the H100 (bench_quantize_v1.json in
benchmarks/results/archive/ at commit a573dec). Orthogonal rotations (no +-1 form) use an fp32 ieee dot.

Codebook search. The H100 runs this kernel out of integer/compare issue slots long before it runs out of
bytes: a compare-and-count costs 2-3 instructions on the half-rate ALU pipe. So for symmetric codebooks up
to 4 bits (the theoretical ones) the default 'sat' search counts on the FMA pipe instead: with K a power of
two, min(max(|y| K - B_j K, 0), 1) is one saturated FMA (FFMA.SAT) and exactly [|y| > B_j] (see
_common.sat_table), summed over the 2**(BITS-1) - 1 positive boundaries; y's sign picks the half. The
indices are whole numbers in fp32, so packing is a weighted sum on the FMA pipe too, stored as 16-bit words
(32-bit at 3 bits). A coordinate exactly equal to a negative boundary (equidistant from two centroids)
lands one cell nearer zero than bucketize puts it. Measured on the H100 at 4 bits, B=8, T=32768: 'sat'
1937 GB/s, a select tree on |y| (tried, dropped) 1665, the linear scan 647 (sweep_quantize_h100.json in
benchmarks/results/archive/ at commit a573dec).
Other codebooks up to 4 bits scan every boundary. Above 4 bits, symmetric codebooks take 'poly': a degree-5
polynomial of |y| (fitted and checked per codebook, _common.poly_table) gives the cell or the one below it and a
single gather of a boundary decides; other codebooks use a uniform-grid table (_common.search_lut), two dependent
gathers per coordinate; a branchless binary search is the fallback for degenerate codebooks.
Per-head codebooks are one pointer offset (head stride 0 for a shared codebook).

Grid: persistent, PROGS_PER_SM programs per SM, each loading the (D, D) operand once and walking tiles;
the cache's decode step can use `quantize_kv_into`, one launch for a layer's keys and values.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from ..quant.codebook import Codebook
from ..quant.rotation import Rotation
from . import _common as C

POLY_NC: tl.constexpr = tl.constexpr(C.POLY_DEG + 1)
# The table and polynomial searches (above 4 bits) keep more values live: capped at 128 registers, 4 programs of 4
# warps fit an SM instead of 3, and 8 bits goes from 52% to 71% of copy on the H100
# (sweep_quantize_8bit_h100_3_maxnreg.json in benchmarks/results/archive/ at commit a573dec)
MAXNREG_WIDE = 128
# best of 4/6/8 on the H100 at 2-4 bits (sweep_quantize_h100.json in benchmarks/results/archive/ at commit a573dec)
PROGS_PER_SM = 8


@triton.jit
def _in_coordinate_order(t, BLOCK_T: tl.constexpr, D: tl.constexpr):
    """(BLOCK_T, D) dot columns in MMA order (_common.mma_column_order) -> coordinate order.

    Dot column 8j + 2q + e holds coordinate q * D/4 + 2j + e, so the thread that owns columns {8j + 2q + e}
    (q = lane % 4 in the tensor-core accumulator layout) holds D/4 consecutive coordinates. This reshape/permute
    only renames registers, and each thread packs and stores one contiguous run, with no shuffle through shared
    memory."""
    return tl.reshape(tl.permute(tl.reshape(t, (BLOCK_T, D // 8, 4, 2)), (0, 2, 1, 3)), (BLOCK_T, D))


@triton.jit
def _quantize_tile(
    x_ptr, sxb, sxh, sxt, sxd,
    p_ptr, spb, sph, spt,
    n_ptr, snb, snh, snt,
    rop, bnd_ptr, sbh, lut_ptr, slh, lo_ptr, invw_ptr, hsel, NLUT,
    pid_t, pid_bh, H, T, inv_sqrt_d, t_out0,
    D: tl.constexpr, LOG2D: tl.constexpr, BITS: tl.constexpr, BLOCK_T: tl.constexpr,
    ROT: tl.constexpr, XMODE: tl.constexpr, X_UNIT: tl.constexpr, SEARCH: tl.constexpr,
    PERM: tl.constexpr, WORDS: tl.constexpr,
):
    """One (BLOCK_T, D) tile of one (batch, head); rop is the (D, D) matrix operand. Input row t is stored at output
    row t_out0 + t."""
    b = pid_bh // H
    h = pid_bh % H
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    t64 = t.to(tl.int64)
    d = tl.arange(0, D)

    x_rows = x_ptr + b.to(tl.int64) * sxb + h.to(tl.int64) * sxh + t64 * sxt
    if X_UNIT:  # unit last-dim stride as a constexpr: contiguous, vectorizable rows
        x = tl.load(x_rows[:, None] + d[None, :], mask=tmask[:, None], other=0.0)
    else:
        x = tl.load(x_rows[:, None] + d[None, :] * sxd, mask=tmask[:, None], other=0.0)
    # ---- rotation: y = Pi (x / norm), row-wise
    if ROT == 0:
        # +-1 dot of the raw rows; ||x|| comes from the rotated rows (||x @ M|| = sqrt(D) ||x||), so x feeds the dot
        # only and can go global -> shared memory without a pass through registers
        m = rop
        if XMODE == 0:  # fp16/bf16 x, +-1 matrix in the same dtype: exact products
            acc = tl.dot(x, m)
        elif XMODE == 1:  # fp32 operands (interpreter)
            acc = tl.dot(x.to(tl.float32), m, input_precision="ieee")
        else:  # fp32 x = hi + mid + lo exactly, three bf16 dots
            xf = x.to(tl.float32)
            hi = xf.to(tl.bfloat16)
            r = xf - hi.to(tl.float32)
            mid = r.to(tl.bfloat16)
            lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
            acc = tl.dot(hi, m) + tl.dot(mid, m) + tl.dot(lo, m)
        norm = tl.sqrt(tl.sum(acc * acc, axis=1)) * inv_sqrt_d
        y = acc * (inv_sqrt_d / tl.maximum(norm, 1e-30))[:, None]
    else:
        xf = x.to(tl.float32)
        norm = tl.sqrt(tl.sum(xf * xf, axis=1))
        inv = 1.0 / tl.maximum(norm, 1e-30)
        y = tl.dot(xf * inv[:, None], rop, input_precision="ieee")  # dense orthogonal: fp32 ieee dot

    # ---- codebook search: number of boundaries strictly below y
    bnd = bnd_ptr + h * sbh
    if SEARCH == 0:  # linear: one scalar boundary per step (cheapest for <= 3 bits)
        idx = tl.zeros((BLOCK_T, D), dtype=tl.int32)
        for k in tl.static_range((1 << BITS) - 1):
            idx += (y > tl.load(bnd + k)).to(tl.int32)
    elif SEARCH == 1:  # uniform-grid table + one compare (see _common.search_lut)
        lo = tl.load(lo_ptr + h * hsel)
        inv_w = tl.load(invw_ptr + h * hsel)
        j = tl.minimum(tl.maximum(((y - lo) * inv_w).to(tl.int32), 0), NLUT - 1)
        g = C.gather(lut_ptr + h * slh, j)
        idx = g + (y > C.gather(bnd, g)).to(tl.int32)
    elif SEARCH == 4:  # symmetric codebook, BITS <= 4: count on the FMA pipe (see the module docstring)
        HALF_S: tl.constexpr = 1 << (BITS - 1)
        satk = tl.load(lut_ptr + h * slh + (HALF_S - 1))  # 2**k that lifts any nonzero |y| - B_j to >= 2 in size
        a = tl.abs(y)
        cnt = tl.full((BLOCK_T, D), 0.5, tl.float32)
        for j in tl.static_range(HALF_S - 1):  # + 1 per positive boundary B_j < |y|: one saturated FMA each
            cnt += tl.minimum(tl.maximum(a * satk + tl.load(lut_ptr + h * slh + j), 0.0), 1.0)
        # v = +-(c + 0.5) with y's sign: index = v + HALF - 0.5, i.e. HALF + c above 0 and HALF - 1 - c at or below
        # (y minus the least denormal carries the sign of y, except that +0 turns negative, as bucketize files it)
        sgn = (y - 1.401298464324817e-45).to(tl.uint32, bitcast=True) & 0x80000000
        v = (cnt.to(tl.uint32, bitcast=True) | sgn).to(tl.float32, bitcast=True)
    elif SEARCH == 5:  # symmetric codebook above 4 bits: polynomial guess + one gather (see _common.poly_table)
        HALF_Q: tl.constexpr = 1 << (BITS - 1)
        tb = lut_ptr + h * slh
        a = tl.abs(y)
        u = tl.minimum(a, tl.load(tb + POLY_NC))
        f = u * tl.load(tb) + tl.load(tb + 1)
        for k in tl.static_range(2, POLY_NC):
            f = f * u + tl.load(tb + k)
        g = f.to(tl.int32)  # the count of positive boundaries below |y|, or one less
        cnt = g + (a > C.gather(tb + (POLY_NC + 1), g)).to(tl.int32)
        idx = tl.where(y > 0, HALF_Q + cnt, (HALF_Q - 1) - cnt)
    else:  # branchless binary search, BITS dependent gathers (fallback for degenerate codebooks)
        idx = tl.zeros((BLOCK_T, D), dtype=tl.int32)
        for s in tl.static_range(BITS):
            step = 1 << (BITS - 1 - s)
            bk = tl.load(bnd + idx + (step - 1))
            idx = tl.where(y > bk, idx + step, idx)

    if PERM:  # back from the MMA column order (see _in_coordinate_order)
        if SEARCH == 4:
            v = _in_coordinate_order(v, BLOCK_T, D)
        else:
            idx = _in_coordinate_order(idx, BLOCK_T, D)

    # ---- pack, LSB first (packing.py's layout)
    p_rows = p_ptr + b.to(tl.int64) * spb + h.to(tl.int64) * sph + (t64 + t_out0) * spt
    if SEARCH == 4:
        # Indices are whole numbers in fp32: sum idx_k * 2**(BITS k) over a 16-bit (24-bit at 3 bits) group on the FMA
        # pipe, exact below 2**24, then store whole 16/32-bit words (the launcher checks their alignment).
        HALF_P: tl.constexpr = 1 << (BITS - 1)
        if BITS == 3:
            v3 = tl.reshape(v, (BLOCK_T, D // 8, 8))
            g = (tl.sum(v3 * (1 << (tl.arange(0, 8) * 3)).to(tl.float32)[None, None, :], axis=2)
                 + (HALF_P - 0.5) * 2396745.0).to(tl.int32)  # 2396745 = sum of 8**k, k < 8
            g4 = tl.reshape(g, (BLOCK_T, D // 32, 2, 2))
            g02, g13 = tl.split(g4)
            g0, g2 = tl.split(g02)
            g1, g3 = tl.split(g13)
            w_rows = (p_rows.to(tl.pointer_type(tl.int32), bitcast=True))[:, None] + tl.arange(0, D // 32)[None, :] * 3
            tl.store(w_rows, g0 | (g1 << 24), mask=tmask[:, None])
            tl.store(w_rows + 1, (g1 >> 8) | (g2 << 16), mask=tmask[:, None])
            tl.store(w_rows + 2, (g2 >> 16) | (g3 << 8), mask=tmask[:, None])
        else:
            PER16: tl.constexpr = 16 // BITS
            v3 = tl.reshape(v, (BLOCK_T, D // PER16, PER16))
            wgt = (1 << (tl.arange(0, PER16) * BITS)).to(tl.float32)
            # + 2**23: the fp32 bits of 2**23 + n end in n, so truncating them to 16 bits is the word
            wf = (tl.sum(v3 * wgt[None, None, :], axis=2) + (HALF_P - 0.5) * (65535.0 / ((1 << BITS) - 1))) + 8388608.0
            h_rows = p_rows.to(tl.pointer_type(tl.uint16), bitcast=True)
            tl.store(h_rows[:, None] + tl.arange(0, D // PER16)[None, :], wf.to(tl.int32, bitcast=True).to(tl.uint16),
                     mask=tmask[:, None])
    elif BITS == 5 and WORDS:  # 32 indices = eight 20-bit quads = five int32 words, in int32 throughout
        q8 = tl.sum(tl.reshape(idx, (BLOCK_T, D // 32, 8, 4)) << (tl.arange(0, 4) * 5)[None, None, None, :], axis=3)
        ev, od = tl.split(tl.reshape(q8, (BLOCK_T, D // 32, 4, 2)))
        q04, q26 = tl.split(tl.reshape(ev, (BLOCK_T, D // 32, 2, 2)))
        q15, q37 = tl.split(tl.reshape(od, (BLOCK_T, D // 32, 2, 2)))
        q0, q4 = tl.split(q04)
        q2, q6 = tl.split(q26)
        q1, q5 = tl.split(q15)
        q3, q7 = tl.split(q37)
        w0 = q0 | (q1 << 20)
        w1 = (q1 >> 12) | (q2 << 8) | (q3 << 28)
        w2 = (q3 >> 4) | (q4 << 16)
        w3 = (q4 >> 16) | (q5 << 4) | (q6 << 24)
        w4 = (q6 >> 8) | (q7 << 12)
        # one (BLOCK_T, D // 32, 8) tile, lanes 5-7 masked: one layout conversion for the store instead of five
        z = tl.zeros_like(w0)
        wt = tl.reshape(tl.join(tl.join(tl.join(w0, w4), tl.join(w2, z)), tl.join(tl.join(w1, z), tl.join(w3, z))),
                        (BLOCK_T, D // 32, 8))
        lane = tl.arange(0, 8)
        w_rows = p_rows.to(tl.pointer_type(tl.int32), bitcast=True)
        tl.store(w_rows[:, None, None] + (tl.arange(0, D // 32) * 5)[None, :, None] + lane[None, None, :], wt,
                 mask=tmask[:, None, None] & (lane < 5)[None, None, :])
    elif BITS == 8 and WORDS:  # four indices per int32 word, packed in registers (a uint8 tile store changes layout)
        i4 = tl.reshape(idx, (BLOCK_T, D // 4, 4))
        wrd = tl.sum(i4 << (tl.arange(0, 4) * 8)[None, None, :], axis=2)
        w_rows = p_rows.to(tl.pointer_type(tl.int32), bitcast=True)
        tl.store(w_rows[:, None] + tl.arange(0, D // 4)[None, :], wrd, mask=tmask[:, None])
    elif (8 % BITS) == 0:  # whole indices per byte: contiguous full-byte stores
        PER: tl.constexpr = 8 // BITS
        NB: tl.constexpr = D // PER
        if BITS == 8:
            byts = idx.to(tl.uint8)
        else:
            i3 = tl.reshape(idx, (BLOCK_T, NB, PER))
            byts = tl.sum(i3 << (tl.arange(0, PER) * BITS)[None, None, :], axis=2).to(tl.uint8)
        tl.store(p_rows[:, None] + tl.arange(0, NB)[None, :], byts, mask=tmask[:, None])
    else:  # 8 indices = one word of BITS bytes; int32 holds it for 3 bits
        G: tl.constexpr = D // 8
        g8 = tl.arange(0, G)
        if BITS < 4:
            k4 = tl.arange(0, 4)
            i3 = tl.reshape(idx, (BLOCK_T, G, 8))
            word = tl.sum(i3 << (tl.arange(0, 8) * BITS)[None, None, :], axis=2)
            byts = ((word[:, :, None] >> (k4 * 8)[None, None, :]) & 0xFF).to(tl.uint8)
            off = g8[None, :, None] * BITS + k4[None, None, :]
            tl.store(p_rows[:, None, None] + off, byts, mask=tmask[:, None, None] & (k4 < BITS)[None, None, :])
        else:
            k8 = tl.arange(0, 8)
            i3 = tl.reshape(idx, (BLOCK_T, G, 8)).to(tl.int64)
            word = tl.sum(i3 << (k8 * BITS).to(tl.int64)[None, None, :], axis=2)  # disjoint fields: sum == or
            byts = ((word[:, :, None] >> (k8 * 8).to(tl.int64)[None, None, :]) & 0xFF).to(tl.uint8)
            off = g8[None, :, None] * BITS + k8[None, None, :]
            tl.store(p_rows[:, None, None] + off, byts, mask=tmask[:, None, None] & (k8 < BITS)[None, None, :])

    # ---- norm: stored as it is (a float16 overflow becomes inf; the cache widens its norms before that happens)
    n_rows = n_ptr + b.to(tl.int64) * snb + h.to(tl.int64) * snh + (t64 + t_out0) * snt
    tl.store(n_rows, norm.to(n_ptr.dtype.element_ty), mask=tmask)


@triton.jit
def _load_rot(mat_ptr, D: tl.constexpr):
    d = tl.arange(0, D)
    return tl.load(mat_ptr + d[:, None] * D + d[None, :])  # (D, D) right operand, row-major


@triton.jit
def _quantize_kernel(
    x_ptr, sxb, sxh, sxt, sxd, p_ptr, spb, sph, spt, n_ptr, snb, snh, snt,
    mat_ptr, bnd_ptr, sbh, lut_ptr, slh, lo_ptr, invw_ptr, hsel, NLUT, H, T, inv_sqrt_d,
    n_t_tiles, n_tiles,
    D: tl.constexpr, LOG2D: tl.constexpr, BITS: tl.constexpr, BLOCK_T: tl.constexpr,
    ROT: tl.constexpr, XMODE: tl.constexpr, X_UNIT: tl.constexpr, SEARCH: tl.constexpr,
    STAGES: tl.constexpr, PERM: tl.constexpr, WORDS: tl.constexpr,
):
    """Persistent: the rotation operand is loaded once, then the program walks tiles pid, pid + grid, ..."""
    rop = _load_rot(mat_ptr, D)
    for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), num_stages=STAGES):
        _quantize_tile(
            x_ptr, sxb, sxh, sxt, sxd, p_ptr, spb, sph, spt, n_ptr, snb, snh, snt,
            rop, bnd_ptr, sbh, lut_ptr, slh, lo_ptr, invw_ptr, hsel, NLUT,
            tile % n_t_tiles, tile // n_t_tiles, H, T, inv_sqrt_d, 0,
            D, LOG2D, BITS, BLOCK_T, ROT, XMODE, X_UNIT, SEARCH, PERM, WORDS,
        )


@triton.jit
def _quantize_kv_kernel(
    k_ptr, skb, skh, skt, skd, pk_ptr, spkb, spkh, spkt, nk_ptr, snkb, snkh, snkt,
    bndk_ptr, sbkh, lutk_ptr, slkh, lok_ptr, invwk_ptr, hselk, NLUTK,
    v_ptr, svb, svh, svt, svd, pv_ptr, spvb, spvh, spvt, nv_ptr, snvb, snvh, snvt,
    bndv_ptr, sbvh, lutv_ptr, slvh, lov_ptr, invwv_ptr, hselv, NLUTV,
    mat_ptr, H, T, inv_sqrt_d, n_t_tiles, n_tiles,
    D: tl.constexpr, LOG2D: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr, BLOCK_T: tl.constexpr,
    ROT: tl.constexpr, XMODE: tl.constexpr, K_UNIT: tl.constexpr, V_UNIT: tl.constexpr,
    KSEARCH: tl.constexpr, VSEARCH: tl.constexpr, PERM: tl.constexpr, KWORDS: tl.constexpr, VWORDS: tl.constexpr,
):
    """Keys and values of one layer in one launch (grid axis 1: 0 = keys, 1 = values); not persistent (decode)."""
    rop = _load_rot(mat_ptr, D)
    tile = tl.program_id(0)
    if tl.program_id(1) == 0:
        _quantize_tile(
            k_ptr, skb, skh, skt, skd, pk_ptr, spkb, spkh, spkt, nk_ptr, snkb, snkh, snkt,
            rop, bndk_ptr, sbkh, lutk_ptr, slkh, lok_ptr, invwk_ptr, hselk, NLUTK,
            tile % n_t_tiles, tile // n_t_tiles, H, T, inv_sqrt_d, 0,
            D, LOG2D, KBITS, BLOCK_T, ROT, XMODE, K_UNIT, KSEARCH, PERM, KWORDS,
        )
    else:
        _quantize_tile(
            v_ptr, svb, svh, svt, svd, pv_ptr, spvb, spvh, spvt, nv_ptr, snvb, snvh, snvt,
            rop, bndv_ptr, sbvh, lutv_ptr, slvh, lov_ptr, invwv_ptr, hselv, NLUTV,
            tile % n_t_tiles, tile // n_t_tiles, H, T, inv_sqrt_d, 0,
            D, LOG2D, VBITS, BLOCK_T, ROT, XMODE, V_UNIT, VSEARCH, PERM, VWORDS,
        )


@triton.jit
def _exact_copy(x_ptr, sxb, sxh, sxt, r_ptr, srb, srh, srt, s_ptr, ssb, ssh, sst, pid_t, pid_bh, H, T, pos0, cap,
                window, n_sinks, D: tl.constexpr, BLOCK_T: tl.constexpr):
    """The exact copies of one tile's rows (x has unit last-dim stride): row t, at position pos0 + t, goes to window
    slot (pos0 + t) % window when it is among the last `window` rows, and to sink slot pos0 + t below n_sinks."""
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    pos = pos0 + t.to(tl.int64)
    ok = (t < T) & (pos < cap)
    d = tl.arange(0, D)
    x = tl.load(x_ptr + b * sxb + h * sxh + t.to(tl.int64)[:, None] * sxt + d[None, :], mask=ok[:, None])
    to_window = ok & (t >= T - window)
    tl.store(r_ptr + b * srb + h * srh + (pos % window)[:, None] * srt + d[None, :], x, mask=to_window[:, None])
    to_sink = ok & (pos < n_sinks)
    tl.store(s_ptr + b * ssb + h * ssh + pos[:, None] * sst + d[None, :], x, mask=to_sink[:, None])


@triton.jit
def _append_kv_kernel(
    k_ptr, skb, skh, skt, skd, pk_ptr, spkb, spkh, spkt, nk_ptr, snkb, snkh, snkt,
    bndk_ptr, sbkh, lutk_ptr, slkh, lok_ptr, invwk_ptr, hselk, NLUTK,
    v_ptr, svb, svh, svt, svd, pv_ptr, spvb, spvh, spvt, nv_ptr, snvb, snvh, snvt,
    bndv_ptr, sbvh, lutv_ptr, slvh, lov_ptr, invwv_ptr, hselv, NLUTV,
    rk_ptr, srkb, srkh, srkt, rv_ptr, srvb, srvh, srvt, sk_ptr, sskb, sskh, sskt, sv_ptr, ssvb, ssvh, ssvt,
    len_ptr, cap, window, n_sinks,
    mat_ptr, H, T, inv_sqrt_d, n_t_tiles,
    D: tl.constexpr, LOG2D: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr, BLOCK_T: tl.constexpr,
    ROT: tl.constexpr, XMODE: tl.constexpr,
    KSEARCH: tl.constexpr, VSEARCH: tl.constexpr, PERM: tl.constexpr, KWORDS: tl.constexpr, VWORDS: tl.constexpr,
):
    """`_quantize_kv_kernel` into a static layer at the position its device length holds, plus the exact copies (window
    and sinks). Rows past the capacity are not written. The length itself is advanced by `_advance_kernel`, after."""
    rop = _load_rot(mat_ptr, D)
    tile = tl.program_id(0)
    pid_t, pid_bh = tile % n_t_tiles, tile // n_t_tiles
    pos0 = tl.load(len_ptr).to(tl.int64)
    t_ok = tl.minimum(T, cap - pos0).to(tl.int32)
    if tl.program_id(1) == 0:
        _quantize_tile(
            k_ptr, skb, skh, skt, skd, pk_ptr, spkb, spkh, spkt, nk_ptr, snkb, snkh, snkt,
            rop, bndk_ptr, sbkh, lutk_ptr, slkh, lok_ptr, invwk_ptr, hselk, NLUTK,
            pid_t, pid_bh, H, t_ok, inv_sqrt_d, pos0,
            D, LOG2D, KBITS, BLOCK_T, ROT, XMODE, True, KSEARCH, PERM, KWORDS,
        )
        _exact_copy(k_ptr, skb, skh, skt, rk_ptr, srkb, srkh, srkt, sk_ptr, sskb, sskh, sskt, pid_t, pid_bh, H, T, pos0,
                    cap, window, n_sinks, D, BLOCK_T)
    else:
        _quantize_tile(
            v_ptr, svb, svh, svt, svd, pv_ptr, spvb, spvh, spvt, nv_ptr, snvb, snvh, snvt,
            rop, bndv_ptr, sbvh, lutv_ptr, slvh, lov_ptr, invwv_ptr, hselv, NLUTV,
            pid_t, pid_bh, H, t_ok, inv_sqrt_d, pos0,
            D, LOG2D, VBITS, BLOCK_T, ROT, XMODE, True, VSEARCH, PERM, VWORDS,
        )
        _exact_copy(v_ptr, svb, svh, svt, rv_ptr, srvb, srvh, srvt, sv_ptr, ssvb, ssvh, ssvt, pid_t, pid_bh, H, T, pos0,
                    cap, window, n_sinks, D, BLOCK_T)


@triton.jit
def _append_one_kernel(
    x_ptr, sxb, sxh, sxt, sxd, p_ptr, spb, sph, spt, n_ptr, snb, snh, snt,
    bnd_ptr, sbh, lut_ptr, slh, lo_ptr, invw_ptr, hsel, NLUT,
    r_ptr, srb, srh, srt, s_ptr, ssb, ssh, sst,
    len_ptr, cap, window, n_sinks,
    mat_ptr, H, T, inv_sqrt_d, n_t_tiles,
    D: tl.constexpr, LOG2D: tl.constexpr, BITS: tl.constexpr, BLOCK_T: tl.constexpr,
    ROT: tl.constexpr, XMODE: tl.constexpr, SEARCH: tl.constexpr, PERM: tl.constexpr, WORDS: tl.constexpr,
    CODES: tl.constexpr, COPY: tl.constexpr,
):
    """One tensor of a static layer's append at the position its device length holds: its codes and norms (CODES),
    and / or its exact copies to the window and sinks (COPY). Split keys take one launch per part for the codes and
    one for the whole keys' copies (`append_parts_into`)."""
    tile = tl.program_id(0)
    pid_t, pid_bh = tile % n_t_tiles, tile // n_t_tiles
    pos0 = tl.load(len_ptr).to(tl.int64)
    if CODES:
        rop = _load_rot(mat_ptr, D)
        _quantize_tile(
            x_ptr, sxb, sxh, sxt, sxd, p_ptr, spb, sph, spt, n_ptr, snb, snh, snt,
            rop, bnd_ptr, sbh, lut_ptr, slh, lo_ptr, invw_ptr, hsel, NLUT,
            pid_t, pid_bh, H, tl.minimum(T, cap - pos0).to(tl.int32), inv_sqrt_d, pos0,
            D, LOG2D, BITS, BLOCK_T, ROT, XMODE, True, SEARCH, PERM, WORDS,
        )
    if COPY:
        _exact_copy(x_ptr, sxb, sxh, sxt, r_ptr, srb, srh, srt, s_ptr, ssb, ssh, sst, pid_t, pid_bh, H, T, pos0,
                    cap, window, n_sinks, D, BLOCK_T)


@triton.jit
def _advance_kernel(len_ptr, from_ptr, n, window):
    """length += n; exact_from = max(exact_from, length - window): one program, after `_append_kv_kernel`."""
    length = tl.load(len_ptr) + n
    tl.store(len_ptr, length)
    tl.store(from_ptr, tl.maximum(tl.load(from_ptr), length - window))


def _modes(x_dtype: torch.dtype, rotation: Rotation, rot: str | None) -> tuple[int, int, torch.dtype]:
    """(ROT, XMODE, dtype of the matrix operand) for this input and rotation."""
    if rot not in (None, "dot"):
        raise ValueError(f"rot must be None or 'dot', got {rot!r}")
    if rotation.kind != "hadamard":
        return C.ROT_DENSE, C.X_FP32, torch.float32
    if C.INTERPRET:  # the interpreter's bf16 dot multiplies raw bit patterns: use fp32 there
        return C.ROT_PM1_DOT, C.X_FP32, torch.float32
    if x_dtype == torch.float32:
        return C.ROT_PM1_DOT, C.X_SPLIT3, torch.bfloat16
    return C.ROT_PM1_DOT, C.X_NATIVE, x_dtype


SEARCHES = {"linear": 0, "lut": 1, "binary": 2, "sat": 4, "poly": 5}


@C._per_codebook_and_device
def _symmetric(codebook: Codebook, heads: int, device: torch.device) -> bool:
    b = codebook.boundaries.detach().to("cpu", torch.float32)
    return bool(torch.equal(b, -b.flip(-1)) and (b[..., (b.shape[-1] - 1) // 2] == 0).all())


def is_symmetric(codebook: Codebook) -> bool:
    """Boundaries exactly mirrored around an exact 0 (the theoretical codebooks; calibrated ones rarely are).

    Held by the codebook (`derived`, shared by its copies and by every copy of a theoretical codebook): the check
    reads the boundaries on the host, which waits for the GPU, and each new cache's layers hold new Codebook
    objects."""
    return _symmetric(codebook, 0, codebook.boundaries.device)


def prepare(codebook: Codebook, heads: int, device: torch.device) -> None:
    """Build now the search tables the default search of this codebook reads (`_search_args`), held by the codebook
    (outside any CUDA graph: the symmetry check reads the codebook on the host, which a captured graph cannot). A pair
    codebook has none: its codes are the torch reference's (`select.quantize_kernel`)."""
    if codebook.pair:
        return
    sym = is_symmetric(codebook)
    if codebook.bits > 4:
        if not sym or C.poly_table(codebook, heads, device) is None:
            C.search_lut(codebook, heads, device)
    elif sym:
        C.sat_table(codebook, heads, device)


def _store_aligned(packed: torch.Tensor, bits: int, dim: int) -> bool:
    """Whether every packed row starts on the word the kernel stores whole: 2 bytes for 'sat' at 1, 2, 4 bits; 4 at 3
    and 5 bits (with dim % 32 == 0) and at 8 bits."""
    if bits in (3, 5) and dim % 32:
        return False
    return C.rows_aligned(packed, 4 if bits in (3, 5, 8) else 2)


def _word_stores(packed: torch.Tensor, bits: int, dim: int) -> bool:
    """Whether the kernel packs 5- and 8-bit indices into int32 words before storing (constexpr WORDS)."""
    return bits in (5, 8) and _store_aligned(packed, bits, dim)


def _search_args(codebook: Codebook, heads: int, dev, search: str | None, packed: torch.Tensor) -> tuple[tuple, int]:
    """(bnd, sbh, table, table head stride, lo, inv_w, hsel, NLUT) for the kernel, and the SEARCH mode.

    Default: symmetric codebooks up to 4 bits count on the FMA pipe ('sat'; the packed rows must be word-aligned, as
    the cache's buffers are); other codebooks up to 4 bits compare linearly; wider symmetric ones take a polynomial
    guess and one gather ('poly'), other wider ones the table ('lut').
    """
    bits, dim = codebook.bits, packed.shape[-1] * 8 // codebook.bits
    sym = is_symmetric(codebook)
    poly = C.poly_table(codebook, heads, dev) if bits > 4 and sym else None
    if search is None:
        if bits > 4:
            search = "lut" if poly is None else "poly"
        else:
            search = "sat" if sym and _store_aligned(packed, bits, dim) else "linear"
    if search not in SEARCHES:
        raise ValueError(f"search must be None or one of {sorted(SEARCHES)}, got {search!r}")
    if search == "sat" and not (sym and bits <= 4):
        raise ValueError(f"search={search!r} needs a symmetric codebook of at most 4 bits, got {bits} bits"
                         + ("" if sym else ", not symmetric"))
    if search == "sat" and not _store_aligned(packed, bits, dim):
        raise ValueError("search='sat' stores whole 16-bit (32-bit at 3 bits) words: packed rows must be aligned to them")
    if search == "poly" and poly is None:
        raise ValueError(f"search='poly' needs a symmetric codebook of 5 to 8 bits with strictly increasing boundaries, "
                         f"got {bits} bits" + ("" if sym else ", not symmetric"))
    _, bnd, _, sbh = C.codebook_tables(codebook, heads, dev)
    if search == "sat":
        tab, sth = C.sat_table(codebook, heads, dev)
        return (bnd, sbh, tab, sth, bnd, bnd, 0, 1), SEARCHES["sat"]
    if search == "poly":
        return (bnd, sbh, poly[0], poly[1], bnd, bnd, 0, 1), SEARCHES["poly"]
    if search == "lut":
        t = C.search_lut(codebook, heads, dev)
        if t is None:  # boundaries too close (or tied) for a small table
            search = "binary"
        else:
            lut, bpad, lo, inv_w, n, slh = t
            return (bpad, bpad.stride(0) if codebook.per_head else 0, lut, slh, lo, inv_w, int(codebook.per_head), n), 1
    return (bnd, sbh, bnd, 0, bnd, bnd, 0, 1), SEARCHES[search]


def _check_x(where: str, x: torch.Tensor, rotation: Rotation, codebook: Codebook, packed_out, norms_out):
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        raise ValueError(f"{where}: x must be a (B, H, T, D) tensor, got shape {tuple(getattr(x, 'shape', ()))}")
    if x.dtype not in C.X_DTYPES:
        raise TypeError(f"{where}: x must be one of {C.X_DTYPES}, got {x.dtype}")
    bsz, heads, tokens, dim = x.shape
    bits, nbytes = C.check_common(where, rotation, codebook, dim)
    lead = (bsz, heads, tokens)
    C.check_device(f"{where}: x", x, x.device)
    C.check_device(f"{where}: packed_out", packed_out, x.device)
    C.check_device(f"{where}: norms_out", norms_out, x.device)
    C.check_packed(where, packed_out, lead, nbytes, dim, bits)
    C.check_norms(where, norms_out, lead)
    return bits


def _check_static(where: str, x: torch.Tensor, rotation: Rotation, codebook: Codebook, packed, norms) -> int:
    """`_check_x` for a static layer's buffers, whose token axis is the capacity, not x's."""
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.dtype not in C.X_DTYPES:
        raise ValueError(f"{where}: x must be a (B, H, n, D) tensor of one of {C.X_DTYPES}, got "
                         f"{tuple(getattr(x, 'shape', ()))} {getattr(x, 'dtype', None)}")
    bsz, heads, _, dim = x.shape
    bits, nbytes = C.check_common(where, rotation, codebook, dim)
    lead = (bsz, heads, packed.shape[2] if packed.dim() == 4 else -1)
    for name, t in (("x", x), ("packed", packed), ("norms", norms)):
        C.check_device(f"{where}: {name}", t, x.device)
    C.check_packed(where, packed, lead, nbytes, dim, bits)
    C.check_norms(where, norms, lead)
    return bits


def _launch_cfg(tokens: int, block: int | None, num_warps: int | None) -> tuple[int, int]:
    bt = C.block_t(tokens) if block is None else block
    return bt, (num_warps if num_warps is not None else 4)


def quantize_into(
    x: torch.Tensor,
    rotation: Rotation,
    codebook: Codebook,
    packed_out: torch.Tensor,
    norms_out: torch.Tensor,
    *,
    rot: str | None = None,
    search: str | None = None,
    block_t: int | None = None,
    num_warps: int | None = None,
    progs_per_sm: int | None = None,
    stages: int = 1,
    maxnreg: int | None = None,
):
    """Quantize x (B, H, T, D) into packed_out (B, H, T, nbytes) uint8 and norms_out (B, H, T), in place.

    rot / search / block_t / num_warps / progs_per_sm (0: one program per tile) / stages / maxnreg (a register cap per
    thread) override the defaults (for the benchmark); the cache never passes them.
    Returns the launched kernel handle (its n_regs / n_spills), or None when there was nothing to do.
    """
    bits = _check_x("quantize_into", x, rotation, codebook, packed_out, norms_out)
    bsz, heads, tokens, dim = x.shape
    if x.numel() == 0:
        return None
    dev = x.device
    rmode, xmode, mdtype = _modes(x.dtype, rotation, rot)
    sargs, smode = _search_args(codebook, heads, dev, search, packed_out)
    mat = C.rotation_operand(rotation, dev, "fwd_mma" if rmode == C.ROT_PM1_DOT else "fwd", mdtype)
    bt, nw = _launch_cfg(tokens, block_t, num_warps)
    if maxnreg is None and smode in (SEARCHES["poly"], SEARCHES["lut"]) and not C.INTERPRET:
        maxnreg = MAXNREG_WIDE
    n_t = triton.cdiv(tokens, bt)
    n_tiles = n_t * bsz * heads
    grid = (C.persistent_grid(n_tiles, dev, PROGS_PER_SM if progs_per_sm is None else progs_per_sm),)
    return _quantize_kernel[grid](
        x, *x.stride(),
        packed_out, *packed_out.stride()[:3],
        norms_out, *norms_out.stride(),
        mat, *sargs,
        heads, tokens, dim**-0.5, n_t, n_tiles,
        D=dim, LOG2D=dim.bit_length() - 1, BITS=bits, BLOCK_T=bt,
        ROT=rmode, XMODE=xmode, X_UNIT=x.stride(-1) == 1,
        SEARCH=smode, STAGES=stages, PERM=rmode == C.ROT_PM1_DOT, WORDS=_word_stores(packed_out, bits, dim),
        num_warps=nw, **({} if maxnreg is None else {"maxnreg": maxnreg}),
    )


def _kv_operands(where: str, check, k, v, rotation: Rotation, k_codebook: Codebook, v_codebook: Codebook, k_packed,
                k_norms, v_packed, v_norms) -> tuple[torch.Tensor, tuple, tuple, dict]:
    """The checks and kernel operands the two keys + values launchers share: (rotation operand, key search args,
    value search args, constexprs). `check` is `_check_x` or `_check_static`."""
    kbits = check(f"{where} (keys)", k, rotation, k_codebook, k_packed, k_norms)
    vbits = check(f"{where} (values)", v, rotation, v_codebook, v_packed, v_norms)
    if k.shape != v.shape or k.dtype != v.dtype or k.device != v.device:
        raise ValueError(f"{where}: keys {tuple(k.shape)} {k.dtype} {k.device} and values {tuple(v.shape)} {v.dtype} "
                         f"{v.device} must match in shape, dtype and device")
    if k_norms.dtype != v_norms.dtype:
        raise TypeError(f"{where}: key norms are {k_norms.dtype}, value norms {v_norms.dtype}; use one dtype")
    heads, dim, dev = k.shape[1], k.shape[3], k.device
    rmode, xmode, mdtype = _modes(k.dtype, rotation, None)
    mat = C.rotation_operand(rotation, dev, "fwd_mma" if rmode == C.ROT_PM1_DOT else "fwd", mdtype)
    kargs, kmode = _search_args(k_codebook, heads, dev, None, k_packed)
    vargs, vmode = _search_args(v_codebook, heads, dev, None, v_packed)
    meta = dict(D=dim, LOG2D=dim.bit_length() - 1, KBITS=kbits, VBITS=vbits, ROT=rmode, XMODE=xmode, KSEARCH=kmode,
                VSEARCH=vmode, PERM=rmode == C.ROT_PM1_DOT, KWORDS=_word_stores(k_packed, kbits, dim),
                VWORDS=_word_stores(v_packed, vbits, dim))
    return mat, kargs, vargs, meta


def quantize_kv_into(
    k: torch.Tensor,
    v: torch.Tensor,
    rotation: Rotation,
    k_codebook: Codebook,
    v_codebook: Codebook,
    k_packed: torch.Tensor,
    k_norms: torch.Tensor,
    v_packed: torch.Tensor,
    v_norms: torch.Tensor,
    *,
    block_t: int | None = None,
    num_warps: int | None = None,
):
    """`quantize_into` for keys and values of one layer in a single launch (the per-decode-step path)."""
    mat, kargs, vargs, meta = _kv_operands("quantize_kv_into", _check_x, k, v, rotation, k_codebook, v_codebook,
                                           k_packed, k_norms, v_packed, v_norms)
    bsz, heads, tokens, dim = k.shape
    if k.numel() == 0:
        return None
    bt, nw = _launch_cfg(tokens, block_t, num_warps)
    n_t = triton.cdiv(tokens, bt)
    grid = (n_t * bsz * heads, 2)
    return _quantize_kv_kernel[grid](
        k, *k.stride(), k_packed, *k_packed.stride()[:3], k_norms, *k_norms.stride(), *kargs,
        v, *v.stride(), v_packed, *v_packed.stride()[:3], v_norms, *v_norms.stride(), *vargs,
        mat, heads, tokens, dim**-0.5, n_t, n_t * bsz * heads,
        BLOCK_T=bt, K_UNIT=k.stride(-1) == 1, V_UNIT=v.stride(-1) == 1, num_warps=nw, **meta,
    )


def append_kv_into(
    k: torch.Tensor,
    v: torch.Tensor,
    rotation: Rotation,
    k_codebook: Codebook,
    v_codebook: Codebook,
    k_packed: torch.Tensor,
    k_norms: torch.Tensor,
    v_packed: torch.Tensor,
    v_norms: torch.Tensor,
    window_k: torch.Tensor,
    window_v: torch.Tensor,
    sink_k: torch.Tensor,
    sink_v: torch.Tensor,
    length: torch.Tensor,
    exact_from: torch.Tensor,
    n_sinks: int,
) -> None:
    """A static layer's append in two launches, with no host read of its lengths (a CUDA graph replays it): the n
    tokens of k, v (B, H, n, D) are quantized into the packed buffers (B, H, capacity, bytes) and norms at positions
    length .. length + n - 1 (none past the capacity), the last min(n, window) of them copied to the window (B, H,
    window, D) at slot position % window and those below n_sinks to sink slot position; then length += n and
    exact_from = max(exact_from, length - window). The reference is `reference.static_append`."""
    bsz, heads, tokens, dim = k.shape
    cap, window = k_packed.shape[2], window_k.shape[2]
    mat, kargs, vargs, meta = _kv_operands("append_kv_into", _check_static, k, v, rotation, k_codebook, v_codebook,
                                           k_packed, k_norms, v_packed, v_norms)
    for name, t, rows in (("window_k", window_k, window), ("window_v", window_v, window),
                          ("sink_k", sink_k, sink_k.shape[2]), ("sink_v", sink_v, sink_v.shape[2])):
        if t.shape != (bsz, heads, rows, dim) or t.dtype != k.dtype or t.device != k.device or t.stride(-1) != 1:
            raise ValueError(f"append_kv_into: {name} must be ({bsz}, {heads}, rows, {dim}) {k.dtype} on {k.device} "
                             f"with unit last stride, got {tuple(t.shape)} {t.dtype} {t.device}")
    if sink_k.shape != sink_v.shape or not 0 <= n_sinks <= sink_k.shape[2]:
        raise ValueError(f"append_kv_into: n_sinks={n_sinks} must be in [0, {sink_k.shape[2]}], the sink buffers' rows")
    if window < 1:
        raise ValueError("append_kv_into: the window must hold at least one token")
    if tokens == 0:
        return
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    bt, nw = _launch_cfg(tokens, None, None)
    n_t = triton.cdiv(tokens, bt)
    _append_kv_kernel[(n_t * bsz * heads, 2)](
        k, *k.stride(), k_packed, *k_packed.stride()[:3], k_norms, *k_norms.stride(), *kargs,
        v, *v.stride(), v_packed, *v_packed.stride()[:3], v_norms, *v_norms.stride(), *vargs,
        window_k, *window_k.stride()[:3], window_v, *window_v.stride()[:3], sink_k, *sink_k.stride()[:3],
        sink_v, *sink_v.stride()[:3],
        length, cap, window, n_sinks,
        mat, heads, tokens, dim**-0.5, n_t,
        BLOCK_T=bt, num_warps=nw, **meta,
    )
    _advance_kernel[(1,)](length, exact_from, tokens, window)


def _append_one(x, rotation, codebook, packed, norms, window, sink, length, n_sinks, cap, codes: bool, copy: bool):
    """Launch `_append_one_kernel` for x (B, H, n, D') with unit last stride; `rotation` / `codebook` / `packed` /
    `norms` are read only with `codes`, `window` / `sink` only with `copy`."""
    bsz, heads, tokens, dim = x.shape
    bt, nw = _launch_cfg(tokens, None, None)
    n_t = triton.cdiv(tokens, bt)
    if codes:
        _check_static("append_parts_into", x, rotation, codebook, packed, norms)
        rmode, xmode, mdtype = _modes(x.dtype, rotation, None)
        mat = C.rotation_operand(rotation, x.device, "fwd_mma" if rmode == C.ROT_PM1_DOT else "fwd", mdtype)
        sargs, smode = _search_args(codebook, heads, x.device, None, packed)
        meta = dict(BITS=codebook.bits, ROT=rmode, XMODE=xmode, SEARCH=smode, PERM=rmode == C.ROT_PM1_DOT,
                    WORDS=_word_stores(packed, codebook.bits, dim))
        pargs = (packed, *packed.stride()[:3], norms, *norms.stride())
    else:
        mat, sargs = x, (x, 0, x, 0, x, x, 0, 1)
        meta = dict(BITS=1, ROT=0, XMODE=0, SEARCH=0, PERM=False, WORDS=False)
        pargs = (x, 0, 0, 0, x, 0, 0, 0)
    rargs = (window, *window.stride()[:3], sink, *sink.stride()[:3]) if copy else (x, 0, 0, 0, x, 0, 0, 0)
    _append_one_kernel[(n_t * bsz * heads,)](
        x, *x.stride(), *pargs, *sargs, *rargs,
        length, cap, window.shape[2] if copy else 1, n_sinks,
        mat, heads, tokens, dim**-0.5, n_t,
        D=dim, LOG2D=dim.bit_length() - 1, BLOCK_T=bt, CODES=codes, COPY=copy, num_warps=nw, **meta,
    )


def append_parts_into(k, v, key_codes, key_quantizers, key_parts, rotation, v_codebook, v_packed, v_norms, window_k,
                      window_v, sink_k, sink_v, length, exact_from, n_sinks) -> None:
    """`append_kv_into` for a static layer whose keys are stored as other tensors than k: the parts of split keys
    (`key_split.KeySplit.split`) and / or centred keys (k - R(t) mu). key_codes[p] (B, H, n, D_p) is quantized with
    key_quantizers[p] (rotation, codebook) into key_parts[p] (packed (B, H, capacity, bytes), norms); k itself gives
    the exact copies; the values, their copies and the lengths as in `append_kv_into`. No host read of the lengths.
    The reference is `reference.static_append` with key_codes (and a split)."""
    bsz, heads, tokens, dim = k.shape
    if k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError(f"append_parts_into: keys {tuple(k.shape)} {k.dtype} and values {tuple(v.shape)} {v.dtype} "
                         "must match")
    for name, t in (("window_k", window_k), ("window_v", window_v), ("sink_k", sink_k), ("sink_v", sink_v)):
        if t.shape[:2] != (bsz, heads) or t.shape[3] != dim or t.dtype != k.dtype or t.stride(-1) != 1:
            raise ValueError(f"append_parts_into: {name} must be ({bsz}, {heads}, rows, {dim}) {k.dtype} with unit "
                             f"last stride, got {tuple(t.shape)} {t.dtype}")
    if not 0 <= n_sinks <= sink_k.shape[2] or window_k.shape[2] < 1:
        raise ValueError(f"append_parts_into: n_sinks={n_sinks} must be in [0, {sink_k.shape[2]}] and the window "
                         f"non-empty")
    if tokens == 0:
        return
    cap = v_packed.shape[2]
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    _append_one(v, rotation, v_codebook, v_packed, v_norms, window_v, sink_v, length, n_sinks, cap, True, True)
    _append_one(k, None, None, None, None, window_k, sink_k, length, n_sinks, cap, False, True)
    for part, (rot, cb), (packed, norms) in zip(key_codes, key_quantizers, key_parts):
        part = part if part.stride(-1) == 1 else part.contiguous()
        _append_one(part, rot, cb, packed, norms, None, None, length, n_sinks, cap, True, False)
    _advance_kernel[(1,)](length, exact_from, tokens, window_k.shape[2])
