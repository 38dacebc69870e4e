"""Fused decode attention on TurboQuant-packed keys and values (few queries: decode and small chunks).

Math. A packed key is k = ||k|| Pi^T c[idx_k], so q.k = ||k|| (Pi q).c[idx_k]: the query is rotated once
(q' = Pi q) and scored against centroids, never materializing the key. Values are accumulated in the rotated
domain, sum_j p_j ||v_j|| c[idx_vj], and rotated back once (y @ Pi = Pi^T y) after the split-K reduction.
The exact copies (sinks, then the window: a dynamic layer's residual window, which holds the step's new tokens,
or a static layer's window, a ring buffer) are an unrotated segment with its own accumulator; both share one
online-softmax state, so the result is exactly softmax over every position the layer holds (see `PackedKV`).

Planes. The coordinates of a packed row are taken in the order the bytes hold them: plane k is coordinates
P * c + k (P = 8 / bits at 2, 4 and 8 bits, else 8: the groups of 8 indices). Each plane is its own dot against
the matching plane of q' (K) or its own accumulator, rotated back with the matching rows of Pi (V), so no index
tile is ever reshuffled. Centroids come from a table whose entries hold several fp16 centroids side by side (a
byte's 8 / bits, or a pair of indices at the group widths): one load, then shifts (`lookup_table`).

Layout. Grid (B * Hkv, S + 1). Programs 0..S-1 of a (batch, KV head) each take a contiguous slice of the packed
history; program S takes the exact copies. All query heads of one KV head (GQA) and all n
queries are the M rows of one tile (row r = g * n + i for query head Hkv_idx * G + g and query i), so each packed
byte is read once per KV head. Partial (m, l, acc) go to a cached fp32 scratch; the last program of a (batch, KV
head) merges them and writes (B, n, Hq, D) in the model dtype. One warp per program (`DEFAULT_WARPS`).

Causality: the n queries end at the last key; without a mask, query i sees everything but the new tokens j > i.
With a mask (boolean True = attend, or additive), only the mask decides, as in `reference.attention`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from .support import decode_supports as supports
from .support import split_supports
from .support import decode_plan, num_splits_for
from . import _common as C
from . import decode_args as A
from .decode_args import LOG2E, scratch as _scratch  # noqa: F401  (the eager scratch, by its old name too)

if TYPE_CHECKING:
    from ..quant.packed_kv import PackedKV

BLOCK_N = 32


def planes(bits: int) -> int:
    """Coordinate planes of a packed row: plane k holds coordinates P * c + k, c = 0 .. D / P - 1."""
    return 8 // bits if bits in (2, 4, 8) else 8


@triton.jit
def _load_packed(base, offs_t, t_ok, BITS: tl.constexpr, D: tl.constexpr, STRIDE_T: tl.constexpr,
                 W: tl.constexpr):
    """The raw packed words of len(offs_t) rows (row stride STRIDE_T bytes), W columns: at 2, 4 and 8 bits one
    int32 per byte (W = D * BITS / 8), else one int64 per group of 8 indices (`_common.load_groups`, padded to W >=
    16 columns with zeros; rows are whole words: the launcher checks the base's alignment)."""
    if BITS == 2 or BITS == 4 or BITS == 8:
        cols = tl.arange(0, W)
        ok = t_ok[:, None]
        if W > D * BITS // 8:  # a narrow split-key part: columns past the row read as 0 (their query plane is 0)
            ok = ok & (cols < D * BITS // 8)[None, :]
        v = tl.load(base + offs_t[:, None] * STRIDE_T + cols[None, :], mask=ok, other=0).to(tl.int32)
    else:
        v = C.load_groups(base + offs_t * STRIDE_T, t_ok, BITS, D, 4, W)
    return v


@triton.jit
def _entries(tab, raw, m: tl.constexpr, BITS: tl.constexpr):
    """Lookup-table entries of a raw tile, each several fp16 centroids side by side: at 2, 4 and 8 bits the
    entry of each byte (its 8 / BITS centroids), else the entry of pair m of each group of 8 (two centroids)."""
    if BITS == 2 or BITS == 4 or BITS == 8:
        e = tl.load(tab + raw)
    else:
        e = tl.load(tab + ((raw >> (2 * m * BITS)) & ((1 << (2 * BITS)) - 1)).to(tl.int32))
    return e


@triton.jit
def _half(e, j: tl.constexpr):
    """The j-th fp16 centroid of every entry."""
    if j > 0:
        e = e >> (16 * j)
    return e.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _qk(s, q, e, j: tl.constexpr):
    """s + q @ plane^T for the plane that is centroid j of the entries e."""
    return tl.dot(q, tl.trans(_half(e, j)), s)


@triton.jit
def _pv(acc, p, e, j: tl.constexpr):
    return tl.dot(p, _half(e, j), acc)


@triton.jit
def _query_plane(q, pi_ptr, k: tl.constexpr, P: tl.constexpr, W: tl.constexpr, D: tl.constexpr, scale_log2):
    """Plane k of the rotated query, (Pi q)[P * c + k] for c < W, pre-scaled for exp2, fp16; padding columns 0."""
    c = tl.arange(0, W)
    d = tl.arange(0, D)
    pit = tl.load(pi_ptr + (P * c[None, :] + k) * D + d[:, None], mask=(c < D // P)[None, :], other=0.0)
    return (tl.dot(q, pit) * scale_log2).to(tl.float16)


@triton.jit
def _given_block(qs, r, k: tl.constexpr, W: tl.constexpr, QOFF: tl.constexpr, QC: tl.constexpr):
    """Block k (W columns) of a split-key part's query as the launcher wrote it (`split_query_planes`): (BLOCK_M, W)
    fp16 from the program's rows of `qs`, the part's blocks starting at column QOFF."""
    c = tl.arange(0, W)
    return tl.load(qs + r[:, None] * QC + QOFF + k * W + c[None, :])


@triton.jit
def _part_scores(s, qs, r, kp, kn, kt, offs, t_ok, BITS: tl.constexpr, DP: tl.constexpr, STRIDE_T: tl.constexpr,
                 W: tl.constexpr, QOFF: tl.constexpr, QC: tl.constexpr, BLOCK_N: tl.constexpr):
    """s + the scores of one part of split keys (its own codes, norms and table): sum over blocks of
    q'_p block @ centroid block^T, times the part's norms. At 2, 4 and 8 bits a block is a coordinate plane (as for
    whole keys); at the group widths it is a pair of planes side by side (column 2c + j: coordinate 8c + 2m + j for
    pair m), so that a part of 64 channels fills a 16-wide dot without padding. The query blocks are loaded from
    `qs` at each tile (they stay in L1)."""
    nrm = tl.load(kn + offs, mask=t_ok, other=0.0).to(tl.float32)
    sp = tl.zeros(s.shape, dtype=tl.float32)
    if BITS == 2 or BITS == 4 or BITS == 8:
        raw = _load_packed(kp, offs, t_ok, BITS, DP, STRIDE_T, W)
        e = _entries(kt, raw, 0, BITS)
        for k in tl.static_range(8 // BITS):
            sp = _qk(sp, _given_block(qs, r, k, W, QOFF, QC), e, k)
    else:
        raw = _load_packed(kp, offs, t_ok, BITS, DP, STRIDE_T, W // 2)
        for m in tl.static_range(4):
            e = _entries(kt, raw, m, BITS)
            pair = tl.reshape(tl.join(_half(e, 0), _half(e, 1)), (BLOCK_N, W))
            sp = tl.dot(_given_block(qs, r, m, W, QOFF, QC), tl.trans(pair), sp)
    return s + sp * nrm[None, :]


@triton.jit
def _unrotate_plane(out, acc, pi_ptr, k: tl.constexpr, P: tl.constexpr, W: tl.constexpr, D: tl.constexpr):
    """out + acc @ Pi[P * c + k, :]: plane k's share of the values' inverse rotation (padding rows 0)."""
    c = tl.arange(0, W)
    d = tl.arange(0, D)
    pi = tl.load(pi_ptr + (P * c[:, None] + k) * D + d[None, :], mask=(c < D // P)[:, None], other=0.0)
    return tl.dot(acc, pi, out)


@triton.jit
def _mask_row(m_base, pos, t_ok, smt, MASK_KIND: tl.constexpr):
    """The shared mask row of keys `pos` (MASK_KIND 3 / 4; 0 elsewhere): loaded ahead of its tile by the packed loop."""
    if MASK_KIND == 3:
        return tl.load(m_base + pos * smt, mask=t_ok, other=0)
    elif MASK_KIND == 4:
        return tl.load(m_base + pos * smt, mask=t_ok, other=0.0)
    else:
        return tl.zeros(pos.shape, dtype=tl.int8)


@triton.jit
def _masked_scores(s, pos, t_ok, row_ok, row_i, heads, m_base, smh, smi, smt, causal_limit, MASK_KIND: tl.constexpr,
                   mrow=None, ROW_GIVEN: tl.constexpr = False):
    """Scores (base 2) with -inf where a key is out of range or masked out. MASK_KIND: 0 causal (no mask), 1 boolean,
    2 additive, one value per tile element; 3 boolean, 4 additive, one row shared by every tile row (a mask that
    broadcasts over the heads and the queries: one load per key instead of one per row and key), passed in as
    `mrow` with ROW_GIVEN (`_mask_row`, loaded a tile ahead)."""
    ok = t_ok[None, :] & row_ok[:, None]
    if MASK_KIND == 0:
        ok = ok & (pos[None, :] <= causal_limit[:, None])
    elif MASK_KIND == 1:
        mv = tl.load(m_base + heads[:, None] * smh + row_i[:, None] * smi + pos[None, :] * smt, mask=ok, other=0)
        ok = ok & (mv != 0)
    elif MASK_KIND == 2:
        mv = tl.load(m_base + heads[:, None] * smh + row_i[:, None] * smi + pos[None, :] * smt, mask=ok, other=0.0)
        s = s + mv.to(tl.float32) * 1.4426950408889634
    elif MASK_KIND == 3:
        mv = mrow if ROW_GIVEN else _mask_row(m_base, pos, t_ok, smt, MASK_KIND)
        ok = ok & (mv != 0)[None, :]
    else:
        mv = mrow if ROW_GIVEN else _mask_row(m_base, pos, t_ok, smt, MASK_KIND)
        s = s + (mv.to(tl.float32) * 1.4426950408889634)[None, :]
    return tl.where(ok, s, float("-inf"))


@triton.jit
def _softmax_step(s, m_i, l_i):
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_i


@triton.jit
def _fp_segment(q, acc, m_i, l_i, k_base, v_base, sk, sv, length, pos0, scale_log2,
                row_ok, row_i, heads, m_base, smh, smi, smt, causal_limit, window,
                D: tl.constexpr, BLOCK_N: tl.constexpr, MASK_KIND: tl.constexpr, WRAP: tl.constexpr):
    """Attend to `length` full-precision (unrotated) tokens at absolute positions pos0 + j, stored at slot j, or at
    slot (pos0 + j) % window with WRAP (a static layer's window, a ring buffer)."""
    d = tl.arange(0, D)
    for t0 in range(0, length, BLOCK_N):
        offs = t0 + tl.arange(0, BLOCK_N)
        t_ok = offs < length
        if WRAP:
            slot = (pos0 + offs) % window
        else:
            slot = offs
        k = tl.load(k_base + slot[:, None] * sk + d[None, :], mask=t_ok[:, None], other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * scale_log2
        s = _masked_scores(s, pos0 + offs, t_ok, row_ok, row_i, heads, m_base, smh, smi, smt, causal_limit, MASK_KIND)
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i)
        v = tl.load(v_base + slot[:, None] * sv + d[None, :], mask=t_ok[:, None], other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v)
    return acc, m_i, l_i


@triton.jit
def _program_rows(pid, Hkv, N, G: tl.constexpr, BLOCK_M: tl.constexpr):
    """A program's (batch, KV head) and its tile rows: row r is query r % N of query head h * G + r // N."""
    b = (pid // Hkv).to(tl.int64)
    h = (pid % Hkv).to(tl.int64)
    r = tl.arange(0, BLOCK_M)
    row_i = r % N
    return b, h, r, row_i, r < G * N, h * G + r // N


@triton.jit
def _lengths(Lq, Lr, Ls, len_ptr, from_ptr, STATIC: tl.constexpr):
    """(T, Lq, Lr, Ls): positions held, packed ones, exact ones after them, sinks. A static layer's are read on the
    device (a CUDA graph replays them); a dynamic layer's come from the host."""
    if STATIC:
        T = tl.load(len_ptr).to(tl.int32)
        Lq = tl.load(from_ptr).to(tl.int32)
        Lr = T - Lq
        Ls = tl.minimum(Ls, Lq)
    else:
        T = Lq + Lr
    return T, Lq, Lr, Ls


@triton.jit(do_not_specialize=["Lq", "Lr", "N", "Ls", "tok_per_split", "num_splits", "window"])
def _decode_kernel(
    q_ptr, sqb, sqh, sqn,
    pi_ptr,
    kp_ptr, skpb, skph, kn_ptr, sknb, sknh,
    vp_ptr, svpb, svph, vn_ptr, svnb, svnh,
    kt_ptr, vt_ptr,
    rk_ptr, srkb, srkh, rv_ptr, srvb, srvh,
    sk_ptr, sskb, sskh, sv_ptr, ssvb, ssvh,
    m_ptr, smb, smh, smi, smt,
    o_ptr, sob, son, soh,
    acc_ptr, ml_ptr, cnt_ptr,
    Hkv, Lq, Lr, N, Ls, tok_per_split, num_splits, scale_log2,
    len_ptr, from_ptr, window,
    qs_ptr, k1_ptr, sk1b, sk1h, n1_ptr, sn1b, sn1h, t1_ptr, k2_ptr, sk2b, sk2h, n2_ptr, sn2b, sn2h, t2_ptr,
    G: tl.constexpr, D: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,
    KPT: tl.constexpr, VPT: tl.constexpr, KT_SH: tl.constexpr, VT_SH: tl.constexpr,
    KP: tl.constexpr, VP: tl.constexpr, KW: tl.constexpr, VW: tl.constexpr,
    BLOCK_M: tl.constexpr, R: tl.constexpr, SC: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_KIND: tl.constexpr, PREFETCH: tl.constexpr,
    STATIC: tl.constexpr, ROTATE_ONCE: tl.constexpr, FP_BLOCK_N: tl.constexpr,
    NPARTS: tl.constexpr, QC: tl.constexpr, K0D: tl.constexpr, K0W: tl.constexpr,
    K1BITS: tl.constexpr, K1D: tl.constexpr, K1PT: tl.constexpr, K1W: tl.constexpr, Q1OFF: tl.constexpr,
    T1_SH: tl.constexpr,
    K2BITS: tl.constexpr, K2D: tl.constexpr, K2PT: tl.constexpr, K2W: tl.constexpr, Q2OFF: tl.constexpr,
    T2_SH: tl.constexpr,
):
    """One launch: programs (pid, split) write partial (m, l, acc) for their slice, all in the unrotated domain
    (the packed splits rotate their accumulator back themselves); the last program of a (batch, KV head) to
    finish, found with an acq_rel counter, merges the S + 1 partials and writes the output, then re-zeroes the
    counter. ROTATE_ONCE (`rotate_once`): the query planes come from the launcher, the packed splits store their
    accumulator rotated, by planes, and the merge rotates the sum back. The exact copies go FP_BLOCK_N at a time
    (16 at head dim 256, where a 32-token fp32 tile spills). Packed buffers are (B, H, slots, bytes) (token strides
    KPT / VPT bytes, norms 1 element); the window and sink buffers' token stride is D. The first Ls packed tokens are
    skipped: their exact copies (the attention sinks) are attended to with the window instead. Dynamic layers: host
    lengths, packed [0, Lq), window [Lq, Lq + Lr) in order. STATIC: lengths on the device, the window holds position p
    at slot p % window.
    Split keys (NPARTS 2 or 3; 0 otherwise): kp / kn / kt are part 0's (K0D channels at KBITS), parts 1 and 2 come
    as k1 / n1 / t1 and k2 / n2 / t2; every part's query blocks (permuted and rotated per part) are in qs, and each
    part is scored by `_part_scores`."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b, h, r, row_i, row_ok, heads = _program_rows(pid, Hkv, N, G, BLOCK_M)
    d = tl.arange(0, D)
    if not ROTATE_ONCE:
        q = tl.load(q_ptr + b * sqb + heads[:, None] * sqh + row_i[:, None] * sqn + d[None, :],
                    mask=row_ok[:, None], other=0.0).to(tl.float32)
    m_base = m_ptr + b * smb
    T, Lq, Lr, Ls = _lengths(Lq, Lr, Ls, len_ptr, from_ptr, STATIC)
    causal_limit = T - N + row_i  # the last position query i may see (used without a mask)
    acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if split < num_splits:
        # packed history, rotated domain, by coordinate planes (see `planes`): K plane k is scored against the
        # matching plane of q' = Pi q; V plane k accumulates into its own a_k, rotated back at the end
        qs = qs_ptr + pid.to(tl.int64) * (BLOCK_M * QC)
        if NPARTS == 0 and ROTATE_ONCE:  # the planes of q' = Pi q, made by the launcher (`query_planes`)
            q0 = _given_block(qs, r, 0, KW, 0, QC)
            if KP >= 2:
                q1 = _given_block(qs, r, 1, KW, 0, QC)
            if KP >= 4:
                q2 = _given_block(qs, r, 2, KW, 0, QC)
                q3 = _given_block(qs, r, 3, KW, 0, QC)
            if KP == 8:
                q4 = _given_block(qs, r, 4, KW, 0, QC)
                q5 = _given_block(qs, r, 5, KW, 0, QC)
                q6 = _given_block(qs, r, 6, KW, 0, QC)
                q7 = _given_block(qs, r, 7, KW, 0, QC)
        if NPARTS == 0 and not ROTATE_ONCE:
            q0 = _query_plane(q, pi_ptr, 0, KP, KW, D, scale_log2)
            if KP >= 2:
                q1 = _query_plane(q, pi_ptr, 1, KP, KW, D, scale_log2)
            if KP >= 4:
                q2 = _query_plane(q, pi_ptr, 2, KP, KW, D, scale_log2)
                q3 = _query_plane(q, pi_ptr, 3, KP, KW, D, scale_log2)
            if KP == 8:
                q4 = _query_plane(q, pi_ptr, 4, KP, KW, D, scale_log2)
                q5 = _query_plane(q, pi_ptr, 5, KP, KW, D, scale_log2)
                q6 = _query_plane(q, pi_ptr, 6, KP, KW, D, scale_log2)
                q7 = _query_plane(q, pi_ptr, 7, KP, KW, D, scale_log2)
        a0 = tl.zeros((BLOCK_M, VW), dtype=tl.float32)
        a1 = tl.zeros((BLOCK_M, VW), dtype=tl.float32)
        a2 = tl.zeros((BLOCK_M, VW), dtype=tl.float32)
        a3 = tl.zeros((BLOCK_M, VW), dtype=tl.float32)
        a4 = tl.zeros((BLOCK_M, VW), dtype=tl.float32)
        a5 = tl.zeros((BLOCK_M, VW), dtype=tl.float32)
        a6 = tl.zeros((BLOCK_M, VW), dtype=tl.float32)
        a7 = tl.zeros((BLOCK_M, VW), dtype=tl.float32)
        start = split * tok_per_split
        end = tl.minimum(start + tok_per_split, Lq)
        kp = kp_ptr + b * skpb + h * skph
        vp = vp_ptr + b * svpb + h * svph
        kn = kn_ptr + b * sknb + h * sknh
        vn = vn_ptr + b * svnb + h * svnh
        kt = kt_ptr + h * KT_SH
        vt = vt_ptr + h * VT_SH
        if PREFETCH == 2:  # software pipelining by hand: the next tile's bytes load during this tile's math
            offs = start + tl.arange(0, BLOCK_N)
            t_ok = offs < end
            if NPARTS == 0:  # split keys load their parts in `_part_scores`
                kraw = _load_packed(kp, offs, t_ok, KBITS, D, KPT, KW)
                knorm = tl.load(kn + offs, mask=t_ok, other=0.0).to(tl.float32)
            vraw = _load_packed(vp, offs, t_ok, VBITS, D, VPT, VW)
            vnorm = tl.load(vn + offs, mask=t_ok, other=0.0).to(tl.float32)
            mrow = _mask_row(m_base, offs, t_ok, smt, MASK_KIND)
        for t0 in range(start, end, BLOCK_N):
            offs = t0 + tl.arange(0, BLOCK_N)
            t_ok = (offs < end) & (offs >= Ls)
            if PREFETCH == 2:
                v_cur, vn_cur, m_cur = vraw, vnorm, mrow
                offs2 = offs + BLOCK_N
                t_ok2 = offs2 < end
                if NPARTS == 0:
                    k_cur, kn_cur = kraw, knorm
                    kraw = _load_packed(kp, offs2, t_ok2, KBITS, D, KPT, KW)
                    knorm = tl.load(kn + offs2, mask=t_ok2, other=0.0).to(tl.float32)
                vraw = _load_packed(vp, offs2, t_ok2, VBITS, D, VPT, VW)
                vnorm = tl.load(vn + offs2, mask=t_ok2, other=0.0).to(tl.float32)
                mrow = _mask_row(m_base, offs2, t_ok2, smt, MASK_KIND)
            else:
                if NPARTS == 0:
                    k_cur = _load_packed(kp, offs, t_ok, KBITS, D, KPT, KW)
                    kn_cur = tl.load(kn + offs, mask=t_ok, other=0.0).to(tl.float32)
                v_cur = _load_packed(vp, offs, t_ok, VBITS, D, VPT, VW)
                vn_cur = tl.load(vn + offs, mask=t_ok, other=0.0).to(tl.float32)
                m_cur = _mask_row(m_base, offs, t_ok, smt, MASK_KIND)
            if NPARTS == 0:
                e = _entries(kt, k_cur, 0, KBITS)
                s = tl.dot(q0, tl.trans(_half(e, 0)))
                if KP == 2:
                    s = _qk(s, q1, e, 1)
                if KP == 4:
                    s = _qk(_qk(_qk(s, q1, e, 1), q2, e, 2), q3, e, 3)
                if KP == 8:  # four pair entries
                    s = _qk(s, q1, e, 1)
                    e = _entries(kt, k_cur, 1, KBITS)
                    s = _qk(_qk(s, q2, e, 0), q3, e, 1)
                    e = _entries(kt, k_cur, 2, KBITS)
                    s = _qk(_qk(s, q4, e, 0), q5, e, 1)
                    e = _entries(kt, k_cur, 3, KBITS)
                    s = _qk(_qk(s, q6, e, 0), q7, e, 1)
                s = s * kn_cur[None, :]
            else:
                s = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                s = _part_scores(s, qs, r, kp, kn, kt, offs, t_ok, KBITS, K0D, KPT, K0W, 0, QC, BLOCK_N)
                s = _part_scores(s, qs, r, k1_ptr + b * sk1b + h * sk1h, n1_ptr + b * sn1b + h * sn1h,
                                 t1_ptr + h * T1_SH, offs, t_ok, K1BITS, K1D, K1PT, K1W, Q1OFF, QC, BLOCK_N)
                if NPARTS >= 3:
                    s = _part_scores(s, qs, r, k2_ptr + b * sk2b + h * sk2h, n2_ptr + b * sn2b + h * sn2h,
                                     t2_ptr + h * T2_SH, offs, t_ok, K2BITS, K2D, K2PT, K2W, Q2OFF, QC, BLOCK_N)
            s = _masked_scores(s, offs, t_ok, row_ok, row_i, heads, m_base, smh, smi, smt, causal_limit, MASK_KIND,
                               m_cur, True)
            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i)
            pv = (p * vn_cur[None, :]).to(tl.float16)
            al = alpha[:, None]
            e = _entries(vt, v_cur, 0, VBITS)
            a0 = _pv(a0 * al, pv, e, 0)
            if VP == 2:
                a1 = _pv(a1 * al, pv, e, 1)
            if VP == 4:
                a1 = _pv(a1 * al, pv, e, 1)
                a2 = _pv(a2 * al, pv, e, 2)
                a3 = _pv(a3 * al, pv, e, 3)
            if VP == 8:
                a1 = _pv(a1 * al, pv, e, 1)
                e = _entries(vt, v_cur, 1, VBITS)
                a2 = _pv(a2 * al, pv, e, 0)
                a3 = _pv(a3 * al, pv, e, 1)
                e = _entries(vt, v_cur, 2, VBITS)
                a4 = _pv(a4 * al, pv, e, 0)
                a5 = _pv(a5 * al, pv, e, 1)
                e = _entries(vt, v_cur, 3, VBITS)
                a6 = _pv(a6 * al, pv, e, 0)
                a7 = _pv(a7 * al, pv, e, 1)
        if ROTATE_ONCE:  # the partial stays rotated, by planes (columns k * D / VP + c): the merge rotates it back
            slot = pid.to(tl.int64) * (num_splits + 1) + split
            _store_plane(acc_ptr, slot, r, a0, 0, R, VP, VW, D)
            if VP >= 2:
                _store_plane(acc_ptr, slot, r, a1, 1, R, VP, VW, D)
            if VP >= 4:
                _store_plane(acc_ptr, slot, r, a2, 2, R, VP, VW, D)
                _store_plane(acc_ptr, slot, r, a3, 3, R, VP, VW, D)
            if VP == 8:
                _store_plane(acc_ptr, slot, r, a4, 4, R, VP, VW, D)
                _store_plane(acc_ptr, slot, r, a5, 5, R, VP, VW, D)
                _store_plane(acc_ptr, slot, r, a6, 6, R, VP, VW, D)
                _store_plane(acc_ptr, slot, r, a7, 7, R, VP, VW, D)
        else:  # back from the rotated domain here, so that every partial is unrotated: y @ Pi = Pi^T y
            acc = _unrotate_plane(acc, a0, pi_ptr, 0, VP, VW, D)
            if VP >= 2:
                acc = _unrotate_plane(acc, a1, pi_ptr, 1, VP, VW, D)
            if VP >= 4:
                acc = _unrotate_plane(acc, a2, pi_ptr, 2, VP, VW, D)
                acc = _unrotate_plane(acc, a3, pi_ptr, 3, VP, VW, D)
            if VP == 8:
                acc = _unrotate_plane(acc, a4, pi_ptr, 4, VP, VW, D)
                acc = _unrotate_plane(acc, a5, pi_ptr, 5, VP, VW, D)
                acc = _unrotate_plane(acc, a6, pi_ptr, 6, VP, VW, D)
                acc = _unrotate_plane(acc, a7, pi_ptr, 7, VP, VW, D)
    else:
        # the exact copies, unrotated: sinks, then the window
        if ROTATE_ONCE:
            q = tl.load(q_ptr + b * sqb + heads[:, None] * sqh + row_i[:, None] * sqn + d[None, :],
                        mask=row_ok[:, None], other=0.0).to(tl.float32)
        acc, m_i, l_i = _fp_segment(q, acc, m_i, l_i, sk_ptr + b * sskb + h * sskh, sv_ptr + b * ssvb + h * ssvh,
                                    D, D, Ls, 0, scale_log2, row_ok, row_i, heads, m_base, smh, smi, smt,
                                    causal_limit, window, D, FP_BLOCK_N, MASK_KIND, False)
        acc, m_i, l_i = _fp_segment(q, acc, m_i, l_i, rk_ptr + b * srkb + h * srkh, rv_ptr + b * srvb + h * srvh,
                                    D, D, Lr, Lq, scale_log2, row_ok, row_i, heads, m_base, smh, smi, smt,
                                    causal_limit, window, D, FP_BLOCK_N, MASK_KIND, STATIC)
    # partials: only the R (>= G * N) live rows of the tile
    base = pid.to(tl.int64) * (num_splits + 1)
    slot = base + split
    keep = r < R
    if not ROTATE_ONCE or split == num_splits:
        tl.store(acc_ptr + (slot * R + r[:, None]) * D + d[None, :], acc, mask=keep[:, None])
    tl.store(ml_ptr + slot * 2 * R + r, m_i, mask=keep)
    tl.store(ml_ptr + slot * 2 * R + R + r, l_i, mask=keep)
    if ROTATE_ONCE:
        _merge_rotated(pid, base, num_splits, acc_ptr, ml_ptr, cnt_ptr, o_ptr, sob, son, soh, b, h, pi_ptr,
                       G, N, R, SC, D, BLOCK_M, VP, VW)
    else:
        _merge(pid, base, num_splits, acc_ptr, ml_ptr, cnt_ptr, o_ptr, sob, son, soh, b, h, d, G, N, R, SC, D)


@triton.jit
def _store_plane(acc_ptr, slot, r, a, k: tl.constexpr, R: tl.constexpr, VP: tl.constexpr, VW: tl.constexpr,
                 D: tl.constexpr):
    """Plane k of a packed program's (rotated) partial: its D / VP live columns at k * D / VP, its R live rows."""
    c = tl.arange(0, VW)
    tl.store(acc_ptr + (slot * R + r[:, None]) * D + k * (D // VP) + c[None, :], a,
             mask=(r < R)[:, None] & (c < D // VP)[None, :])


@triton.jit
def _last_to_arrive(cnt_ptr, pid, num_splits):
    """Whether this program, its partial stored, is the last of its (batch, KV head): then it re-zeroes the counter
    for the next launch and merges. The barrier orders every thread's stores before the release of the counter; the
    acquire orders the merge's (L2, .cg) loads after all of them."""
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel", scope="gpu")
    last = arrived == num_splits
    if last:
        tl.atomic_xchg(cnt_ptr + pid, 0, sem="relaxed", scope="gpu")
    return last


@triton.jit
def _partials_max(ml_ptr, base, count, R: tl.constexpr, SC: tl.constexpr):
    """(R,) the largest running max m of the partials in slots base .. base + count - 1, SC slots at a time."""
    rr = tl.arange(0, R)
    sc = tl.arange(0, SC)
    m = tl.full((R,), float("-inf"), dtype=tl.float32)
    for s0 in range(0, count, SC):
        sl = s0 + sc
        mv = tl.load(ml_ptr + (base + sl)[:, None] * 2 * R + rr[None, :], mask=(sl < count)[:, None],
                     other=float("-inf"), cache_modifier=".cg")
        m = tl.maximum(m, tl.max(mv, 0))
    return m


@triton.jit
def _partials_sum(acc_ptr, ml_ptr, base, count, m_safe, R: tl.constexpr, SC: tl.constexpr, D: tl.constexpr):
    """(l, acc): the sums over slots base .. base + count - 1 of each partial's l and acc, weighted by exp2(m - m_safe)
    (0 for empty splits), SC slots at a time."""
    rr = tl.arange(0, R)
    sc = tl.arange(0, SC)
    d = tl.arange(0, D)
    l = tl.zeros((R,), dtype=tl.float32)
    acc = tl.zeros((R, D), dtype=tl.float32)
    for s0 in range(0, count, SC):
        sl = s0 + sc
        ok = sl < count
        mv = tl.load(ml_ptr + (base + sl)[:, None] * 2 * R + rr[None, :], mask=ok[:, None],
                     other=float("-inf"), cache_modifier=".cg")
        lv = tl.load(ml_ptr + (base + sl)[:, None] * 2 * R + R + rr[None, :], mask=ok[:, None],
                     other=0.0, cache_modifier=".cg")
        w = tl.exp2(mv - m_safe[None, :])  # (SC, R)
        l += tl.sum(w * lv, 0)
        av = tl.load(acc_ptr + ((base + sl)[:, None, None] * R + rr[None, :, None]) * D + d[None, None, :],
                     mask=ok[:, None, None], other=0.0, cache_modifier=".cg")
        acc += tl.sum(w[:, :, None] * av, 0)
    return l, acc


@triton.jit
def _merge(pid, base, num_splits, acc_ptr, ml_ptr, cnt_ptr, o_ptr, sob, son, soh, b, h, d,
           G: tl.constexpr, N, R: tl.constexpr, SC: tl.constexpr, D: tl.constexpr):
    """After a program's partial (m, l, acc) is stored: the last program of its (batch, KV head) to get here merges
    the num_splits + 1 partials and writes the output."""
    if _last_to_arrive(cnt_ptr, pid, num_splits):
        rr = tl.arange(0, R)
        m = _partials_max(ml_ptr, base, num_splits + 1, R, SC)
        l, out = _partials_sum(acc_ptr, ml_ptr, base, num_splits + 1, tl.where(m == float("-inf"), 0.0, m), R, SC, D)
        out = out / tl.where(l > 0, l, 1.0)[:, None]
        gg = rr // N
        ri = rr % N
        hh = h * G + gg
        tl.store(o_ptr + b * sob + ri[:, None] * son + hh[:, None] * soh + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=(rr < G * N)[:, None])


@triton.jit
def _merge_rotated(pid, base, num_splits, acc_ptr, ml_ptr, cnt_ptr, o_ptr, sob, son, soh, b, h, pi_ptr,
                   G: tl.constexpr, N, R: tl.constexpr, SC: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                   VP: tl.constexpr, VW: tl.constexpr):
    """`_merge` for `rotate_once`: the packed partials are summed in the rotated domain (by planes) and rotated back
    once here, DC output columns at a time; the exact copies' partial is unrotated."""
    if _last_to_arrive(cnt_ptr, pid, num_splits):
        rr = tl.arange(0, R)
        d = tl.arange(0, D)
        m = _partials_max(ml_ptr, base, num_splits + 1, R, SC)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        l, rot = _partials_sum(acc_ptr, ml_ptr, base, num_splits, m_safe, R, SC, D)  # rotated, by planes
        ex = base + num_splits  # the exact copies' partial
        w = tl.exp2(tl.load(ml_ptr + ex * 2 * R + rr, cache_modifier=".cg") - m_safe)
        l += w * tl.load(ml_ptr + ex * 2 * R + R + rr, cache_modifier=".cg")
        exact = tl.load(acc_ptr + (ex * R + rr[:, None]) * D + d[None, :], cache_modifier=".cg") * w[:, None]
        # staged in this (batch, KV head)'s first two slots, read back as tile rows for the rotation's dots
        tl.store(acc_ptr + (base * R + rr[:, None]) * D + d[None, :], rot)
        tl.store(acc_ptr + ((base + 1) * R + rr[:, None]) * D + d[None, :], exact)
        tl.store(ml_ptr + base * 2 * R + rr, l)
        tl.debug_barrier()
        r = tl.arange(0, BLOCK_M)
        live = r < R
        lr = tl.load(ml_ptr + base * 2 * R + r, mask=live, other=1.0)
        lr = tl.where(lr > 0, lr, 1.0)
        gg = r // N
        hh = h * G + gg
        ri = r % N
        DC: tl.constexpr = D if D <= 128 else 64  # output columns per pass: the rotation's tile stays in registers
        for c0 in tl.static_range(0, D, DC):
            dc = c0 + tl.arange(0, DC)
            out = tl.load(acc_ptr + ((base + 1) * R + r[:, None]) * D + dc[None, :], mask=live[:, None], other=0.0)
            for k in tl.static_range(VP):
                c = tl.arange(0, VW)
                yk = tl.load(acc_ptr + (base * R + r[:, None]) * D + k * (D // VP) + c[None, :],
                             mask=live[:, None] & (c < D // VP)[None, :], other=0.0)
                pik = tl.load(pi_ptr + (VP * c[:, None] + k) * D + dc[None, :], mask=(c < D // VP)[:, None], other=0.0)
                out = tl.dot(yk, pik, out)
            out = out / lr[:, None]
            tl.store(o_ptr + b * sob + ri[:, None] * son + hh[:, None] * soh + dc[None, :],
                     out.to(o_ptr.dtype.element_ty), mask=(r < G * N)[:, None])


# ---------------------------------------------------------------------------------------------------------------
# the launcher

# One warp per program: Triton lays a chained dot's warps along M, so on 16 rows every further warp redoes the same
# work (4 warps issued 4x the instructions of one); on 64 rows (several queries) 4 warps gave a wrong result on the
# H100 (triton 3.6) in one test case.
DEFAULT_WARPS = 1


def rotate_once(head_dim: int) -> bool:
    """Whether the launcher rotates the query and the merge rotates the values back, once per call (head dim 256),
    instead of every program (head dims 64, 128, where that is faster; at 256 the per-program rotations spill
    registers: docs/kernels.md)."""
    return head_dim > 128


MERGE_ROWS = 64  # splits merged per step of the final merge: SC * R tile rows


@C._per_codebook_and_device
def lookup_table(codebook, heads: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """The kernel's centroid table and its head stride (0 when shared): fp16 values side by side, so that one
    load yields several (`Codebook.coordinate_values`: scalar and pair codes alike). At 2, 4 and 8 bits one entry per byte value (int64 / int32 / int16 holding its 8 / bits
    centroids, lowest bits first); else one int32 entry per pair of indices (2 * bits-bit key, low index first)."""
    bits = codebook.bits
    if bits in (2, 4, 8):
        per, key_bits = 8 // bits, 8
    else:
        per, key_bits = 2, 2 * bits
    vals = codebook.to("cpu").coordinate_values(torch.arange(2**key_bits), per)  # (H', keys, per): scalar or pair
    c = vals.to(torch.float16).view(torch.int16).to(torch.int64)  # bit patterns as signed 16-bit values
    halves = [c[..., j] for j in range(per)]
    entry = halves[-1] << (16 * (per - 1))  # the top half keeps its sign: the sum stays in range
    for j, h in enumerate(halves[:-1]):
        entry = entry | ((h & 0xFFFF) << (16 * j))
    dtype = {1: torch.int16, 2: torch.int32, 4: torch.int64}[per]
    table = entry.to(dtype).contiguous().to(device)
    return table, (table.stride(0) if codebook.per_head else 0)


def block_width(dim: int, bits: int) -> int:
    """Columns of one query block of a split-key part (`_part_scores`): a coordinate plane at 2, 4 and 8 bits (dim *
    bits / 8), a pair of planes at the group widths (dim / 4); padded to a power of two >= 16 (tl.dot's K)."""
    cols = dim * bits // 8 if bits in (2, 4, 8) else dim // 4
    return max(16, triton.next_power_of_2(cols))


def split_query_planes(query: torch.Tensor, split, block_m: int, scale_log2: float) -> torch.Tensor:
    """For split keys: each part's query blocks, (B * Hkv, block_m, QC) fp16, row r = g * n + i as in the kernel's
    tile. Part p's columns: its channels of q (`KeySplit.split`) rotated by its Pi_p and scaled for exp2, block by
    block as `_part_scores` reads them (plane k: coordinates P * c + k; pair m: column 2c + j is coordinate
    8c + 2m + j), each block padded with zeros to `block_width`."""
    b, hq, n, d = query.shape
    hkv = split.order.shape[0]
    rows = hq // hkv * n
    q = query.float().reshape(b, hkv, rows, d)
    cols = []
    for qp, (rot, cb) in zip(split.split(q), split.parts):
        dp, w = rot.dim, block_width(rot.dim, cb.bits)
        y = rot.forward(qp) * scale_log2
        if cb.bits in (2, 4, 8):
            p = 8 // cb.bits
            y = y.reshape(b, hkv, rows, dp // p, p).transpose(-1, -2)
        else:
            y = y.reshape(b, hkv, rows, dp // 8, 4, 2).transpose(-3, -2).reshape(b, hkv, rows, 4, dp // 4)
        cols.append(torch.nn.functional.pad(y, (0, w - y.shape[-1])).reshape(b, hkv, rows, -1))
    qs = torch.nn.functional.pad(torch.cat(cols, dim=-1), (0, 0, 0, block_m - rows))
    return qs.to(torch.float16).reshape(b * hkv, block_m, -1).contiguous()


def query_planes(query: torch.Tensor, pi: torch.Tensor, bits: int, block_m: int, scale_log2: float) -> torch.Tensor:
    """For whole keys: the query (B, Hkv, G * n, D), row g * n + i as in the kernel's tile, rotated (q' = Pi q),
    scaled for exp2 and laid out by coordinate planes: (B * Hkv, block_m, P * W) fp16, plane k (`planes`) holding
    coordinates P * c + k in columns k * W + c, zero-padded to W = max(16, D / P) and to block_m rows. Made once per
    call, so that no program rotates the query (or reads Pi) itself (head dim 256: `rotate_once`)."""
    b, hkv, rows, d = query.shape
    p = planes(bits)
    w = max(16, d // p)
    y = (query.float() @ pi.T) * scale_log2
    y = y.reshape(b, hkv, rows, d // p, p).transpose(-1, -2)
    y = torch.nn.functional.pad(y, (0, w - d // p, 0, 0, 0, block_m - rows))
    return y.to(torch.float16).reshape(b * hkv, block_m, p * w).contiguous()


def _split_args(query, kv, block_m: int, scale_log2: float, pi: torch.Tensor) -> tuple[tuple, dict]:
    """The kernel's key arguments: the query blocks (split keys: `split_query_planes`; whole keys under
    `rotate_once`: `query_planes`; else a placeholder), then the split parts' pointers, strides and constexprs
    (placeholders when the keys are whole)."""
    split = kv.key_split
    none = {f"K{p}{k}": 0 for p in (1, 2) for k in ("BITS", "D", "PT", "W")}
    none.update(Q1OFF=0, Q2OFF=0, T1_SH=0, T2_SH=0)
    if split is None:
        b, hq, n, d = query.shape
        if not rotate_once(d):
            return (query,) + (query, 0, 0, query, 0, 0, query) * 2, dict(NPARTS=0, QC=16, K0D=0, K0W=0, **none)
        hkv = kv.k_packed.shape[1]
        qs = query_planes(query.reshape(b, hkv, hq // hkv * n, d), pi, kv.k_codebook.bits, block_m, scale_log2)
        return (qs,) + (query, 0, 0, query, 0, 0, query) * 2, dict(NPARTS=0, QC=qs.shape[-1], K0D=0, K0W=0, **none)
    sizes, bits = split.sizes, split.bits
    if not split_supports(sizes, bits):
        raise ValueError(f"decode_attention does not support keys split in parts of {sizes} channels at {bits} bits")
    qs = split_query_planes(query, split, block_m, scale_log2)
    hkv = kv.k_packed.shape[1]
    widths = [block_width(n, w) for n, w in zip(sizes, bits)]
    blocks = [8 // w if w in (2, 4, 8) else 4 for w in bits]
    const = dict(NPARTS=len(sizes), QC=qs.shape[-1], K0D=sizes[0], K0W=widths[0], **none)
    args = [qs]
    for p in (1, 2):
        if p < len(sizes):
            packed, norms = kv.key_parts[p]
            packed = _packed(packed)
            norms = _tokens_last(norms.unsqueeze(-1), 1).squeeze(-1)
            table, sh = lookup_table(split.parts[p][1], hkv, query.device)
            args += [packed, packed.stride(0), packed.stride(1), norms, norms.stride(0), norms.stride(1), table]
            const.update({f"K{p}BITS": bits[p], f"K{p}D": sizes[p], f"K{p}PT": packed.shape[-1], f"K{p}W": widths[p],
                          f"Q{p}OFF": sum(w * k for w, k in zip(widths[:p], blocks[:p])), f"T{p}_SH": sh})
        else:
            args += [query, 0, 0, query, 0, 0, query]
    return tuple(args), const


def _split_plan(batch_heads: int, lq: int, device, num_splits, block_n: int, per_sm: int) -> tuple[int, int]:
    if num_splits is None:
        num_splits = num_splits_for(batch_heads, lq, device, per_sm)
    num_splits = max(1, int(num_splits))
    tok_per_split = max(block_n, -(-max(lq, 1) // num_splits))
    tok_per_split = -(-tok_per_split // block_n) * block_n
    return num_splits, tok_per_split


def _rows(group: int, n: int, d: int = 128) -> tuple[int, int, int]:
    """(BLOCK_M, R, SC): tile rows (>= 16 for tl.dot), stored rows (a power of 2 >= group * n), merge chunk (MERGE_ROWS
    rows of head dim 128, fewer at wider heads: the chunk is held in registers)."""
    rows = A.stored_rows(group, n)
    return max(16, rows), rows, max(1, MERGE_ROWS * 128 // max(d, 128) // rows)


_tokens_last, _packed = A.tokens_last, A.packed_rows


def by_query_chunks(query: torch.Tensor, kv: PackedKV, mask: torch.Tensor | None, scale: float | None, per: int,
                    out: torch.Tensor | None = None, **kw) -> torch.Tensor:
    """`decode_attention` of `per` queries at a time (see `decode_args.by_query_chunks`)."""
    return A.by_query_chunks(decode_attention, query, kv, mask, scale, per, out, **kw)


def decode_attention(
    query: torch.Tensor,
    kv: PackedKV,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    *,
    num_splits: int | None = None,
    block_n: int = BLOCK_N,
    num_warps: int | None = None,
    prefetch: int | None = None,
    num_stages: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of query (B, Hq, n, D) over every position of `kv` (see `PackedKV`) by the Triton kernel; the n
    queries are the last n positions.

    mask: None (causal), or boolean (True = attend) / additive, broadcastable to (B, Hq, n, T), T being `length`
    (dynamic) or the capacity (static); a longer last dim is cut to T. A static layer's lengths are read on the
    device and the grid depends on shapes only, so one launch serves every step of a CUDA graph. Returns
    (B, n, Hq, D) in the query's dtype, as transformers' attention functions do, written into `out` when given.
    This launcher is the Triton kernel alone (the oracle of the CUDA one, `cuda.decode_attention`); which of them
    serves a step is `select`'s answer. The keyword arguments but `out` are tuning knobs for studies.
    """
    b, hq, n, d = query.shape
    group = A.check_heads(query, kv)
    hkv = kv.k_packed.shape[1]
    kcb, vcb = kv.k_codebook, kv.v_codebook
    if not supports(d, kcb.bits, vcb.bits, n, group):
        raise ValueError(f"decode_attention does not support head dim {d}, bits k{kcb.bits}v{vcb.bits}, {group}x{n} rows")
    ln = A.lengths(kv)
    lq, lr, window, lens = ln.lq, ln.lr, ln.window, ln.lens
    block_m, rows, sc = _rows(group, n, d)
    stages, per_sm, plan_prefetch = decode_plan(d, kcb.bits, vcb.bits, kv.key_split is not None, b * hkv * ln.split_len)
    kp, vp = _packed(kv.k_packed), _packed(kv.v_packed)
    num_splits, tok_per_split = _split_plan(b * hkv, ln.split_len, query.device, num_splits, block_n, per_sm)
    slots = b * hkv * (num_splits + 1)
    need = slots * rows * (d + 2)
    scratch, counters = A.scratch_for(kv, query.device, need, b * hkv)
    acc, ml = scratch[: slots * rows * d], scratch[slots * rows * d : need]
    mask_kind, m_arg, ms = A.mask_args(mask, b, hq, n, ln.t, query)
    qv = query if query.stride(-1) == 1 else query.contiguous()
    kn = _tokens_last(kv.k_norms.unsqueeze(-1), 1).squeeze(-1)
    vn = _tokens_last(kv.v_norms.unsqueeze(-1), 1).squeeze(-1)
    rk, rv = _tokens_last(kv.window_k, d), _tokens_last(kv.window_v, d)
    sk, sv = _tokens_last(kv.sink_k, d), _tokens_last(kv.sink_v, d)
    pi = A.rotation_on(kv, query.device)
    out = A.output(query, out)
    scale_log2 = (d**-0.5 if scale is None else float(scale)) * LOG2E
    (kt, kt_sh), (vt, vt_sh) = lookup_table(kcb, hkv, query.device), lookup_table(vcb, hkv, query.device)
    kplanes, vplanes = planes(kcb.bits), planes(vcb.bits)
    split_args, split_const = _split_args(query, kv, block_m, scale_log2, pi)
    len_ptr, from_ptr = lens if lens is not None else (counters, counters)  # unread unless STATIC
    _decode_kernel[(b * hkv, num_splits + 1)](
        qv, *qv.stride()[:3],
        pi,
        kp, kp.stride(0), kp.stride(1), kn, kn.stride(0), kn.stride(1),
        vp, vp.stride(0), vp.stride(1), vn, vn.stride(0), vn.stride(1),
        kt, vt,
        rk, rk.stride(0), rk.stride(1), rv, rv.stride(0), rv.stride(1),
        sk, sk.stride(0), sk.stride(1), sv, sv.stride(0), sv.stride(1),
        m_arg, *ms,
        out, *out.stride()[:3],
        acc, ml, counters,
        hkv, lq, lr, n, kv.sinks, tok_per_split, num_splits, scale_log2,
        len_ptr, from_ptr, window,
        *split_args,
        G=group, D=d, KBITS=kcb.bits, VBITS=vcb.bits, KPT=kp.shape[-1], VPT=vp.shape[-1],
        KT_SH=kt_sh, VT_SH=vt_sh, KP=kplanes, VP=vplanes, KW=max(16, d // kplanes), VW=max(16, d // vplanes),
        BLOCK_M=block_m, R=rows, SC=sc, BLOCK_N=block_n, MASK_KIND=mask_kind,
        PREFETCH=plan_prefetch if prefetch is None else prefetch,
        STATIC=kv.static, ROTATE_ONCE=rotate_once(d), FP_BLOCK_N=16 if d > 128 else block_n, **split_const,
        num_warps=num_warps or DEFAULT_WARPS, num_stages=stages if num_stages is None else num_stages,
    )
    return out
