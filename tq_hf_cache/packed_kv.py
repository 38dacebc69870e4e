"""`PackedKV`: the tensors a static TurboQuant layer attends over, the one thing its kernels, the torch reference
and the attention function exchange.

Positions [0, length) are held; every one of them is quantized into the packed buffers at its slot. Positions
[exact_from, length) also sit exact in a ring buffer (slot = position % ring size); the first `sinks` positions
have exact copies (attention sinks). Attention reads each position once: the exact copy where there is one,
else the packed one. The ring itself is not a field: it is what the layer returns as keys and values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .codebook import Codebook
from .rotation import Rotation


@dataclass(eq=False)
class PackedKV:
    """Args:
        k_packed, v_packed: (B, H, capacity, bytes) uint8, one packed vector per position.
        k_norms, v_norms: (B, H, capacity) float16 or float32.
        sink_k, sink_v: (B, H, >= sinks, D): the first `sinks` slots are exact copies of positions [0, sinks).
            (Whole buffers, not views: a compiled graph must not take two aliasing inputs.)
        length: () int64 on the device, positions held.
        exact_from: () int64 on the device, the first position the ring holds exactly.
        rotation, k_codebook, v_codebook: the quantizer (on the device).
        sinks: how many sink positions there are (may be 0).
        k_quantizer, v_quantizer: their ids in `tq_hf_cache.ops` (custom ops take ids, not objects).
        scratch, counters: the fused kernel's split-K scratch (float32) and arrival counters (int32, zero).
    """

    k_packed: torch.Tensor
    k_norms: torch.Tensor
    v_packed: torch.Tensor
    v_norms: torch.Tensor
    sink_k: torch.Tensor
    sink_v: torch.Tensor
    length: torch.Tensor
    exact_from: torch.Tensor
    rotation: Rotation
    k_codebook: Codebook
    v_codebook: Codebook
    sinks: int
    k_quantizer: int
    v_quantizer: int
    scratch: torch.Tensor
    counters: torch.Tensor

    @property
    def capacity(self) -> int:
        return self.k_packed.shape[2]


def ring_positions(length: torch.Tensor, exact_from: torch.Tensor, ring: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(a position for each ring slot, whether the slot is live), all on the device (no host sync).

    Slot j holds the newest position p < length with p % ring == j; it is live when p >= exact_from. A slot with
    no such p >= 0 gets position j (>= length: a future one). The positions are distinct (each is j modulo ring),
    so a scatter of the ring by them never collides; a dead slot's position must be written with its own value.
    """
    j = torch.arange(ring, device=length.device)
    last = length - 1
    p = last - torch.remainder(last - j, ring)
    return torch.where(p >= 0, p, j), p >= exact_from


def overlay_exact(full: torch.Tensor, ring: torch.Tensor, sinks: torch.Tensor, length: torch.Tensor,
                  exact_from: torch.Tensor) -> torch.Tensor:
    """Write the exact copies (sinks, then the live ring slots) over `full` (B, H, capacity, D), in place.

    Positions at or past `length` may receive stale values; attention masks them."""
    s = sinks.shape[2]
    if s:
        full[:, :, :s].copy_(sinks)
    pos, live = ring_positions(length, exact_from, ring.shape[2])
    vals = torch.where(live[None, None, :, None], ring.to(full.dtype), full.index_select(2, pos))
    full.index_copy_(2, pos, vals)
    return full
