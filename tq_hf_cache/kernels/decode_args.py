"""The arguments of a decode attention launch, shared by its two launchers (`decode_attention`: Triton, `cuda`: CUDA):
the lengths of a `PackedKV`, its buffers in the row layouts the kernels read, the mask's kind and strides, the output,
the split-K scratch. Neither launcher picks the other: `select` picks, `ops` calls one.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch

from . import _common as C

LOG2E = 1.4426950408889634


def tokens_last(t: torch.Tensor, stride_t: int) -> torch.Tensor:
    """t with unit last-dim stride and token stride stride_t (dim 2), copying only if it has another layout."""
    if t.stride(-1) == 1 and (t.shape[2] <= 1 or t.stride(2) == stride_t):
        return t
    return t.contiguous()


def packed_rows(t: torch.Tensor) -> torch.Tensor:
    """Packed codes whose rows start on 4-byte boundaries (the kernels read whole words), copied only if they do not."""
    t = tokens_last(t, t.shape[-1])
    return t if C.rows_aligned(t) else t.clone(memory_format=torch.contiguous_format)


def mask_args(mask, b, hq, n, t, query):
    """(kind, tensor, strides) of a mask: 0 none (causal), 1 boolean, 2 additive; 3 / 4 the same as one row shared by
    every head and query of a batch row."""
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
    strides = m_arg.stride()
    if strides[1] == 0 and (strides[2] == 0 or n == 1):  # one row serves every head and query of a batch row
        kind += 2
    return kind, m_arg, strides


def output(query: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """The (B, n, Hq, D) output of a query (B, Hq, n, D): `out` when it fits (the query's dtype, unit last stride),
    else a ValueError; a new tensor when None."""
    b, hq, n, d = query.shape
    if out is None:
        return torch.empty(b, n, hq, d, dtype=query.dtype, device=query.device)
    if out.shape != (b, n, hq, d) or out.stride(-1) != 1 or out.dtype != query.dtype:
        raise ValueError(f"out must be ({b}, {n}, {hq}, {d}) {query.dtype} with unit last stride, got "
                         f"{tuple(out.shape)} {out.dtype}")
    return out


def stored_rows(group: int, n: int) -> int:
    """The partial rows a (batch, KV head) stores: a power of 2 >= group * n."""
    return 1 << max(0, (group * n - 1).bit_length())


_SCRATCH: "collections.OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor]]" = collections.OrderedDict()
_SCRATCH_STREAMS = 16  # (device, stream) pairs whose scratch is kept


def scratch(device: torch.device, numel: int, n_counters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 split-K scratch and the arrival counters (one int32 per (batch, KV head), zero between launches: the
    merging program resets its own) for eager calls, grown (never shrunk) on demand.

    One pair per device and stream: two launches on different streams may run at once, and sharing the counters
    would let one merge the other's partials (a launch on a side stream overlapping one on the default stream gave
    garbage). Buffers are made on their stream, so the allocator reuses them only in its order.
    """
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    buf, cnt = _SCRATCH.pop((device, stream), (None, None))
    if buf is None or buf.numel() < numel:
        buf = torch.empty(max(numel, 1 << 16) + numel // 4, dtype=torch.float32, device=device)
    if cnt is None or cnt.numel() < n_counters:
        cnt = torch.zeros(max(n_counters, 1024), dtype=torch.int32, device=device)
    while len(_SCRATCH) >= _SCRATCH_STREAMS:
        _SCRATCH.popitem(last=False)  # the least recently used stream's pair
    _SCRATCH[(device, stream)] = (buf, cnt)
    return buf, cnt


def scratch_for(kv, device: torch.device, numel: int, n_counters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The scratch and counters of a launch: the `PackedKV`'s own (a compiled step's, made with the cache) when it
    has them, checked big enough, else `scratch`'s eager pair."""
    if kv.scratch is None:
        return scratch(device, numel, n_counters)
    if kv.scratch.numel() < numel or kv.counters.numel() < n_counters:
        raise ValueError(f"the PackedKV's scratch holds {kv.scratch.numel()} floats and {kv.counters.numel()} "
                         f"counters; this call needs {numel} and {n_counters}")
    return kv.scratch, kv.counters


@dataclass
class Lengths:
    """Where a launch reads the positions: lq packed and lr exact ones after them (host ints, 0 for a static layer,
    whose `lens` are its device lengths and `window` its window's slots), the packed span the splits cut (`split_len`)
    and the mask's key count (`t`)."""

    lq: int
    lr: int
    window: int
    lens: tuple | None
    split_len: int
    t: int


def lengths(kv) -> Lengths:
    """A `PackedKV`'s lengths, checked against its buffers (a ValueError where they disagree)."""
    if kv.static:
        return Lengths(0, 0, kv.window_k.shape[2], (kv.length, kv.exact_from), kv.capacity, kv.capacity)
    lq, lr = int(kv.exact_from), int(kv.length) - int(kv.exact_from)
    if kv.k_packed.shape[2] < lq or kv.window_k.shape[2] < lr or lr < 0:
        raise ValueError(f"the PackedKV holds {kv.k_packed.shape[2]} packed and {kv.window_k.shape[2]} window slots "
                         f"for exact_from={lq}, length={lq + lr}")
    if kv.key_split is not None and (kv.key_parts is None or len(kv.key_parts) != len(kv.key_split.parts)):
        raise ValueError("a PackedKV with key_split needs key_parts, one (packed, norms) per part")
    if kv.sinks > lq:
        raise ValueError(f"the PackedKV has {kv.sinks} sink positions but only {lq} packed ones")
    return Lengths(lq, lr, 0, None, lq, lq + lr)


def check_heads(query: torch.Tensor, kv) -> int:
    """The query heads per KV head (a ValueError where they do not divide)."""
    hq, hkv = query.shape[1], kv.k_packed.shape[1]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    return hq // hkv


def rotation_on(kv, device: torch.device) -> torch.Tensor:
    """The rotation matrix Pi on the query's device."""
    pi = kv.rotation.matrix
    return pi if pi.device == device else pi.to(device)


def by_query_chunks(launch, query: torch.Tensor, kv, mask: torch.Tensor | None, scale: float | None, per: int,
                    out: torch.Tensor | None = None, **kw):
    """`launch` of `per` queries at a time (the queries are the last n positions: a chunk's causal mask is made where
    none is given; a mask's rows are cut per chunk). None where a launch declines (it does so at the first: every
    chunk has the same layout)."""
    b, hq, n, d = query.shape
    t = int(kv.length)
    out = output(query, out)
    keys = torch.arange(t, device=query.device) if mask is None else None
    for i in range(0, n, per):
        j = min(n, i + per)
        if mask is None:  # query i + r sits at position t - n + i + r
            m = (keys <= torch.arange(t - n + i, t - n + j, device=query.device)[:, None])[None, None]
        else:
            m = mask[..., i:j, :] if mask.dim() >= 2 and mask.shape[-2] == n else mask
        if launch(query[:, :, i:j], kv, m, scale, out=out[:, i:j], **kw) is None:
            return None
    return out
