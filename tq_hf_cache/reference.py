"""The pure-torch TurboQuant oracle: every Triton kernel is tested against these functions, and they are
the CPU path of the cache.

A vector x is stored as its norm and the codebook indices of the rotated unit vector Pi x / ||x||;
it comes back as ||x|| * Pi^T c[idx].
"""

from __future__ import annotations

import torch

from .codebook import Codebook
from .packing import pack_indices, unpack_indices
from .rotation import Rotation

_TINY = 1e-30


def _per_head(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Broadcast a (H, k) per-head table against x of shape (B, H, T, D)."""
    if x.dim() != 4 or x.shape[1] != t.shape[0]:
        raise ValueError(
            f"a per-head codebook for {t.shape[0]} heads needs input shaped (B, {t.shape[0]}, T, D), got {tuple(x.shape)}"
        )
    return t


def bucketize(y: torch.Tensor, codebook: Codebook) -> torch.Tensor:
    """Index of the nearest centroid: the number of boundaries strictly below y."""
    b = codebook.boundaries.to(y.device)
    if not codebook.per_head:
        return torch.bucketize(y, b)
    _per_head(b, y)
    return torch.stack([torch.bucketize(y[:, h].contiguous(), b[h]) for h in range(b.shape[0])], dim=1)


def centroid_lookup(idx: torch.Tensor, codebook: Codebook) -> torch.Tensor:
    c = codebook.centroids.to(idx.device)
    if not codebook.per_head:
        return c[idx]
    _per_head(c, idx)
    return torch.stack([c[h][idx[:, h]] for h in range(c.shape[0])], dim=1)


def store_norm(norm: torch.Tensor, norm_dtype: torch.dtype) -> torch.Tensor:
    """The norm as stored: a non-finite norm stays non-finite (and a float16 overflow becomes inf) so that
    dequantization never invents a finite vector; the cache widens float16 norms before they would overflow."""
    return norm.to(norm_dtype)


def quantize(
    x: torch.Tensor, rotation: Rotation, codebook: Codebook, norm_dtype: torch.dtype = torch.float16
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) -> (packed uint8 (..., packed_bytes(D, bits)), norms (...))."""
    xf = x.float()
    norm = xf.norm(dim=-1)
    unit = xf / norm.clamp_min(_TINY).unsqueeze(-1)
    idx = bucketize(rotation.forward(unit), codebook)
    return pack_indices(idx, codebook.bits), store_norm(norm, norm_dtype)


def dequantize(
    packed: torch.Tensor,
    norms: torch.Tensor,
    rotation: Rotation,
    codebook: Codebook,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of `quantize` up to the quantization error: -> (..., D) in `dtype`."""
    idx = unpack_indices(packed, codebook.bits, rotation.dim)
    y = centroid_lookup(idx, codebook)
    return (rotation.inverse(y) * norms.float().unsqueeze(-1)).to(dtype)


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Plain float32 attention with GQA; query (B, Hq, n, D), key/value (B, Hkv, T, D).

    `mask` is boolean (True = attend) or additive, broadcastable to (B, Hq, n, T). The query rows end at the last
    key, so without a mask the n queries are causal over the last n keys.
    """
    b, hq, n, d = query.shape
    hkv, t = key.shape[1], key.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    rep = hq // hkv
    k = key.float().repeat_interleave(rep, dim=1)
    v = value.float().repeat_interleave(rep, dim=1)
    scale = d**-0.5 if scale is None else scale
    s = (query.float() @ k.transpose(-1, -2)) * scale
    if mask is None:
        pos_q = torch.arange(t - n, t, device=query.device).unsqueeze(-1)
        mask = torch.arange(t, device=query.device).unsqueeze(0) <= pos_q
    if mask.dtype == torch.bool:
        s = s.masked_fill(~mask, float("-inf"))
    else:
        s = s + mask.float()
    return softmax_rows(s) @ v


def softmax_rows(s: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim; a row that may see no key (all -inf) gives 0, a NaN score stays NaN."""
    blind = (s == float("-inf")).all(dim=-1, keepdim=True)
    return torch.softmax(s, dim=-1).masked_fill(blind, 0.0)


def static_attention(
    query: torch.Tensor,
    ring_k: torch.Tensor,
    ring_v: torch.Tensor,
    kv,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of query (B, Hq, n, D) over the positions a static layer holds (`PackedKV`), by definition:
    dequantize every slot, write the exact copies over theirs, attend to [0, length) (the n queries are the last
    n positions; a mask, over absolute positions, decides instead when given). Returns (B, n, Hq, D)."""
    from .packed_kv import overlay_exact

    b, hq, n, d = query.shape
    cap = kv.capacity
    keys = dequantize(kv.k_packed, kv.k_norms, kv.rotation, kv.k_codebook, torch.float32)
    vals = dequantize(kv.v_packed, kv.v_norms, kv.rotation, kv.v_codebook, torch.float32)
    s = kv.sinks
    overlay_exact(keys, ring_k.float(), kv.sink_k[:, :, :s].float(), kv.length, kv.exact_from)
    overlay_exact(vals, ring_v.float(), kv.sink_v[:, :, :s].float(), kv.length, kv.exact_from)
    pos = torch.arange(cap, device=query.device)
    if mask is None:
        q_pos = kv.length - n + torch.arange(n, device=query.device)
        allowed = pos[None, :] <= q_pos[:, None]
    else:
        allowed = mask[..., :cap]
    if allowed.dtype == torch.bool:
        allowed = allowed & (pos < kv.length)
    else:
        allowed = allowed.float().masked_fill(pos >= kv.length, float("-inf"))
    out = attention(query, keys, vals, allowed, scale)
    return out.transpose(1, 2).to(query.dtype).contiguous()
