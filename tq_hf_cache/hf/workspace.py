"""The one dequantization workspace per device, shared by every layer of a cache.

Layers dequantize their packed history into it right before attention, so between steps the cache holds
only packed buffers, residual windows and this buffer, never one full-precision copy per layer.
"""

from __future__ import annotations

import torch


class Workspace:
    """Flat buffers keyed by (device, dtype), carved into contiguous (B, H, T, D) key and value views."""

    def __init__(self, headroom_tokens: int = 256):
        self.headroom_tokens = headroom_tokens
        self._buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def views(
        self, batch: int, heads: int, length: int, dim: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Key and value views of shape (batch, heads, length, dim); their content is the caller's to fill.

        They stay valid until the next call for the same device and dtype, which may overwrite them: attention
        must consume them first, as every transformers attention function does within the layer.
        """
        n = batch * heads * length * dim
        key = (torch.device(device), dtype)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < 2 * n:
            spare = max(self.headroom_tokens, length // 8)
            self._buffers[key] = buf = None  # free the old buffer before the new one is allocated
            buf = torch.empty(2 * batch * heads * (length + spare) * dim, dtype=dtype, device=device)
            self._buffers[key] = buf
        return buf[:n].view(batch, heads, length, dim), buf[n : 2 * n].view(batch, heads, length, dim)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def clear(self) -> None:
        self._buffers.clear()
