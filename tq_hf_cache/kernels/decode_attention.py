"""Fused decode attention on TurboQuant-packed keys and values (few queries: decode and small chunks).

Math. A packed key is k = ||k|| Pi^T c[idx_k], so q.k = ||k|| (Pi q).c[idx_k]: the query is rotated once
(q' = Pi q) and scored against centroids, never materializing the key. Values are accumulated in the rotated
domain, sum_j p_j ||v_j|| c[idx_vj], and rotated back once (y @ Pi = Pi^T y) after the split-K reduction.
The full-precision residual window and the pending new tokens are an unrotated segment with its own
accumulator; both share one online-softmax state, so the result is exactly softmax over
[packed | residual | new].

Layout. Grid (B * Hkv, S + 1). Programs 0..S-1 of a (batch, KV head) each take a contiguous slice of the packed
history; program S takes the residual window and the new tokens. All query heads of one KV head (GQA) and all n
queries are the M rows of one tile (row r = g * n + i for query head Hkv_idx * G + g and query i), so each packed
byte is read once per KV head. Partial (m, l, acc) go to a cached fp32 scratch; `_reduce_kernel` merges them,
rotates the packed part back and writes (B, n, Hq, D) in the model dtype.

Causality: the n queries end at the last key; without a mask, query i sees everything but the new tokens j > i.
With a mask (boolean True = attend, or additive), only the mask decides, as in `reference.attention`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import decode_supports as supports
from . import num_splits_for
from . import _common as C

LOG2E = 1.4426950408889634
BLOCK_N = 64


@triton.jit
def _load_packed(base, offs_t, t_ok, BITS: tl.constexpr, D: tl.constexpr, STRIDE_T: tl.constexpr):
    """The raw packed bytes of len(offs_t) vectors (row stride STRIDE_T bytes): one int32 element per byte for 2, 4
    and 8 bits, else one int64 per group of 8 indices (`_common.load_groups`; rows are whole words: the launchers
    check the base's alignment)."""
    if BITS == 2 or BITS == 4 or BITS == 8:
        cols = tl.arange(0, (D * BITS) // 8)
        v = tl.load(base + offs_t[:, None] * STRIDE_T + cols[None, :], mask=t_ok[:, None], other=0).to(tl.int32)
    else:
        v = C.load_groups(base + offs_t * STRIDE_T, t_ok, BITS, D, True)
    return v


@triton.jit
def _expand(v, BITS: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
    """Indices (BLOCK, D) int32 from `_load_packed`'s raw tile (LSB-first bitstream, see packing.py)."""
    if BITS == 8:
        idx = v
    elif BITS == 4:
        idx = tl.reshape(tl.join(v & 15, v >> 4), (BLOCK, D))
    elif BITS == 2:
        lo = tl.join(v & 3, (v >> 4) & 3)
        hi = tl.join((v >> 2) & 3, (v >> 6) & 3)
        idx = tl.reshape(tl.join(lo, hi), (BLOCK, D))
    else:
        idx = C.expand_groups(v, BITS, D, BLOCK)
    return idx


@triton.jit
def _lookup(cb, idx, LUT: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr):
    """Centroid values (BLOCK, D) fp16 of indices idx: LUT 0 gathers from global memory (L1), 1 from a register
    table (tl.gather), 2 through a select tree (<= 4 bits)."""
    if LUT == 0:
        out = tl.load(cb + idx)
    elif LUT == 1:
        table = tl.broadcast_to(tl.load(cb + tl.arange(0, 1 << BITS))[None, :], (BLOCK, 1 << BITS))
        out = tl.gather(table, idx, 1)
    else:
        c0 = tl.load(cb)
        c1 = tl.load(cb + 1)
        lvl = tl.where((idx & 1) != 0, c1, c0)
        if BITS >= 2:
            c2 = tl.load(cb + 2)
            c3 = tl.load(cb + 3)
            b0 = (idx & 1) != 0
            b1 = (idx & 2) != 0
            lvl = tl.where(b1, tl.where(b0, c3, c2), lvl)
            if BITS >= 3:
                c4 = tl.load(cb + 4)
                c5 = tl.load(cb + 5)
                c6 = tl.load(cb + 6)
                c7 = tl.load(cb + 7)
                b2 = (idx & 4) != 0
                hi = tl.where(b1, tl.where(b0, c7, c6), tl.where(b0, c5, c4))
                lvl = tl.where(b2, hi, lvl)
                if BITS >= 4:
                    c8 = tl.load(cb + 8)
                    c9 = tl.load(cb + 9)
                    c10 = tl.load(cb + 10)
                    c11 = tl.load(cb + 11)
                    c12 = tl.load(cb + 12)
                    c13 = tl.load(cb + 13)
                    c14 = tl.load(cb + 14)
                    c15 = tl.load(cb + 15)
                    b3 = (idx & 8) != 0
                    lo8 = tl.where(b1, tl.where(b0, c11, c10), tl.where(b0, c9, c8))
                    hi8 = tl.where(b1, tl.where(b0, c15, c14), tl.where(b0, c13, c12))
                    lvl = tl.where(b3, tl.where(b2, hi8, lo8), lvl)
        out = lvl
    return out.to(tl.float16)


@triton.jit
def _masked_scores(s, pos, t_ok, row_ok, row_i, heads, m_base, smh, smi, smt, causal_limit, MASK_KIND: tl.constexpr):
    """Scores (base 2) with -inf where a key is out of range or masked out."""
    ok = t_ok[None, :] & row_ok[:, None]
    if MASK_KIND == 0:
        ok = ok & (pos[None, :] <= causal_limit[:, None])
    elif MASK_KIND == 1:
        mv = tl.load(m_base + heads[:, None] * smh + row_i[:, None] * smi + pos[None, :] * smt, mask=ok, other=0)
        ok = ok & (mv != 0)
    else:
        mv = tl.load(m_base + heads[:, None] * smh + row_i[:, None] * smi + pos[None, :] * smt, mask=ok, other=0.0)
        s = s + mv.to(tl.float32) * 1.4426950408889634
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
                row_ok, row_i, heads, m_base, smh, smi, smt, causal_limit, ring,
                D: tl.constexpr, BLOCK_N: tl.constexpr, MASK_KIND: tl.constexpr, WRAP: tl.constexpr):
    """Attend to `length` full-precision (unrotated) tokens at absolute positions pos0 + j, stored at slot j, or at
    slot (pos0 + j) % ring with WRAP (a static layer's ring buffer)."""
    d = tl.arange(0, D)
    for t0 in range(0, length, BLOCK_N):
        offs = t0 + tl.arange(0, BLOCK_N)
        t_ok = offs < length
        if WRAP:
            slot = (pos0 + offs) % ring
        else:
            slot = offs
        k = tl.load(k_base + slot[:, None] * sk + d[None, :], mask=t_ok[:, None], other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * scale_log2
        s = _masked_scores(s, pos0 + offs, t_ok, row_ok, row_i, heads, m_base, smh, smi, smt, causal_limit, MASK_KIND)
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i)
        v = tl.load(v_base + slot[:, None] * sv + d[None, :], mask=t_ok[:, None], other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v)
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["Lq", "Lr", "N", "P0", "Ls", "tok_per_split", "num_splits", "ring"])
def _decode_kernel(
    q_ptr, sqb, sqh, sqn,
    pi_ptr,
    kp_ptr, skpb, skph, kn_ptr, sknb, sknh,
    vp_ptr, svpb, svph, vn_ptr, svnb, svnh,
    kc_ptr, vc_ptr,
    rk_ptr, srkb, srkh, rv_ptr, srvb, srvh,
    sk_ptr, sskb, sskh, sv_ptr, ssvb, ssvh,
    nk_ptr, snkb, snkh, snkt,
    nv_ptr, snvb, snvh, snvt,
    m_ptr, smb, smh, smi, smt,
    o_ptr, sob, son, soh,
    acc_ptr, ml_ptr, cnt_ptr,
    Hkv, Lq, Lr, N, P0, Ls, tok_per_split, num_splits, scale_log2,
    len_ptr, from_ptr, ring,
    G: tl.constexpr, D: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,
    KPT: tl.constexpr, VPT: tl.constexpr, KC_SH: tl.constexpr, VC_SH: tl.constexpr,
    BLOCK_M: tl.constexpr, R: tl.constexpr, SC: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_KIND: tl.constexpr, KLUT: tl.constexpr, VLUT: tl.constexpr, PREFETCH: tl.constexpr,
    STATIC: tl.constexpr,
):
    """One launch: programs (pid, split) write partial (m, l, acc) for their slice, all in the unrotated domain
    (the packed splits rotate their accumulator back themselves); the last program of a (batch, KV head) to
    finish, found with an acq_rel counter, merges the S + 1 partials and writes the output, then re-zeroes the
    counter. Packed buffers are (B, H, capacity, bytes) with live tokens from P0 on (token strides KPT / VPT
    bytes, norms 1 element); the residual and sink buffers' token stride is D. The first Ls packed tokens are
    skipped: their exact copies (the attention sinks) are attended to with the residual window instead."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid // Hkv).to(tl.int64)
    h = (pid % Hkv).to(tl.int64)
    r = tl.arange(0, BLOCK_M)
    g = r // N
    row_i = r % N
    row_ok = r < G * N
    heads = h * G + g
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * sqb + heads[:, None] * sqh + row_i[:, None] * sqn + d[None, :],
                mask=row_ok[:, None], other=0.0).to(tl.float32)
    m_base = m_ptr + b * smb
    if STATIC:  # a static layer: lengths on the device; the ring holds [Lq, T) and the new tokens are in it
        T = tl.load(len_ptr).to(tl.int32)
        Lq = tl.load(from_ptr).to(tl.int32)
        Lr = T - Lq
        Ls = tl.minimum(Ls, Lq)
        n_new = 0
    else:
        T = Lq + Lr + N
        n_new = N
    causal_limit = T - N + row_i  # the last position query i may see (used without a mask)
    acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if split < num_splits:
        # packed history, rotated domain: q' = Pi q (rows: q @ Pi^T), pre-scaled for exp2
        pit = tl.load(pi_ptr + d[None, :] * D + d[:, None])  # pit[i, j] = Pi[j, i]
        qr = (tl.dot(q, pit) * scale_log2).to(tl.float16)
        start = split * tok_per_split
        end = tl.minimum(start + tok_per_split, Lq)
        kp = kp_ptr + b * skpb + h * skph + P0.to(tl.int64) * KPT
        vp = vp_ptr + b * svpb + h * svph + P0.to(tl.int64) * VPT
        kn = kn_ptr + b * sknb + h * sknh + P0
        vn = vn_ptr + b * svnb + h * svnh + P0
        kc = kc_ptr + h * KC_SH
        vc = vc_ptr + h * VC_SH
        if PREFETCH == 2:  # software pipelining by hand: the next tile's bytes load during this tile's math
            offs = start + tl.arange(0, BLOCK_N)
            t_ok = offs < end
            kraw = _load_packed(kp, offs, t_ok, KBITS, D, KPT)
            vraw = _load_packed(vp, offs, t_ok, VBITS, D, VPT)
            knorm = tl.load(kn + offs, mask=t_ok, other=0.0).to(tl.float32)
            vnorm = tl.load(vn + offs, mask=t_ok, other=0.0).to(tl.float32)
        for t0 in range(start, end, BLOCK_N):
            offs = t0 + tl.arange(0, BLOCK_N)
            t_ok = (offs < end) & (offs >= Ls)
            if PREFETCH == 2:
                k_cur, v_cur, kn_cur, vn_cur = kraw, vraw, knorm, vnorm
                offs2 = offs + BLOCK_N
                t_ok2 = offs2 < end
                kraw = _load_packed(kp, offs2, t_ok2, KBITS, D, KPT)
                vraw = _load_packed(vp, offs2, t_ok2, VBITS, D, VPT)
                knorm = tl.load(kn + offs2, mask=t_ok2, other=0.0).to(tl.float32)
                vnorm = tl.load(vn + offs2, mask=t_ok2, other=0.0).to(tl.float32)
            elif PREFETCH == 1:  # both tiles' loads issued together, before any math
                k_cur = _load_packed(kp, offs, t_ok, KBITS, D, KPT)
                v_cur = _load_packed(vp, offs, t_ok, VBITS, D, VPT)
                kn_cur = tl.load(kn + offs, mask=t_ok, other=0.0).to(tl.float32)
                vn_cur = tl.load(vn + offs, mask=t_ok, other=0.0).to(tl.float32)
            else:
                k_cur = _load_packed(kp, offs, t_ok, KBITS, D, KPT)
                kn_cur = tl.load(kn + offs, mask=t_ok, other=0.0).to(tl.float32)
            kidx = _expand(k_cur, KBITS, D, BLOCK_N)
            kcent = _lookup(kc, kidx, KLUT, KBITS, BLOCK_N)
            s = tl.dot(qr, tl.trans(kcent)) * kn_cur[None, :]
            s = _masked_scores(s, offs, t_ok, row_ok, row_i, heads, m_base, smh, smi, smt, causal_limit, MASK_KIND)
            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i)
            if PREFETCH == 0:
                v_cur = _load_packed(vp, offs, t_ok, VBITS, D, VPT)
                vn_cur = tl.load(vn + offs, mask=t_ok, other=0.0).to(tl.float32)
            vidx = _expand(v_cur, VBITS, D, BLOCK_N)
            vcent = _lookup(vc, vidx, VLUT, VBITS, BLOCK_N)
            acc = acc * alpha[:, None] + tl.dot((p * vn_cur[None, :]).to(tl.float16), vcent)
        # back from the rotated domain here, so that every partial is unrotated: y @ Pi = Pi^T y
        pi = tl.load(pi_ptr + d[:, None] * D + d[None, :])
        acc = tl.dot(acc, pi)
    else:
        # full-precision sinks, residual window, then the pending new tokens, unrotated
        acc, m_i, l_i = _fp_segment(q, acc, m_i, l_i, sk_ptr + b * sskb + h * sskh, sv_ptr + b * ssvb + h * ssvh,
                                    D, D, Ls, 0, scale_log2, row_ok, row_i, heads, m_base, smh, smi, smt,
                                    causal_limit, ring, D, BLOCK_N, MASK_KIND, False)
        acc, m_i, l_i = _fp_segment(q, acc, m_i, l_i, rk_ptr + b * srkb + h * srkh, rv_ptr + b * srvb + h * srvh,
                                    D, D, Lr, Lq, scale_log2, row_ok, row_i, heads, m_base, smh, smi, smt,
                                    causal_limit, ring, D, BLOCK_N, MASK_KIND, STATIC)
        acc, m_i, l_i = _fp_segment(q, acc, m_i, l_i, nk_ptr + b * snkb + h * snkh, nv_ptr + b * snvb + h * snvh,
                                    snkt, snvt, n_new, Lq + Lr, scale_log2, row_ok, row_i, heads, m_base, smh, smi,
                                    smt, causal_limit, ring, D, BLOCK_N, MASK_KIND, False)
    # partials: only the R (>= G * N) live rows of the tile
    base = pid.to(tl.int64) * (num_splits + 1)
    slot = base + split
    keep = r < R
    tl.store(acc_ptr + (slot * R + r[:, None]) * D + d[None, :], acc, mask=keep[:, None])
    tl.store(ml_ptr + slot * 2 * R + r, m_i, mask=keep)
    tl.store(ml_ptr + slot * 2 * R + R + r, l_i, mask=keep)
    # the last program of this (batch, KV head) to get here merges: the barrier orders every thread's stores
    # before the release of the counter; the acquire orders the merge's (L2, .cg) loads after all of them
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel", scope="gpu")
    if arrived == num_splits:
        tl.atomic_xchg(cnt_ptr + pid, 0, sem="relaxed", scope="gpu")  # ready for the next launch
        rr = tl.arange(0, R)
        sc = tl.arange(0, SC)
        m = tl.full((R,), float("-inf"), dtype=tl.float32)
        for s0 in range(0, num_splits + 1, SC):
            sl = s0 + sc
            ok = sl < num_splits + 1
            mv = tl.load(ml_ptr + (base + sl)[:, None] * 2 * R + rr[None, :], mask=ok[:, None],
                         other=float("-inf"), cache_modifier=".cg")
            m = tl.maximum(m, tl.max(mv, 0))
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        l = tl.zeros((R,), dtype=tl.float32)
        out = tl.zeros((R, D), dtype=tl.float32)
        for s0 in range(0, num_splits + 1, SC):
            sl = s0 + sc
            ok = sl < num_splits + 1
            mv = tl.load(ml_ptr + (base + sl)[:, None] * 2 * R + rr[None, :], mask=ok[:, None],
                         other=float("-inf"), cache_modifier=".cg")
            lv = tl.load(ml_ptr + (base + sl)[:, None] * 2 * R + R + rr[None, :], mask=ok[:, None],
                         other=0.0, cache_modifier=".cg")
            w = tl.exp2(mv - m_safe[None, :])  # (SC, R); 0 for empty or missing splits
            l += tl.sum(w * lv, 0)
            av = tl.load(acc_ptr + ((base + sl)[:, None, None] * R + rr[None, :, None]) * D + d[None, None, :],
                         mask=ok[:, None, None], other=0.0, cache_modifier=".cg")
            out += tl.sum(w[:, :, None] * av, 0)
        out = out / tl.where(l > 0, l, 1.0)[:, None]
        gg = rr // N
        ri = rr % N
        hh = h * G + gg
        tl.store(o_ptr + b * sob + ri[:, None] * son + hh[:, None] * soh + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=(rr < G * N)[:, None])


# ---------------------------------------------------------------------------------------------------------------
# launchers: `decode_attention` (any state dict, every check) and `decode_attention_layer` (a TurboQuantLayer's
# decode step, with its launch arguments cached per layer)

_SCRATCH: dict[torch.device, torch.Tensor] = {}
_COUNTERS: dict[torch.device, torch.Tensor] = {}
DEFAULT_LUT = 1
DEFAULT_PREFETCH = 2  # measured on the H100 (diag_decode_kernel_h100_run3.json): 3-6% faster than 0, no spills
DEFAULT_WARPS = 4
DEFAULT_STAGES = None  # None: triton's default
MERGE_ROWS = 64  # splits merged per step of the final merge: SC * R tile rows


def _scratch(device: torch.device, numel: int) -> torch.Tensor:
    """One fp32 split-K scratch per device, grown (never shrunk) on demand."""
    buf = _SCRATCH.get(device)
    if buf is None or buf.numel() < numel:
        _SCRATCH.pop(device, None)
        buf = torch.empty(max(numel, 1 << 16) + numel // 4, dtype=torch.float32, device=device)
        _SCRATCH[device] = buf
    return buf


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """Arrival counters, one int32 per (batch, KV head); zero between launches (the merging program resets its own)."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def _lut(lut: int | None, bits: int) -> int:
    lut = DEFAULT_LUT if lut is None else lut
    return 0 if (lut == 2 and bits > 4) else lut


def _split_plan(batch_heads: int, lq: int, device, num_splits, block_n: int) -> tuple[int, int]:
    if num_splits is None:
        num_splits = num_splits_for(batch_heads, lq, device)
    num_splits = max(1, int(num_splits))
    tok_per_split = max(block_n, -(-max(lq, 1) // num_splits))
    tok_per_split = -(-tok_per_split // block_n) * block_n
    return num_splits, tok_per_split


def _rows(group: int, n: int) -> tuple[int, int, int]:
    """(BLOCK_M, R, SC): tile rows (>= 16 for tl.dot), stored rows (a power of 2 >= group * n), merge chunk."""
    rows = triton.next_power_of_2(group * n)
    return max(16, rows), rows, max(1, MERGE_ROWS // rows)


def _tokens_last(t: torch.Tensor, stride_t: int) -> torch.Tensor:
    """t with unit last-dim stride and token stride stride_t (dim 2), copying only if it has another layout."""
    if t.stride(-1) == 1 and (t.shape[2] <= 1 or t.stride(2) == stride_t):
        return t
    return t.contiguous()


def _packed(t: torch.Tensor) -> torch.Tensor:
    t = _tokens_last(t, t.shape[-1])
    return t if C.rows_aligned(t) else t.clone(memory_format=torch.contiguous_format)


def _row(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _mask_args(mask, b, hq, n, t, query):
    if mask is None:
        return 0, query, (0, 0, 0, 0)
    if mask.dim() != 4:
        raise ValueError(f"mask must be 4-D (B, 1 or Hq, n, T), got shape {tuple(mask.shape)}")
    mk = mask[..., :t]  # transformers 4.x may hand a mask longer than the keys
    mk = mk.expand(b, hq, n, t)
    if mk.dtype == torch.bool:
        kind, m_arg = 1, mk.view(torch.uint8)
    else:
        kind, m_arg = 2, mk
    return kind, m_arg, m_arg.stride()


def _runtime_args(q, qs, pi, kp, kn, vp, vn, kc, vc, rk, rv, sk, sv, nk, nks, nv, nvs, m_arg, ms, out, os_, acc, ml, cnt,
                  hkv, lq, lr, n, p0, ls, tok_per_split, num_splits, scale_log2, lens=None, ring=0) -> list:
    """_decode_kernel's runtime arguments in order (the general launcher and the per-layer plan both build them here;
    qs / nks / nvs / ms / os_ are the strides the kernel takes of q, new K, new V, the mask and out)."""
    return [
        q, *qs,
        pi,
        kp, kp.stride(0), kp.stride(1), kn, kn.stride(0), kn.stride(1),
        vp, vp.stride(0), vp.stride(1), vn, vn.stride(0), vn.stride(1),
        kc, vc,
        rk, rk.stride(0), rk.stride(1), rv, rv.stride(0), rv.stride(1),
        sk, sk.stride(0), sk.stride(1), sv, sv.stride(0), sv.stride(1),
        nk, *nks,
        nv, *nvs,
        m_arg, *ms,
        out, *os_,
        acc, ml, cnt,
        hkv, lq, lr, n, p0, ls, tok_per_split, num_splits, scale_log2,
        *((cnt, cnt) if lens is None else lens), ring,
    ]


def _constexprs(group, d, kcb, vcb, kp, vp, kc, vc, block_m, rows, sc, block_n, mask_kind, klut, vlut, prefetch,
                static=False):
    return dict(
        G=group, D=d, KBITS=kcb.bits, VBITS=vcb.bits, KPT=kp.shape[-1], VPT=vp.shape[-1],
        KC_SH=kc.shape[-1] if kc.dim() == 2 else 0, VC_SH=vc.shape[-1] if vc.dim() == 2 else 0,
        BLOCK_M=block_m, R=rows, SC=sc, BLOCK_N=block_n, MASK_KIND=mask_kind,
        KLUT=klut, VLUT=vlut, PREFETCH=prefetch, STATIC=static,
    )


def decode_attention(
    query: torch.Tensor,
    state: dict,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    block_n: int = BLOCK_N,
    num_warps: int | None = None,
    lut: int | None = None,
    prefetch: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Attention of query (B, Hq, n, D) over [packed | residual | new] of `state` (`TurboQuantLayer.attention_state()`).

    mask: None (causal: the queries end at the last key), boolean (True = attend) or additive, broadcastable to
    (B, Hq, n, T) (a longer last dim is cut to T). Returns (B, n, Hq, D) in the query's dtype, as transformers'
    attention functions do.
    """
    b, hq, n, d = query.shape
    kp, kn, vp, vn = state["k_packed"], state["k_norms"], state["v_packed"], state["v_norms"]
    rk, rv, nk, nv = state["res_k"], state["res_v"], state["new_k"], state["new_v"]
    sk, sv = state.get("sink_k"), state.get("sink_v")
    if sk is None:
        sk, sv = rk[:, :, :0], rv[:, :, :0]
    rot, kcb, vcb = state["rotation"], state["k_codebook"], state["v_codebook"]
    hkv, lq, lr = kp.shape[1], kp.shape[2], rk.shape[2]
    if nk.shape[2] != n:
        raise ValueError(f"the state holds {nk.shape[2]} new tokens for {n} queries")
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    group = hq // hkv
    if not supports(d, kcb.bits, vcb.bits, n, group):
        raise ValueError(f"decode_attention does not support head dim {d}, bits k{kcb.bits}v{vcb.bits}, {group}x{n} rows")
    t = lq + lr + n
    scale = d**-0.5 if scale is None else float(scale)
    block_m, rows, sc = _rows(group, n)
    num_splits, tok_per_split = _split_plan(b * hkv, lq, query.device, num_splits, block_n)
    mask_kind, m_arg, ms = _mask_args(mask, b, hq, n, t, query)
    qv = _row(query)
    kp, vp = _packed(kp), _packed(vp)
    kn, vn = _tokens_last(kn.unsqueeze(-1), 1).squeeze(-1), _tokens_last(vn.unsqueeze(-1), 1).squeeze(-1)
    rk, rv = _tokens_last(rk, d), _tokens_last(rv, d)
    ls = sk.shape[2]
    if ls > lq:
        raise ValueError(f"the state holds {ls} sink tokens but only {lq} packed ones")
    sk, sv = _tokens_last(sk, d), _tokens_last(sv, d)
    nk, nv = _row(nk), _row(nv)
    pi = rot.matrix
    if pi.device != query.device:
        pi = pi.to(query.device)
    kc = kcb.centroids.contiguous()
    vc = vcb.centroids.contiguous()
    slots = b * hkv * (num_splits + 1)
    scratch = _scratch(query.device, slots * rows * (d + 2))
    acc = scratch[: slots * rows * d]
    ml = scratch[slots * rows * d : slots * rows * (d + 2)]
    cnt = _counters(query.device, b * hkv)
    if out is None:
        out = torch.empty(b, n, hq, d, dtype=query.dtype, device=query.device)
    elif out.shape != (b, n, hq, d) or out.stride(-1) != 1:
        raise ValueError(f"out must be ({b}, {n}, {hq}, {d}) with unit last stride")
    extra = {} if num_stages is None and DEFAULT_STAGES is None else {"num_stages": num_stages or DEFAULT_STAGES}
    _decode_kernel[(b * hkv, num_splits + 1)](
        *_runtime_args(
            qv, qv.stride()[:3], pi, kp, kn, vp, vn, kc, vc, rk, rv, sk, sv, nk, nk.stride()[:3], nv, nv.stride()[:3],
            m_arg, ms, out, out.stride()[:3], acc, ml, cnt, hkv, lq, lr, n, 0, ls, tok_per_split, num_splits,
            scale * LOG2E,
        ),
        **_constexprs(group, d, kcb, vcb, kp, vp, kc, vc, block_m, rows, sc, block_n, mask_kind, _lut(lut, kcb.bits),
                      _lut(lut, vcb.bits), DEFAULT_PREFETCH if prefetch is None else prefetch),
        num_warps=num_warps or DEFAULT_WARPS, **extra,
    )
    return out


def static_decode_attention(
    query: torch.Tensor,
    ring_k: torch.Tensor,
    ring_v: torch.Tensor,
    kv,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of query (B, Hq, n, D) over a static layer's positions (`PackedKV`; the ring is ring_k / ring_v).

    Lengths are read on the device and the grid depends only on shapes, so one launch serves every step (CUDA
    graphs replay it). mask: None (the n queries are the last n positions) or boolean / additive over the
    layer's capacity. Returns (B, n, Hq, D) in the query's dtype."""
    b, hq, n, d = query.shape
    hkv, cap = kv.k_packed.shape[1], kv.k_packed.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    group = hq // hkv
    kcb, vcb = kv.k_codebook, kv.v_codebook
    if not supports(d, kcb.bits, vcb.bits, n, group):
        raise ValueError(f"static_decode_attention does not support head dim {d}, bits k{kcb.bits}v{vcb.bits}, {group}x{n} rows")
    block_m, rows, sc = _rows(group, n)
    num_splits, tok_per_split = _split_plan(b * hkv, cap, query.device, None, BLOCK_N)
    slots = b * hkv * (num_splits + 1)
    need = slots * rows * (d + 2)
    if kv.scratch.numel() < need or kv.counters.numel() < b * hkv:
        raise ValueError(f"the PackedKV's scratch holds {kv.scratch.numel()} floats and {kv.counters.numel()} "
                         f"counters; this call needs {need} and {b * hkv}")
    acc = kv.scratch[: slots * rows * d]
    ml = kv.scratch[slots * rows * d : need]
    mask_kind, m_arg, ms = _mask_args(mask, b, hq, n, cap, query)
    qv = _row(query)
    kp, vp = _packed(kv.k_packed), _packed(kv.v_packed)
    kn, vn = kv.k_norms, kv.v_norms
    rk, rv = _tokens_last(ring_k, d), _tokens_last(ring_v, d)
    sk, sv = _tokens_last(kv.sink_k, d), _tokens_last(kv.sink_v, d)
    kc, vc = kcb.centroids.contiguous(), vcb.centroids.contiguous()
    out = torch.empty(b, n, hq, d, dtype=query.dtype, device=query.device)
    _decode_kernel[(b * hkv, num_splits + 1)](
        *_runtime_args(
            qv, qv.stride()[:3], kv.rotation.matrix, kp, kn, vp, vn, kc, vc, rk, rv, sk, sv, rk, (0, 0, 0), rv,
            (0, 0, 0), m_arg, ms, out, out.stride()[:3], acc, ml, kv.counters, hkv, 0, 0, n, 0, kv.sinks,
            tok_per_split, num_splits, (d**-0.5 if scale is None else float(scale)) * LOG2E,
            lens=(kv.length, kv.exact_from), ring=rk.shape[2],
        ),
        **_constexprs(group, d, kcb, vcb, kp, vp, kc, vc, block_m, rows, sc, BLOCK_N, mask_kind, _lut(None, kcb.bits),
                      _lut(None, vcb.bits), DEFAULT_PREFETCH, static=True),
        num_warps=DEFAULT_WARPS, **({} if DEFAULT_STAGES is None else {"num_stages": DEFAULT_STAGES}),
    )
    return out


# --- the per-layer fast path ------------------------------------------------------------------------------------
# What changes between two decode steps of one layer: the query, the pending new K/V and the output (new tensors
# of the same layout), the packed and residual lengths, and the packed buffers after a growth (every 256 tokens).
# Everything else (strides, codebooks, rotation, scratch, constexprs, the compiled kernel) is cached in a plan on
# the layer. After a plan's first (JIT) launch, later launches call the compiled kernel's launcher directly,
# skipping triton's argument binding and specialization (their results are fixed by the plan's key: the
# per-step pointers' 16-byte alignment is checked every call); that direct call is checked once per process
# against the JIT launch, bit for bit, and abandoned (with a warning) if they differ.

_PARAMS = list(_decode_kernel.arg_names)
_I_Q, _I_NK, _I_NV, _I_OUT, _I_ACC, _I_ML = (_PARAMS.index(x) for x in ("q_ptr", "nk_ptr", "nv_ptr", "o_ptr", "acc_ptr", "ml_ptr"))
_I_LQ, _I_LR, _I_N, _I_P0, _I_LS, _I_TOK, _I_SPLITS = (
    _PARAMS.index(x) for x in ("Lq", "Lr", "N", "P0", "Ls", "tok_per_split", "num_splits")
)
_N_RUNTIME = _PARAMS.index("G")  # arguments before the constexprs
_DIRECT = {"ok": None}  # None: not yet checked; True / False after the check


class _Plan:
    __slots__ = ("kpk", "vpk", "kpn", "vpn", "rk", "rv", "sk", "sv", "qshape", "qstride", "nkstride", "nvstride", "dtype",
                 "scale", "args", "consts", "hkv", "bh", "d", "rows", "lq", "grid", "device", "dev_index",
                 "out_shape", "ck", "launch", "function", "metadata")


def _build_plan(query, layer, nk, nv, scale):
    kb, vb = layer.k_buf, layer.v_buf
    b, hq, n, d = query.shape
    hkv = kb.packed.shape[1]
    group = hq // hkv
    kcb, vcb = layer.k_codebook, layer.v_codebook
    block_m, rows, sc = _rows(group, n)
    p = _Plan()
    p.kpk, p.vpk, p.kpn, p.vpn, p.rk, p.rv = kb.packed, vb.packed, kb.norms, vb.norms, layer._rk, layer._rv
    p.sk, p.sv = layer._sk, layer._sv
    p.qshape, p.qstride, p.nkstride, p.nvstride = query.shape, query.stride(), nk.stride(), nv.stride()
    p.dtype, p.scale = query.dtype, scale
    p.hkv, p.bh, p.d, p.rows, p.lq, p.grid = hkv, b * hkv, d, rows, -1, None
    p.device, p.dev_index = query.device, query.device.index
    p.out_shape = (b, n, hq, d)
    p.ck = p.launch = p.function = p.metadata = None
    pi = layer.rotation.matrix
    kc, vc = kcb.centroids.contiguous(), vcb.centroids.contiguous()
    kpk, kpn, vpk, vpn, rk, rv, sk, sv = p.kpk, p.kpn, p.vpk, p.vpn, p.rk, p.rv, p.sk, p.sv
    sc_ = d**-0.5 if scale is None else float(scale)
    args = _runtime_args(
        None, query.stride()[:3], pi, kpk, kpn, vpk, vpn, kc, vc, rk, rv, sk, sv, None, nk.stride()[:3], None,
        nv.stride()[:3], query, (0, 0, 0, 0), None, (n * hq * d, hq * d, d), None, None, _counters(query.device, b * hkv),
        hkv, None, None, n, None, None, None, None, sc_ * LOG2E,
    )
    assert len(args) == _N_RUNTIME and args[_I_OUT] is None and args[_I_NK] is None and args[_I_NV] is None
    consts = _constexprs(group, d, kcb, vcb, kpk, vpk, kc, vc, block_m, rows, sc, BLOCK_N, 0, _lut(None, kcb.bits),
                         _lut(None, vcb.bits), DEFAULT_PREFETCH)
    p.args, p.consts = args, consts
    return p


def _plan_fits(p, query, layer, nk, nv, scale) -> bool:
    kb, vb = layer.k_buf, layer.v_buf
    return (
        p.kpk is kb.packed and p.vpk is vb.packed and p.kpn is kb.norms and p.vpn is vb.norms
        and p.rk is layer._rk and p.rv is layer._rv and p.sk is layer._sk and p.sv is layer._sv and p.qshape == query.shape and p.qstride == query.stride()
        and p.nkstride == nk.stride() and p.nvstride == nv.stride() and p.dtype is query.dtype and p.scale == scale
    )


def layer_fast_path_ok(layer) -> bool:
    """Whether `decode_attention_layer` can serve this layer (the TurboQuantLayer internals it reads exist and
    its packed buffers hold the layout the kernel assumes)."""
    kb, vb = getattr(layer, "k_buf", None), getattr(layer, "v_buf", None)
    rk = getattr(layer, "_rk", None)
    if kb is None or vb is None or rk is None or getattr(layer, "_pending", None) is None:
        return False
    if kb.start != vb.start or kb.length != vb.length:
        return False
    for t in (kb.packed, vb.packed):
        if t.stride(3) != 1 or t.stride(2) != t.shape[3] or not C.rows_aligned(t):
            return False
    for t in (kb.norms, vb.norms):
        if t.stride(2) != 1:
            return False
    sk = getattr(layer, "_sk", None)
    if sk is None or sk.stride(3) != 1 or sk.stride(2) != sk.shape[3] or layer._sv.stride() != sk.stride():
        return False
    return rk.stride(3) == 1 and rk.stride(2) == rk.shape[3] and layer._rv.stride() == rk.stride()


def decode_attention_layer(query: torch.Tensor, layer, scale: float | None = None) -> torch.Tensor | None:
    """`decode_attention` for a TurboQuantLayer's deferred step without a mask (causal), with its launch cached.

    The caller checks the shapes (`supports`). Returns (B, n, Hq, D), or None where the layer's state does not
    have the layout this path assumes (the caller then uses `decode_attention` on `layer.attention_state()`)."""
    pending = getattr(layer, "_pending", None)
    if pending is None:
        return None
    nk, nv = pending
    p = getattr(layer, "_tq_decode_plan", None)
    if p is None or not _plan_fits(p, query, layer, nk, nv, scale):
        if not layer_fast_path_ok(layer):
            return None
        p = _build_plan(query, layer, nk, nv, scale)
        layer._tq_decode_plan = p
    elif layer.k_buf.start != layer.v_buf.start or layer.k_buf.length != layer.v_buf.length:
        return None
    kb = layer.k_buf
    lq = kb.length
    a = p.args
    if lq != p.lq:  # every FLUSH_BLOCK steps: the split plan and the scratch views
        splits, tok = _split_plan(p.bh, lq, p.device, None, BLOCK_N)
        slots = p.bh * (splits + 1)
        rows, d = p.rows, p.d
        scratch = _scratch(p.device, slots * rows * (d + 2))
        a[_I_ACC] = scratch[: slots * rows * d]
        a[_I_ML] = scratch[slots * rows * d : slots * rows * (d + 2)]
        a[_I_TOK], a[_I_SPLITS], a[_I_LQ] = tok, splits, lq
        p.grid, p.lq = (p.bh, splits + 1), lq
    out = torch.empty(p.out_shape, dtype=query.dtype, device=query.device)
    a = a.copy()
    a[_I_Q], a[_I_NK], a[_I_NV], a[_I_OUT] = query, nk, nv, out
    a[_I_LR], a[_I_P0], a[_I_LS] = layer._rlen, kb.start, layer.exact_sinks
    if (
        p.launch is not None
        and not ((query.data_ptr() | nk.data_ptr() | nv.data_ptr()) & 15)
        and torch._C._cuda_getDevice() == p.dev_index
    ):
        g = p.grid
        p.launch(g[0], g[1], 1, torch._C._cuda_getCurrentRawStream(p.dev_index), p.function, p.metadata,
                 None, None, None, *a, *p.consts.values())
        return out
    ck = _decode_kernel[p.grid](*a, **p.consts, num_warps=DEFAULT_WARPS,
                                **({} if DEFAULT_STAGES is None else {"num_stages": DEFAULT_STAGES}))
    if p.launch is None and query.is_cuda and ck is not None and hasattr(ck, "run"):
        _enable_direct(p, ck, a, out)
    return out


def _enable_direct(p, ck, a, out) -> None:
    """Adopt the compiled kernel's launcher for this plan, once the direct call is known to give the JIT result."""
    try:
        from triton import knobs

        for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
            # None (older triton) or an empty HookChain (newer): no hook; else a profiler hook is installed and
            # triton's own launch keeps feeding it
            if hook is not None and getattr(hook, "calls", True):
                return
    except Exception:
        pass
    if _DIRECT["ok"] is False:
        return
    launch, function, metadata = ck.run, ck.function, ck.packed_metadata
    if _DIRECT["ok"] is None:
        if torch.cuda.is_current_stream_capturing():
            return
        check = torch.full_like(out, float("nan"))
        b = list(a)
        b[_I_OUT] = check
        g = p.grid
        try:
            launch(g[0], g[1], 1, torch._C._cuda_getCurrentRawStream(p.dev_index), function, metadata,
                   None, None, None, *b, *p.consts.values())
            _DIRECT["ok"] = bool(torch.equal(check, out))
        except Exception as e:  # another triton's launcher convention
            _DIRECT["ok"] = False
            _DIRECT["error"] = f"{type(e).__name__}: {e}"
        if not _DIRECT["ok"]:
            import logging

            logging.getLogger(__name__).warning(
                "tq_hf_cache: the direct kernel launch did not reproduce triton's launch; using triton's (slower) path"
            )
            return
    p.ck, p.launch, p.function, p.metadata = ck, launch, function, metadata
