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

from ..attention import FUSED_BITS as SUPPORTED_BITS
from ..attention import FUSED_HEAD_DIMS as SUPPORTED_DIMS
from ..attention import MAX_FUSED_ROWS as MAX_ROWS

LOG2E = 1.4426950408889634
BLOCK_N = 64
MIN_TOKENS_PER_SPLIT = 256


@triton.jit
def _unpack(base, offs_t, t_ok, stride_t, BITS: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
    """Indices (BLOCK, D) int32 of BLOCK packed vectors (LSB-first bitstream, see packing.py)."""
    rows = base + offs_t[:, None] * stride_t
    if BITS == 8:
        cols = tl.arange(0, D)
        idx = tl.load(rows + cols[None, :], mask=t_ok[:, None], other=0).to(tl.int32)
    elif BITS == 4:
        cols = tl.arange(0, D // 2)
        v = tl.load(rows + cols[None, :], mask=t_ok[:, None], other=0).to(tl.int32)
        idx = tl.reshape(tl.join(v & 15, v >> 4), (BLOCK, D))
    elif BITS == 2:
        cols = tl.arange(0, D // 4)
        v = tl.load(rows + cols[None, :], mask=t_ok[:, None], other=0).to(tl.int32)
        lo = tl.join(v & 3, (v >> 4) & 3)
        hi = tl.join((v >> 2) & 3, (v >> 6) & 3)
        idx = tl.reshape(tl.join(lo, hi), (BLOCK, D))
    else:  # 3 bits: 8 indices in every 3 bytes
        grp = tl.arange(0, D // 8) * 3
        b0 = tl.load(rows + grp[None, :], mask=t_ok[:, None], other=0).to(tl.int32)
        b1 = tl.load(rows + grp[None, :] + 1, mask=t_ok[:, None], other=0).to(tl.int32)
        b2 = tl.load(rows + grp[None, :] + 2, mask=t_ok[:, None], other=0).to(tl.int32)
        w = b0 | (b1 << 8) | (b2 << 16)
        e = tl.join(tl.join(w & 7, (w >> 12) & 7), tl.join((w >> 6) & 7, (w >> 18) & 7))
        o = tl.join(tl.join((w >> 3) & 7, (w >> 15) & 7), tl.join((w >> 9) & 7, (w >> 21) & 7))
        idx = tl.reshape(tl.join(e, o), (BLOCK, D))
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
                row_ok, row_i, heads, m_base, smh, smi, smt, causal_limit,
                D: tl.constexpr, BLOCK_N: tl.constexpr, MASK_KIND: tl.constexpr):
    """Attend to `length` full-precision (unrotated) tokens at absolute positions pos0 + j."""
    d = tl.arange(0, D)
    for t0 in range(0, length, BLOCK_N):
        offs = t0 + tl.arange(0, BLOCK_N)
        t_ok = offs < length
        k = tl.load(k_base + offs[:, None] * sk + d[None, :], mask=t_ok[:, None], other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * scale_log2
        s = _masked_scores(s, pos0 + offs, t_ok, row_ok, row_i, heads, m_base, smh, smi, smt, causal_limit, MASK_KIND)
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i)
        v = tl.load(v_base + offs[:, None] * sv + d[None, :], mask=t_ok[:, None], other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v)
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["Lq", "Lr", "N", "tok_per_split", "num_splits"])
def _partial_kernel(
    q_ptr, sqb, sqh, sqn,
    pi_ptr,
    kp_ptr, skpb, skph, skpt,
    kn_ptr, sknb, sknh, sknt,
    vp_ptr, svpb, svph, svpt,
    vn_ptr, svnb, svnh, svnt,
    kc_ptr, kc_sh, vc_ptr, vc_sh,
    rk_ptr, srkb, srkh, srkt,
    rv_ptr, srvb, srvh, srvt,
    nk_ptr, snkb, snkh, snkt,
    nv_ptr, snvb, snvh, snvt,
    m_ptr, smb, smh, smi, smt,
    acc_ptr, ml_ptr,
    Hkv, Lq, Lr, N, tok_per_split, num_splits, scale_log2,
    G: tl.constexpr, D: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK_KIND: tl.constexpr, KLUT: tl.constexpr, VLUT: tl.constexpr,
    DIAG: tl.constexpr = 0,
):
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
    T = Lq + Lr + N
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
        kp = kp_ptr + b * skpb + h * skph
        vp = vp_ptr + b * svpb + h * svph
        kn = kn_ptr + b * sknb + h * sknh
        vn = vn_ptr + b * svnb + h * svnh
        kc = kc_ptr + h * kc_sh
        vc = vc_ptr + h * vc_sh
        for t0 in range(start, end, BLOCK_N):
            offs = t0 + tl.arange(0, BLOCK_N)
            t_ok = offs < end
            kidx = _unpack(kp, offs, t_ok, skpt, KBITS, D, BLOCK_N)
            if DIAG == 1:  # benchmark-only: no centroid gather (wrong values), to time the gather
                kcent = kidx.to(tl.float16)
            else:
                kcent = _lookup(kc, kidx, KLUT, KBITS, BLOCK_N)
            knorm = tl.load(kn + offs * sknt, mask=t_ok, other=0.0).to(tl.float32)
            s = tl.dot(qr, tl.trans(kcent)) * knorm[None, :]
            s = _masked_scores(s, offs, t_ok, row_ok, row_i, heads, m_base, smh, smi, smt, causal_limit, MASK_KIND)
            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i)
            vidx = _unpack(vp, offs, t_ok, svpt, VBITS, D, BLOCK_N)
            if DIAG == 1:
                vcent = vidx.to(tl.float16)
            else:
                vcent = _lookup(vc, vidx, VLUT, VBITS, BLOCK_N)
            vnorm = tl.load(vn + offs * svnt, mask=t_ok, other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot((p * vnorm[None, :]).to(tl.float16), vcent)
    else:
        # full-precision residual window, then the pending new tokens, unrotated
        acc, m_i, l_i = _fp_segment(q, acc, m_i, l_i, rk_ptr + b * srkb + h * srkh, rv_ptr + b * srvb + h * srvh,
                                    srkt, srvt, Lr, Lq, scale_log2, row_ok, row_i, heads, m_base, smh, smi, smt,
                                    causal_limit, D, BLOCK_N, MASK_KIND)
        acc, m_i, l_i = _fp_segment(q, acc, m_i, l_i, nk_ptr + b * snkb + h * snkh, nv_ptr + b * snvb + h * snvh,
                                    snkt, snvt, N, Lq + Lr, scale_log2, row_ok, row_i, heads, m_base, smh, smi, smt,
                                    causal_limit, D, BLOCK_N, MASK_KIND)
    slot = pid.to(tl.int64) * (num_splits + 1) + split
    tl.store(acc_ptr + (slot * BLOCK_M + r[:, None]) * D + d[None, :], acc)
    tl.store(ml_ptr + slot * 2 * BLOCK_M + r, m_i)
    tl.store(ml_ptr + slot * 2 * BLOCK_M + BLOCK_M + r, l_i)


@triton.jit(do_not_specialize=["N", "num_splits"])
def _reduce_kernel(
    acc_ptr, ml_ptr, pi_ptr, o_ptr, sob, son, soh, Hkv, N, num_splits,
    G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    pid = tl.program_id(0)
    b = (pid // Hkv).to(tl.int64)
    h = (pid % Hkv).to(tl.int64)
    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    row_ok = r < G * N
    base = pid.to(tl.int64) * (num_splits + 1)
    m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    for s in range(0, num_splits + 1):
        m = tl.maximum(m, tl.load(ml_ptr + (base + s) * 2 * BLOCK_M + r))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    l = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    for s in range(0, num_splits):
        w = tl.exp2(tl.load(ml_ptr + (base + s) * 2 * BLOCK_M + r) - m_safe)
        l += w * tl.load(ml_ptr + (base + s) * 2 * BLOCK_M + BLOCK_M + r)
        acc += w[:, None] * tl.load(acc_ptr + ((base + s) * BLOCK_M + r[:, None]) * D + d[None, :])
    pi = tl.load(pi_ptr + d[:, None] * D + d[None, :])
    out = tl.dot(acc, pi)  # back from the rotated domain: y @ Pi = Pi^T y
    last = base + num_splits
    w = tl.exp2(tl.load(ml_ptr + last * 2 * BLOCK_M + r) - m_safe)
    l += w * tl.load(ml_ptr + last * 2 * BLOCK_M + BLOCK_M + r)
    out += w[:, None] * tl.load(acc_ptr + (last * BLOCK_M + r[:, None]) * D + d[None, :])
    out = out / tl.where(l > 0, l, 1.0)[:, None]
    g = r // N
    row_i = r % N
    heads = h * G + g
    tl.store(o_ptr + b * sob + row_i[:, None] * son + heads[:, None] * soh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


# ---------------------------------------------------------------------------------------------------------------
# launcher

_SCRATCH: dict[torch.device, torch.Tensor] = {}
LAST_COMPILED = None  # the last compiled partial kernel (its n_regs / n_spills, for the benchmark)
_SM_COUNT: dict[torch.device, int] = {}


def _scratch(device: torch.device, numel: int) -> torch.Tensor:
    """One fp32 split-K scratch per device, grown (never shrunk) on demand."""
    buf = _SCRATCH.get(device)
    if buf is None or buf.numel() < numel:
        _SCRATCH.pop(device, None)
        buf = torch.empty(max(numel, 1 << 16) + numel // 4, dtype=torch.float32, device=device)
        _SCRATCH[device] = buf
    return buf


def _sm_count(device: torch.device) -> int:
    n = _SM_COUNT.get(device)
    if n is None:
        n = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
        _SM_COUNT[device] = n
    return n


DEFAULT_LUT = 1


def _lut(lut: int | None, bits: int) -> int:
    lut = DEFAULT_LUT if lut is None else lut
    return 0 if (lut == 2 and bits > 4) else lut


def supports(head_dim: int, key_bits: int, value_bits: int, n_queries: int, group: int) -> bool:
    return (
        head_dim in SUPPORTED_DIMS
        and key_bits in SUPPORTED_BITS
        and value_bits in SUPPORTED_BITS
        and group * n_queries <= MAX_ROWS
    )


def num_splits_for(batch_heads: int, packed_len: int, device: torch.device) -> int:
    """Splits of the packed history: about four programs per SM (the loop is latency-bound: more programs in
    flight hide it; measured on the H100), at least MIN_TOKENS_PER_SPLIT tokens each."""
    want = max(1, (4 * _sm_count(device) + batch_heads - 1) // batch_heads)
    most = max(1, (packed_len + MIN_TOKENS_PER_SPLIT - 1) // MIN_TOKENS_PER_SPLIT)
    return min(want, most)


def _row(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def decode_attention(
    query: torch.Tensor,
    state: dict,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    block_n: int = BLOCK_N,
    num_warps: int = 4,
    _diag: int = 0,
    lut: int | None = None,
) -> torch.Tensor:
    """Attention of query (B, Hq, n, D) over [packed | residual | new] of `state` (`TurboQuantLayer.attention_state()`).

    mask: None (causal: the queries end at the last key), boolean (True = attend) or additive, broadcastable to
    (B, Hq, n, T) (a longer last dim is cut to T). Returns (B, n, Hq, D) in the query's dtype, as transformers'
    attention functions do.
    """
    b, hq, n, d = query.shape
    kp, kn, vp, vn = state["k_packed"], state["k_norms"], state["v_packed"], state["v_norms"]
    rk, rv, nk, nv = state["res_k"], state["res_v"], state["new_k"], state["new_v"]
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
    block_m = max(16, triton.next_power_of_2(group * n))
    if num_splits is None:
        num_splits = num_splits_for(b * hkv, lq, query.device)
    num_splits = max(1, int(num_splits))
    tok_per_split = max(block_n, -(-max(lq, 1) // num_splits))
    tok_per_split = -(-tok_per_split // block_n) * block_n

    if mask is None:
        mask_kind, m_arg, ms = 0, query, (0, 0, 0, 0)
    else:
        if mask.dim() != 4:
            raise ValueError(f"mask must be 4-D (B, 1 or Hq, n, T), got shape {tuple(mask.shape)}")
        mk = mask[..., :t]  # transformers 4.x may hand a mask longer than the keys
        mk = mk.expand(b, hq, n, t)
        if mk.dtype == torch.bool:
            mask_kind, m_arg = 1, mk.view(torch.uint8)
        else:
            mask_kind, m_arg = 2, mk
        ms = m_arg.stride()
    qv = _row(query)
    rk, rv, nk, nv = _row(rk), _row(rv), _row(nk), _row(nv)
    kp, vp = _row(kp), _row(vp)
    pi = rot.matrix
    if pi.device != query.device:
        pi = pi.to(query.device)
    kc = kcb.centroids.contiguous()
    vc = vcb.centroids.contiguous()
    slots = b * hkv * (num_splits + 1)
    scratch = _scratch(query.device, slots * block_m * (d + 2))
    acc = scratch[: slots * block_m * d]
    ml = scratch[slots * block_m * d : slots * block_m * (d + 2)]
    if out is None:
        out = torch.empty(b, n, hq, d, dtype=query.dtype, device=query.device)
    global LAST_COMPILED
    LAST_COMPILED = _partial_kernel[(b * hkv, num_splits + 1)](
        qv, qv.stride(0), qv.stride(1), qv.stride(2),
        pi,
        kp, kp.stride(0), kp.stride(1), kp.stride(2),
        kn, kn.stride(0), kn.stride(1), kn.stride(2),
        vp, vp.stride(0), vp.stride(1), vp.stride(2),
        vn, vn.stride(0), vn.stride(1), vn.stride(2),
        kc, kc.shape[-1] if kc.dim() == 2 else 0, vc, vc.shape[-1] if vc.dim() == 2 else 0,
        rk, rk.stride(0), rk.stride(1), rk.stride(2),
        rv, rv.stride(0), rv.stride(1), rv.stride(2),
        nk, nk.stride(0), nk.stride(1), nk.stride(2),
        nv, nv.stride(0), nv.stride(1), nv.stride(2),
        m_arg, ms[0], ms[1], ms[2], ms[3],
        acc, ml,
        hkv, lq, lr, n, tok_per_split, num_splits, scale * LOG2E,
        G=group, D=d, KBITS=kcb.bits, VBITS=vcb.bits, BLOCK_M=block_m, BLOCK_N=block_n, MASK_KIND=mask_kind,
        KLUT=_lut(lut, kcb.bits), VLUT=_lut(lut, vcb.bits), DIAG=_diag, num_warps=num_warps,
    )
    _reduce_kernel[(b * hkv,)](
        acc, ml, pi, out, out.stride(0), out.stride(1), out.stride(2), hkv, n, num_splits,
        G=group, D=d, BLOCK_M=block_m, num_warps=4,
    )
    return out
