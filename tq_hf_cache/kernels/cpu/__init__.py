"""Decode attention over a layer's `PackedKV` on the CPU: `reference.packed_attention`'s math, with the packed
history's scores and value sums computed in C (`decode.c`, compiled at first use by `jit`) straight from the packed
codes, so that no dequantized copy of the history is made. The sinks, the window, the softmax and the rotations stay in
torch, as in the reference. A static layer is read through `dynamic_view` (its positions held, not its capacity).
"""

from __future__ import annotations

import sys
from dataclasses import replace

import torch

from ...quant import reference
from .jit import JitError, library

__all__ = ["JitError", "available", "serves", "dynamic_view", "decode_attention", "packed_scores_into",
           "packed_values"]

MAX_DIM = 512  # decode.c's MAX_D


def available() -> bool:
    """Whether the C library builds and loads in this process (tried once)."""
    try:
        library()
    except JitError:
        return False
    return True


def _codes_ok(packed: torch.Tensor, bits: int, d: int) -> bool:
    return packed.shape[-1] == d * bits // 8 and packed.stride(-1) == 1


def dynamic_view(kv):
    """A static layer's `PackedKV` read as a dynamic one: host lengths, and its live window (position p at slot
    p % window) in position order. Its packed slots are positions already, as in the dynamic layout; a CPU static
    layer's lengths are host memory, so reading them costs no sync."""
    length = int(kv.length)
    sinks = min(kv.sinks, length)
    lq = max(int(kv.exact_from), sinks)  # a young or cropped layer's window may also hold the sinks' positions
    slots = torch.arange(lq, length, device=kv.window_k.device) % kv.window_k.shape[2]
    return replace(kv, length=length, exact_from=lq, sinks=sinks, window_k=kv.window_k.index_select(2, slots),
                   window_v=kv.window_v.index_select(2, slots))


def serves(query: torch.Tensor, kv) -> bool:
    """Whether the C path takes this call's shapes: a CPU query over a dynamic layer whose packed vectors are whole
    groups of 8 codes (head dims that are multiples of 8, up to MAX_DIM) on a little-endian machine (whether the C
    builds here is `available()`)."""
    if query.device.type != "cpu" or kv.static or sys.byteorder != "little":
        return False
    d = query.shape[-1]
    if d % 8 or d > MAX_DIM or not _codes_ok(kv.v_packed, kv.v_codebook.bits, d):
        return False
    if kv.key_split is None:
        keys = [(kv.k_packed, kv.k_codebook.bits, d)]
    else:
        keys = [(packed, cb.bits, rot.dim) for (packed, _), (rot, cb) in zip(kv.key_parts, kv.key_split.parts)]
    return all(dim % 8 == 0 and _codes_ok(packed, bits, dim) for packed, bits, dim in keys)


def _heads(t: torch.Tensor) -> torch.Tensor:
    """t (B, H, ...) with one stride between the B x H heads (a copy only where the B and H strides disagree)."""
    if t.shape[0] > 1 and t.stride(0) != t.shape[1] * t.stride(1):
        t = t.contiguous()
    return t


def _check(name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple) -> None:
    if t.device.type != "cpu" or t.dtype != dtype or tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected a CPU {dtype} tensor of shape {tuple(shape)}, got {t.device} {t.dtype} "
                         f"{tuple(t.shape)}")


MAX_TOKENS = 2**31 - 2**24  # the C's int token counts, with room for its chunk arithmetic


def _table(codebook, h: int) -> tuple[torch.Tensor, int, int]:
    """(table, its head stride, its heads) for h KV heads: the torch math's centroid table (`reference.centroids`:
    entry e holds the centroids of the w codes packed in e's bits, w as decode.c's DEFINE_DECODE takes it), as
    float32. A per-head codebook must have exactly h heads."""
    table = reference._centroid_table(codebook, torch.device("cpu")).view(torch.float32)
    if not codebook.per_head:
        return table, 0, 1
    heads = codebook.centroids.shape[0]
    if heads != h:
        raise ValueError(f"a per-head codebook for {heads} heads cannot read codes of {h} KV heads")
    return table, table.numel() // heads, h


def _codes(codes: torch.Tensor, bits: int, d: int, b: int, h: int, tokens: int) -> torch.Tensor:
    if sys.byteorder != "little":
        raise RuntimeError("the CPU decode kernels read packed codes as little-endian words")
    if d % 8 or not 0 < d <= MAX_DIM or tokens > MAX_TOKENS or b * h > MAX_TOKENS:
        raise ValueError(f"the CPU decode kernels take head dims that are multiples of 8 up to {MAX_DIM} and fewer "
                         f"than {MAX_TOKENS} tokens and heads; got head dim {d}, {tokens} tokens, {b * h} heads")
    _check("codes", codes, torch.uint8, (b, h, tokens, d * bits // 8))
    codes = _heads(codes)
    if codes.stride(-1) != 1 or (tokens > 1 and codes.stride(2) < codes.shape[-1]):
        codes = codes.contiguous()
    return codes


def packed_scores_into(out: torch.Tensor, codes: torch.Tensor, norms: torch.Tensor, q: torch.Tensor, codebook,
                       accumulate: bool = False) -> torch.Tensor:
    """out (B, H, rows, T) float32 (its last dim contiguous) = norms x (q . c[codes]), or += where `accumulate`.

    codes (B, H, T, D bits / 8) uint8 over a codebook of H heads or one; norms (B, H, T) float32; q (B, H, rows, D)
    float32, in the codebook's rotated domain."""
    b, h, rows, d = q.shape
    tokens, bits = out.shape[-1], codebook.bits
    codes = _codes(codes, bits, d, b, h, tokens)
    _check("norms", norms, torch.float32, (b, h, tokens))
    _check("q", q, torch.float32, (b, h, rows, d))
    _check("out", out, torch.float32, (b, h, rows, tokens))
    norms, q = norms.contiguous(), q.contiguous()
    if (out.stride(-1) != 1 or (b > 1 and out.stride(0) != h * out.stride(1)) or (rows > 1 and out.stride(2) < tokens)
            or (h > 1 and out.stride(1) < rows * out.stride(2))):
        raise ValueError(f"out: its last dim must be contiguous, its rows and heads apart and its heads evenly "
                         f"strided, got strides {out.stride()} for shape {tuple(out.shape)}")
    table, table_stride, heads = _table(codebook, h)
    if tokens and rows and b * h:
        code = library().tq_packed_scores(
            codes.data_ptr(), codes.stride(1), codes.stride(2), norms.data_ptr(), norms.stride(1), q.data_ptr(),
            q.stride(1), q.stride(2), table.data_ptr(), table_stride, out.data_ptr(), out.stride(1), out.stride(2),
            b * h, heads, rows, tokens, d, bits, int(accumulate), max(1, torch.get_num_threads()))
        if code:
            raise RuntimeError(f"tq_packed_scores refused its arguments (code {code})")
    return out


def packed_values(p: torch.Tensor, codes: torch.Tensor, norms: torch.Tensor, codebook, d: int) -> torch.Tensor:
    """sum_t p[..., t] norms[..., t] c[codes[..., t, :]]: (B, H, rows, D) float32, in the rotated domain.

    p (B, H, rows, T) float32; codes (B, H, T, D bits / 8) uint8; norms (B, H, T) float32."""
    b, h, rows, tokens = p.shape
    bits = codebook.bits
    codes = _codes(codes, bits, d, b, h, tokens)
    _check("norms", norms, torch.float32, (b, h, tokens))
    _check("p", p, torch.float32, (b, h, rows, tokens))
    norms = norms.contiguous()
    if p.stride(-1) != 1 or (b > 1 and p.stride(0) != h * p.stride(1)):
        p = p.contiguous()
    table, table_stride, heads = _table(codebook, h)
    if not (rows and b * h):
        return p.new_zeros(b, h, rows, d)
    out = p.new_empty(b, h, rows, d)
    code = library().tq_packed_values(
        codes.data_ptr(), codes.stride(1), codes.stride(2), norms.data_ptr(), norms.stride(1), p.data_ptr(),
        p.stride(1), p.stride(2), table.data_ptr(), table_stride, out.data_ptr(), b * h, heads, rows, tokens, d, bits,
        max(1, torch.get_num_threads()))
    if code == 2:
        raise MemoryError(f"tq_packed_values could not allocate its partial sums ({b * h} heads x {rows} rows x {d})")
    if code:
        raise RuntimeError(f"tq_packed_values refused its arguments (code {code})")
    return out


def decode_attention(query: torch.Tensor, kv, mask: torch.Tensor | None, scale: float | None) -> torch.Tensor:
    """`reference.packed_attention` with the packed history read by the C kernels (see `serves`): query (B, Hq, n, D)
    over [sinks | packed | window] -> (B, n, Hq, D) in the query's dtype."""
    b, hq, n, d = query.shape
    lq, t, ns = int(kv.exact_from), int(kv.length), kv.sinks
    hkv = kv.k_packed.shape[1]
    q = query.float().reshape(b, hkv, hq // hkv * n, d)  # the query heads sharing a KV head, as rows
    scale = d**-0.5 if scale is None else scale
    s = q.new_empty(b, hkv, q.shape[2], t)
    if kv.key_split is None:
        parts = [(q, kv.rotation, kv.k_codebook, kv.k_packed, kv.k_norms)]
    else:
        parts = [(qp, rot, cb, packed, norms) for qp, (rot, cb), (packed, norms)
                 in zip(kv.key_split.split(q), kv.key_split.parts, kv.key_parts)]
    for i, (qp, rot, cb, packed, norms) in enumerate(parts):
        rq = qp @ rot.matrix.T
        packed_scores_into(s[..., ns:lq], packed[:, :, ns:lq], norms[:, :, ns:lq].float(), rq, cb, accumulate=i > 0)
    reference.exact_scores_into(s, q, kv)
    p = reference.decode_probabilities(s.mul_(scale), mask, hq, n)
    out = packed_values(p[..., ns:lq], kv.v_packed[:, :, ns:lq], kv.v_norms[:, :, ns:lq].float(), kv.v_codebook, d)
    out = reference.add_exact_values(out @ kv.rotation.matrix, p, kv)
    return out.view(b, hq, n, d).transpose(1, 2).to(query.dtype).contiguous()
