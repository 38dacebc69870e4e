"""What a TurboQuant cache layer holds, as tensors: `PackedKV` (and a static layer's `StaticKV`), the one object the
kernels, the torch reference and the attention exchange. (`attention.LazyKV` is what a dynamic layer's `update`
returns around it.)

`PackedKV` is the one object the kernels, the torch reference and the attention function exchange. A layer's
positions [0, length) are read as follows:
- [0, sinks): the exact copies in `sink_k` / `sink_v` (attention sinks);
- [sinks, exact_from): the packed codes and norms at slot = position;
- [exact_from, length): the exact copies in the window `window_k` / `window_v`.
A dynamic layer (`TurboQuantCache`) has host-int lengths and its window is the residual window (with a chunk's new
tokens after it), in order (slot = position - exact_from). A static layer (`TurboQuantStaticCache`) has its lengths
on the device (a captured CUDA graph replays them) and quantizes every position as it arrives; its window is a ring
buffer, position p at slot p % window size.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .codebook import Codebook
from .key_split import KeySplit
from .rope import KeyOffset
from .rotation import Rotation

MAX_FUSED_QUERIES = 16  # queries per step that the fused attention serves; longer ones (prefill chunks) get dense K/V
PACKED_ATTR = "turboquant_packed"  # the attribute that carries a PackedKV on the keys a layer returns


@dataclass(eq=False)
class PackedKV:
    """Args:
        k_packed, v_packed: (B, H, slots, bytes) uint8, one packed vector per position (slot = position).
        k_norms, v_norms: (B, H, slots) float16 or float32.
        sink_k, sink_v: (B, H, >= sinks, D): the first `sinks` slots are exact copies of positions [0, sinks).
        window_k, window_v: (B, H, window, D): exact copies of positions [exact_from, length) (see the module
            docstring). None in the PackedKV a static layer's window carries (the window is the keys / values it
            returned).
        length: positions held; exact_from: the first position the window holds. Host ints (dynamic layer) or ()
            int64 tensors on the device (static layer).
        rotation, k_codebook, v_codebook: the quantizer (on the device).
        sinks: how many sink positions there are (may be 0).
        k_quantizer, v_quantizer: their ids in `tq_hf_cache.kernels.ops` (custom ops take ids, not objects).
        scratch, counters: the fused kernel's split-K scratch (float32) and arrival counters (int32, zero); None
            lets the kernel use its own per-device ones (eager use only).
        key_offset: a centred dynamic layer's `rope.KeyOffset`: its packed keys are k - R(t) mu, so every read adds
            R(t) mu back (to dequantized keys, or q . R(t) mu to their scores); None when the keys are not centred.
        key_split: a dynamic layer's `key_split.KeySplit` when its keys are split; None otherwise.
        key_parts: then, per part, (packed (B, H, slots, bytes), norms (B, H, slots)); part 0's are k_packed / k_norms.
        norm_guard: a static layer's norm check, (2,) float32 (see `static_parts`); None in a dynamic layer's.
    """

    k_packed: torch.Tensor
    k_norms: torch.Tensor
    v_packed: torch.Tensor
    v_norms: torch.Tensor
    sink_k: torch.Tensor
    sink_v: torch.Tensor
    window_k: torch.Tensor | None
    window_v: torch.Tensor | None
    length: torch.Tensor | int
    exact_from: torch.Tensor | int
    rotation: Rotation
    k_codebook: Codebook
    v_codebook: Codebook
    sinks: int
    k_quantizer: int
    v_quantizer: int
    scratch: torch.Tensor | None = None
    counters: torch.Tensor | None = None
    key_offset: KeyOffset | None = None
    key_split: KeySplit | None = None
    key_parts: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None = None
    norm_guard: torch.Tensor | None = None

    @property
    def capacity(self) -> int:
        return self.k_packed.shape[2]

    @property
    def static(self) -> bool:
        """Whether the lengths live on the device (a static layer: every shape fixed, the window wraps)."""
        return isinstance(self.length, torch.Tensor)

    def rows(self, start: int, stop: int) -> PackedKV:
        """The same state restricted to batch rows [start, stop) (views)."""
        pick = {name: getattr(self, name)[start:stop] for name in
                ("k_packed", "k_norms", "v_packed", "v_norms", "sink_k", "sink_v", "window_k", "window_v")
                if getattr(self, name) is not None}
        if self.key_offset is not None:
            pick["key_offset"] = self.key_offset.rows(start, stop)
        if self.key_parts is not None:
            pick["key_parts"] = tuple((p[start:stop], n[start:stop]) for p, n in self.key_parts)
        return replace(self, **pick)


_ALIGN = 16  # bytes: every part of a static layer's buffer starts on this boundary


def static_parts(batch: int, heads: int, capacity: int, dim: int, key_bytes: int, value_bytes: int, sinks: int,
                 norm_dtype: torch.dtype, dtype: torch.dtype, key_part_bytes: tuple[int, ...] = (),
                 key_mean: bool = False) -> tuple[list[tuple[str, torch.dtype, tuple, int]], int]:
    """([(name, dtype, shape, byte offset)], total bytes) of a static layer's one uint8 buffer: the packed keys and
    values, their norms, the exact copies of the sinks (one row more than `sinks`, so never empty), the lengths
    (length, exact_from) as int64 and the norm check "norm_guard", (2,) float32: the largest finite key / value norm
    that a compiled append stored or read, and the largest that eager appends stored since the layer last settled
    its check (float16 norms past 65504 are inf until then; `static_cache` reads it). Split keys: k_packed / k_norms
    hold part 0 (key_bytes a row), and parts 1, 2, ... (key_part_bytes a row) follow as k1_packed / k1_norms, ....
    Centred keys (`key_mean`): the pre-RoPE key mean (B, H, 1, D) float32 as key_mean."""
    extra = [(f"k{p}_{kind}", dt, shape) for p, nb in enumerate(key_part_bytes, start=1)
             for kind, dt, shape in (("packed", torch.uint8, (batch, heads, capacity, nb)),
                                     ("norms", norm_dtype, (batch, heads, capacity)))]
    parts, off = [], 0
    for name, dt, shape in (
        ("k_packed", torch.uint8, (batch, heads, capacity, key_bytes)),
        ("v_packed", torch.uint8, (batch, heads, capacity, value_bytes)),
        ("k_norms", norm_dtype, (batch, heads, capacity)),
        ("v_norms", norm_dtype, (batch, heads, capacity)),
        ("sink_k", dtype, (batch, heads, sinks + 1, dim)),
        ("sink_v", dtype, (batch, heads, sinks + 1, dim)),
        ("lengths", torch.int64, (2,)),
        ("norm_guard", torch.float32, (2,)),
        *extra,
        *([("key_mean", torch.float32, (batch, heads, 1, dim))] if key_mean else []),
    ):
        parts.append((name, dt, shape, off))
        off += -(-_nbytes(dt, shape) // _ALIGN) * _ALIGN
    return parts, off


def _nbytes(dtype: torch.dtype, shape: tuple) -> int:
    n = dtype.itemsize
    for s in shape:
        n *= s
    return n


@dataclass(eq=False)
class StaticKV:
    """What a static layer's window (the keys its `update` returns) carries for the attention: the layer's one uint8
    buffer and how to read it. One buffer instead of eight tensors keeps a compiled step's guards and CUDA-graph
    input checks to three tensors per layer (this buffer and the two windows), near `StaticCache`'s two.

    Args:
        store: the uint8 buffer laid out by `static_parts`.
        capacity: positions held at most.
        sinks: the first positions, kept exact.
        norm_dtype: the norms' dtype name ("float16" or "float32").
        k_quantizer: the `tq_hf_cache.kernels.ops` id of the keys' rotation and codebook (the layer owns them; the id,
            held weakly, is made again in each process the layer is unpickled in).
        v_quantizer: the same for the values.
        scratch: the fused kernel's split-K scratch, shared by a cache's layers.
        counters: the fused kernel's arrival counters, shared likewise.
        key_split: the `tq_hf_cache.kernels.ops` id of the layer's `KeySplit` when its keys are split, else -1.
        key_rope: the `tq_hf_cache.kernels.ops` id of the layer's `RopeAngles` when its keys are centred, else -1.
    """

    store: torch.Tensor
    capacity: int
    sinks: int
    norm_dtype: str
    k_quantizer: int
    v_quantizer: int
    scratch: torch.Tensor
    counters: torch.Tensor
    key_split: int = -1
    key_rope: int = -1


def static_views(store: torch.Tensor, window_k: torch.Tensor, capacity: int, sinks: int, norm_dtype: torch.dtype,
                 key_bytes: int, value_bytes: int, key_part_bytes: tuple[int, ...] = (),
                 key_mean: bool = False) -> dict[str, torch.Tensor]:
    """Views of a static layer's buffer by part name (see `static_parts`), plus "length" and "exact_from" (0-d);
    batch, heads, head dim and dtype are the window's."""
    b, h, _, d = window_k.shape
    parts, total = static_parts(b, h, capacity, d, key_bytes, value_bytes, sinks, norm_dtype, window_k.dtype,
                                key_part_bytes, key_mean)
    if store.dtype != torch.uint8 or store.dim() != 1 or store.numel() != total:
        raise ValueError(f"a static layer's buffer must be uint8 of {total} bytes for this layout, got "
                         f"{store.dtype} of shape {tuple(store.shape)}")
    out = {}
    for name, dt, shape, off in parts:
        out[name] = store[off: off + _nbytes(dt, shape)].view(dt).view(shape)
    out["length"], out["exact_from"] = out["lengths"][0], out["lengths"][1]
    return out


def packed_source(key: torch.Tensor) -> PackedKV | StaticKV | None:
    """What a TurboQuant layer's returned keys carry (`PackedKV`, or a static layer's `StaticKV`), else None."""
    return getattr(key, PACKED_ATTR, None)
