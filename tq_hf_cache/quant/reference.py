"""The pure-torch TurboQuant oracle: every Triton kernel is tested against these functions, and they are
the CPU path of the cache.

A vector x is stored as its norm and the codebook indices of the rotated unit vector Pi x / ||x||;
it comes back as ||x|| * Pi^T c[idx].
"""

from __future__ import annotations

import sys

import torch

from .codebook import NORM_GAIN, Codebook
from .packing import pack_indices, unpack_indices
from .pair_codebook import nearest
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
    """Index of the nearest centroid: the number of boundaries strictly below y. For a pair codebook, each pair's
    nearest point, as two codes (`pair_codes`)."""
    if codebook.pair:
        return pair_codes(y, codebook)
    b = codebook.boundaries.to(y.device)
    if not codebook.per_head:
        return torch.bucketize(y, b)
    _per_head(b, y)
    return torch.stack([torch.bucketize(y[:, h].contiguous(), b[h]) for h in range(b.shape[0])], dim=1)


def pair_codes(y: torch.Tensor, codebook: Codebook) -> torch.Tensor:
    """Codes (..., D) of y (..., D) under a pair codebook: the index of each pair's nearest point (squared distance,
    ties to the lowest index), its low `bits` bits at the even coordinate and its high ones at the odd."""
    bits, d = codebook.bits, y.shape[-1]
    if d % 2:
        raise ValueError(f"pair codes need an even head dim, got {d}")
    pts = codebook.centroids.to(y.device, torch.float32)
    pairs = y.float().reshape(*y.shape[:-1], d // 2, 2)
    if codebook.per_head:
        _per_head(pts, y)
        idx = torch.stack([nearest(pairs[:, h].reshape(-1, 2), pts[h]).view(pairs[:, h].shape[:-1])
                           for h in range(pts.shape[0])], dim=1)
    else:
        idx = nearest(pairs.reshape(-1, 2), pts).view(pairs.shape[:-1])
    return torch.stack([idx & (2**bits - 1), idx >> bits], -1).reshape(y.shape)


def centroid_lookup(idx: torch.Tensor, codebook: Codebook) -> torch.Tensor:
    """The decoded rotated coordinates of codes idx (..., D)."""
    if codebook.pair:
        pair = idx[..., 0::2] | (idx[..., 1::2] << codebook.bits)
        pts = codebook.centroids.to(idx.device)
        if not codebook.per_head:
            return pts[pair].flatten(-2)
        _per_head(pts, idx)
        return torch.stack([pts[h][pair[:, h]].flatten(-2) for h in range(pts.shape[0])], dim=1)
    c = codebook.centroids.to(idx.device)
    if not codebook.per_head:
        return c[idx]
    _per_head(c, idx)
    return torch.stack([c[h][idx[:, h]] for h in range(c.shape[0])], dim=1)


# coordinates per row of a centroid table, so that a row is indexed by `bits * w` consecutive bits of the packed
# stream (at most 4096 rows); 8 coordinates, exactly `bits` bytes, hold a whole number of rows
_ROW_COORDS = {1: 4, 2: 4, 3: 4, 4: 2, 5: 2, 6: 2, 7: 1, 8: 1}
# a table row as one element, so that a gather moves whole rows; float64 rather than int64 for two floats (the same
# bits, moved unchanged: two centroids in [-1, 1] never make a NaN or inf pattern; torch's CPU gather of float64 ran
# 1.5x faster than of int64 here)
_ROW_DTYPE = {1: torch.float32, 2: torch.float64, 4: torch.complex128}


def _centroid_table(codebook: Codebook, device) -> torch.Tensor:
    """(heads * rows,) of one w-float element each: row r holds the centroids of the w indices packed in the bits
    of r. Made once per device, held by the codebook (`codebook.derived`)."""
    device = torch.device(device)
    return codebook.derived.get(("reference.centroid_table", device), lambda: _build_centroid_table(codebook, device))


def _build_centroid_table(codebook: Codebook, device: torch.device) -> torch.Tensor:
    bits, w = codebook.bits, _ROW_COORDS[codebook.bits]
    table = codebook.to(device).coordinate_values(torch.arange(2 ** (bits * w), device=device), w)
    return table.reshape(-1, w).contiguous().view(_ROW_DTYPE[w]).view(-1)


def centroids(packed: torch.Tensor, codebook: Codebook, dim: int, row_major: bool = False) -> torch.Tensor:
    """The rotated unit vectors `c[unpack(packed)]`, float32 (..., dim), without materializing the indices: each
    group of 8 coordinates (`bits` bytes) becomes one integer word, cut into rows of a centroid table. Per-head
    codebooks need packed shaped (B, H, T, nbytes).

    row_major: the coordinates in the order `row_order(bits, dim)` gives (each row's coordinates of every group,
    then the next row's), which takes one scalar shift per row of a group instead of a broadcast shift; a caller
    that rotates the result with `row_major_matrix` gets the natural order's products."""
    bits = codebook.bits
    if dim % 8 or sys.byteorder != "little" or packed.shape[-1] != dim * bits // 8:
        if row_major:
            raise ValueError(f"row_major centroids need a head dim divisible by 8 and whole bytes, got dim {dim}")
        return centroid_lookup(unpack_indices(packed, bits, dim), codebook)
    lead, w = packed.shape[:-1], _ROW_COORDS[bits]
    table = _centroid_table(codebook, packed.device)
    if bits * w == 8:  # a row is a byte: the packed bytes are the rows, in the natural order
        rows = packed.to(torch.int64)
    elif row_major:
        rows = _rows_by_row(packed, bits, dim)
    else:
        groups = packed.reshape(*lead, dim // 8, bits)
        width = 4 if bits <= 4 else 8  # bytes of the word that holds a group
        word = groups.new_zeros(*lead, dim // 8, width)
        word[..., :bits] = groups
        word = word.view(torch.int32 if width == 4 else torch.int64)  # (..., dim // 8, 1), little-endian
        shifts = torch.arange(0, 8 * bits, bits * w, device=packed.device, dtype=word.dtype)
        rows = (word >> shifts) & (2 ** (bits * w) - 1)  # (..., dim // 8, 8 // w)
    if codebook.per_head:
        heads = _per_head(codebook.centroids, packed).shape[0]
        offset = torch.arange(heads, device=packed.device, dtype=rows.dtype) * 2 ** (bits * w)
        rows = rows + offset.view(heads, *([1] * (rows.dim() - 2)))
    # int64 indices: torch's CPU index_select took 2-4x longer with int32 ones
    return table.index_select(0, rows.reshape(-1).long()).view(torch.float32).view(*lead, dim)


def _rows_by_row(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Table rows of packed (..., nbytes) as (..., rows per group, groups): row i of every group, then row i + 1."""
    lead, w, groups = packed.shape[:-1], _ROW_COORDS[bits], dim // 8
    # int64 words (the shifts then write the gather's index dtype directly); bytes past a group's `bits` stay
    # unset: no row reaches them (8 // w rows of bits * w bits each end at bit 8 * bits)
    word = packed.new_empty(*lead, groups, 8)
    word[..., :bits] = packed.reshape(*lead, groups, bits)
    word = word.view(torch.int64).squeeze(-1)
    rows = torch.empty(*lead, 8 // w, groups, dtype=torch.int64, device=packed.device)  # the gather's index dtype
    for i in range(8 // w):
        torch.bitwise_right_shift(word, bits * w * i, out=rows[..., i, :])
    return rows.bitwise_and_(2 ** (bits * w) - 1)


def row_order(bits: int, dim: int) -> list[int]:
    """The natural coordinate at each position of `centroids(..., row_major=True)`."""
    w = _ROW_COORDS[bits]
    if bits * w == 8:
        return list(range(dim))
    return [g * 8 + i * w + j for i in range(8 // w) for g in range(dim // 8) for j in range(w)]


def row_major_matrix(rotation: Rotation, bits: int) -> torch.Tensor:
    """Pi's rows in `row_order(bits)`: y_rm @ this == y @ Pi (the inverse rotation) and x @ this.T == Pi x in that
    order, for y_rm / Pi x in the row-major order of `centroids(..., row_major=True)`. On the rotation's device, made
    once and held by the rotation (`rotation.derived`)."""
    pi = rotation.matrix

    def build() -> torch.Tensor:
        return pi.index_select(0, torch.tensor(row_order(bits, rotation.dim), device=pi.device)).contiguous()

    return rotation.derived.get(("reference.row_major", pi.device, bits), build)


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
    if codebook.norm_correction:
        norm = norm * norm_gain(centroid_lookup(idx, codebook))
    return pack_indices(idx, codebook.bits), store_norm(norm, norm_dtype)


def norm_gain(decoded: torch.Tensor) -> torch.Tensor:
    """1 / ||u_hat|| of decoded rotated unit vectors (..., D), at most `NORM_GAIN`: the factor a norm-correcting
    codebook stores the norm with."""
    return decoded.float().norm(dim=-1).clamp_min(1 / NORM_GAIN).reciprocal()


def dequantize(
    packed: torch.Tensor,
    norms: torch.Tensor,
    rotation: Rotation,
    codebook: Codebook,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of `quantize` up to the quantization error: -> (..., D) in `dtype`."""
    y = centroids(packed, codebook, rotation.dim)
    return (rotation.inverse(y) * norms.float().unsqueeze(-1)).to(dtype)


def key_mean(pre_rope: torch.Tensor, ratio: float) -> torch.Tensor:
    """`rope.key_mean` row by row, in float64: for pre-RoPE keys (B, H, T, D), per (batch row, head) the mean of the
    keys whose norm is at most `ratio` times the lower median of the row's non-NaN norms, 0 where none is kept ->
    (B, H, 1, D) float32."""
    b, h, _, d = pre_rope.shape
    out = torch.zeros(b, h, 1, d, dtype=torch.float64)
    for i in range(b):
        for j in range(h):
            rows = pre_rope[i, j].double().cpu()
            norms = [float(r.norm()) for r in rows]
            ordered = sorted(n for n in norms if n == n)
            if not ordered:
                continue
            cut = ordered[(len(ordered) - 1) // 2] * ratio
            kept = [r for r, n in zip(rows, norms) if n <= cut]
            if kept:
                out[i, j, 0] = torch.stack(kept).mean(0)
    return out.float().to(pre_rope.device)


def split_quantize(x: torch.Tensor, split, norm_dtype: torch.dtype = torch.float16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Split keys (`key_split.KeySplit`): x (B, H, T, D) -> per part (packed, norms), each part `quantize`d with its
    own rotation and codebook."""
    return [quantize(part, rot, cb, norm_dtype) for part, (rot, cb) in zip(split.split(x), split.parts)]


def split_dequantize(parts, split, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `split_quantize` up to the quantization error: per part (packed, norms) -> (B, H, T, D) in `dtype`."""
    dense = [dequantize(p, n, rot, cb, dtype) for (p, n), (rot, cb) in zip(parts, split.parts)]
    return split.join(dense, dense[0].new_empty(*dense[0].shape[:-1], split.dim))


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


def exact_scores_into(s: torch.Tensor, q: torch.Tensor, kv) -> None:
    """The scores of q (B, Hkv, rows, D) float32 against a dynamic `PackedKV`'s exact positions, written into their
    slices of s (B, Hkv, rows, T): the sinks [0, sinks) and the window [exact_from, length)."""
    lq, t, ns = int(kv.exact_from), int(kv.length), kv.sinks
    if ns:
        torch.matmul(q, kv.sink_k[:, :, :ns].float().transpose(-1, -2), out=s[..., :ns])
    torch.matmul(q, kv.window_k[:, :, : t - lq].float().transpose(-1, -2), out=s[..., lq:])


def add_exact_values(out: torch.Tensor, p: torch.Tensor, kv) -> torch.Tensor:
    """out (B, Hkv, rows, D) plus the probabilities p (B, Hkv, rows, T) of the exact positions times their values."""
    lq, t, ns = int(kv.exact_from), int(kv.length), kv.sinks
    out += p[..., lq:] @ kv.window_v[:, :, : t - lq].float()
    if ns:
        out += p[..., :ns] @ kv.sink_v[:, :, :ns].float()
    return out


def decode_probabilities(s: torch.Tensor, mask: torch.Tensor | None, heads: int, n: int) -> torch.Tensor:
    """Softmax of scaled scores s (B, Hkv, rows, T), rows being the query heads of a KV head times the n queries (the
    last n positions), under `mask` (boolean True = attend, or additive; None: causal), in place of s's shape."""
    b, hkv, rows, t = s.shape
    s = s.view(b, heads, n, t)
    if mask is None and n == 1:  # one query at the last position sees every key: nothing to mask
        return torch.softmax(s, dim=-1).view(b, hkv, rows, t)
    if mask is None:
        pos_q = torch.arange(t - n, t, device=s.device).unsqueeze(-1)
        mask = torch.arange(t, device=s.device).unsqueeze(0) <= pos_q
    else:
        mask = mask[..., :t]
    if mask.dtype == torch.bool:
        s = s.masked_fill(~mask, float("-inf"))
    else:
        s = s + mask.float()
    return softmax_rows(s).view(b, hkv, rows, t)


def packed_attention(query: torch.Tensor, kv, mask: torch.Tensor | None, scale: float | None) -> torch.Tensor:
    """The fused decode kernel's math (fp32) for a dynamic layer's `PackedKV`: query (B, Hq, n, D) over
    [sinks | packed | window]; the n queries are the last n positions.

    The packed part stays in the rotated domain: scores are (Pi q) . c[idx] times the key norm, and the value
    sum c[idx] weighted by probability x norm is rotated back once per query. Returns (B, n, Hq, D) in the
    query's dtype.
    """
    b, hq, n, d = query.shape
    lq, t, ns = int(kv.exact_from), int(kv.length), kv.sinks
    hkv = kv.k_packed.shape[1]
    g = hq // hkv
    q = query.float().reshape(b, hkv, g * n, d)  # the g query heads sharing a KV head as rows
    scale = d**-0.5 if scale is None else scale
    # positions: [sinks | packed after the sinks | window], each part's scores written into its slice of s
    s = q.new_empty(b, hkv, g * n, t)
    s[..., ns:lq] = packed_scores(q, kv, ns, lq)
    exact_scores_into(s, q, kv)
    p = decode_probabilities(s.mul_(scale), mask, hq, n)
    vcb = kv.v_codebook
    row_major = d % 8 == 0 and sys.byteorder == "little" and kv.v_packed.shape[-1] == d * vcb.bits // 8
    vc = centroids(kv.v_packed[:, :, ns:lq], vcb, d, row_major)  # (B, Hkv, lq - ns, D): rotated unit vectors
    p_packed = p[..., ns:lq] * kv.v_norms[:, :, None, ns:lq].float()
    inverse = row_major_matrix(kv.rotation, vcb.bits) if row_major else kv.rotation.matrix
    out = add_exact_values((p_packed @ vc) @ inverse.to(vc.device), p, kv)
    return out.view(b, hq, n, d).transpose(1, 2).to(query.dtype).contiguous()


def packed_scores(q: torch.Tensor, kv, start: int, stop: int) -> torch.Tensor:
    """q . k (fp32) of rows q (B, Hkv, rows, D) against the packed keys of slots [start, stop) of a `PackedKV`, in
    the rotated domain: (Pi q) . c[idx] times the key norm; for split keys (`KeySplit`) the sum over the parts of
    (Pi_p q_p) . c_p[idx_p] times part p's norm, q_p being the query's channels of part p."""
    if kv.key_split is None:
        return _part_scores(q, kv.k_packed, kv.k_norms, kv.rotation, kv.k_codebook, start, stop)
    s = 0
    for qp, (rot, cb), (packed, norms) in zip(kv.key_split.split(q), kv.key_split.parts, kv.key_parts):
        s = s + _part_scores(qp, packed, norms, rot, cb, start, stop)
    return s


def _part_scores(q, packed, norms, rot: Rotation, cb: Codebook, start: int, stop: int) -> torch.Tensor:
    """(Pi q) . c[idx] times the norm, over slots [start, stop); in the row-major order where it applies (the
    query is rotated into that order, the centroids come out in it)."""
    d = rot.dim
    row_major = d % 8 == 0 and sys.byteorder == "little" and packed.shape[-1] == d * cb.bits // 8
    kc = centroids(packed[:, :, start:stop], cb, d, row_major)
    rq = q.float() @ (row_major_matrix(rot, cb.bits) if row_major else rot.matrix).to(q.device).T
    return (rq @ kc.transpose(-1, -2)) * norms[:, :, None, start:stop].float()


def static_append(
    key: torch.Tensor,
    value: torch.Tensor,
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
    rotation: Rotation,
    k_codebook: Codebook,
    v_codebook: Codebook,
    key_split=None,
    key_parts=None,
    key_codes=None,
) -> None:
    """A static layer's append, by definition. The n new tokens (B, H, n, D) take positions length .. length + n - 1;
    those below the capacity (the packed buffers' token axis) are quantized into their slots, the last min(n, window)
    of them are copied to window slot position % window and those below n_sinks to sink slot position. Then length +=
    n and exact_from = max(exact_from, length - window). Split keys (`key_split`): each part into its (packed,
    norms) of `key_parts` (part 0's are k_packed / k_norms). key_codes: what the key codes are made of when it is not
    the keys themselves (centred keys: k - R(t) mu); the exact copies are always of `key`."""
    codes = key if key_codes is None else key_codes
    n, cap, window = key.shape[2], k_packed.shape[2], window_k.shape[2]
    i = torch.arange(n, device=key.device)
    pos = i + length
    ok = pos < cap
    last = ok & (i >= n - window)
    sink = ok & (pos < n_sinks)
    if key_split is not None:
        for (p, nm), (packed, norms) in zip(split_quantize(codes[:, :, ok], key_split, k_norms.dtype), key_parts):
            packed.index_copy_(2, pos[ok], p)
            norms.index_copy_(2, pos[ok], nm)
    for x, src, packed, norms, cb, r, s in ((key, codes if key_split is None else None, k_packed, k_norms, k_codebook,
                                             window_k, sink_k),
                                            (value, value, v_packed, v_norms, v_codebook, window_v, sink_v)):
        if src is not None:  # split keys' codes were stored above
            p, nm = quantize(src[:, :, ok], rotation, cb, norms.dtype)
            packed.index_copy_(2, pos[ok], p)
            norms.index_copy_(2, pos[ok], nm)
        r.index_copy_(2, pos[last] % window, x[:, :, last].to(r.dtype))
        s.index_copy_(2, pos[sink], x[:, :, sink].to(s.dtype))
    length.add_(n)
    exact_from.copy_(torch.maximum(exact_from, length - window))


def window_positions(length: torch.Tensor, exact_from: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(a position for each window slot, whether the slot is live), all on the device (no host sync).

    Slot j holds the newest position p < length with p % window == j; it is live when p >= exact_from. A slot with
    no such p >= 0 gets position j (>= length: a future one). The positions are distinct (each is j modulo window),
    so a scatter of the window by them never collides; a dead slot's position must be written with its own value.
    """
    j = torch.arange(window, device=length.device)
    last = length - 1
    p = last - torch.remainder(last - j, window)
    return torch.where(p >= 0, p, j), p >= exact_from


def overlay_exact(full: torch.Tensor, window: torch.Tensor, sinks: torch.Tensor, length: torch.Tensor,
                  exact_from: torch.Tensor) -> torch.Tensor:
    """Write a static layer's exact copies (sinks, then the live window slots) over `full` (B, H, capacity, D), in
    place. Positions at or past `length` may receive stale values; attention masks them."""
    s = sinks.shape[2]
    if s:
        full[:, :, :s].copy_(sinks)
    pos, live = window_positions(length, exact_from, window.shape[2])
    vals = torch.where(live[None, None, :, None], window.to(full.dtype), full.index_select(2, pos))
    full.index_copy_(2, pos, vals)
    return full



def static_attention(query: torch.Tensor, kv, mask: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Attention of query (B, Hq, n, D) over the positions a static layer holds (`PackedKV`), by definition:
    dequantize every slot, write the exact copies over theirs, attend to [0, length) (the n queries are the last
    n positions; a mask, over absolute positions, decides instead when given). Returns (B, n, Hq, D)."""
    b, hq, n, d = query.shape
    cap = kv.capacity
    if kv.key_split is None:
        keys = dequantize(kv.k_packed, kv.k_norms, kv.rotation, kv.k_codebook, torch.float32)
    else:
        keys = split_dequantize(kv.key_parts, kv.key_split, torch.float32)
    vals = dequantize(kv.v_packed, kv.v_norms, kv.rotation, kv.v_codebook, torch.float32)
    s = kv.sinks
    overlay_exact(keys, kv.window_k.float(), kv.sink_k[:, :, :s].float(), kv.length, kv.exact_from)
    overlay_exact(vals, kv.window_v.float(), kv.sink_v[:, :, :s].float(), kv.length, kv.exact_from)
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
