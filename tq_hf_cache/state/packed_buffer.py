"""`PackedBuffer`: one kind's packed codes and norms of a layer, append-only, grown in blocks of GROW_TOKENS."""

from __future__ import annotations

import torch

from ..quant.packing import packed_bytes

GROW_TOKENS = 256


class PackedBuffer:
    """Packed indices (B, H, capacity, nbytes) and norms (B, H, capacity); tokens [start, start + length) are live.

    `pending`: a `norm_check.NormCheck` of the last quantize call not settled yet; any use of the norms (reading,
    moving, copying or pickling the buffer) settles it first."""

    pending = None

    def __init__(self, batch: int, heads: int, dim: int, bits: int, norm_dtype: torch.dtype, device: torch.device):
        self.dim, self.bits = dim, bits
        self.nbytes_per_vec = packed_bytes(dim, bits)
        self.packed = torch.empty(batch, heads, 0, self.nbytes_per_vec, dtype=torch.uint8, device=device)
        self._norms = torch.empty(batch, heads, 0, dtype=norm_dtype, device=device)
        self.start = 0
        self.length = 0

    @property
    def norms(self) -> torch.Tensor:
        if self.pending is not None:
            self.pending.settle()
        return self._norms

    @norms.setter
    def norms(self, value: torch.Tensor) -> None:
        if self.pending is not None:
            self.pending.settle()
        self._norms = value

    def raw_norms(self) -> torch.Tensor:
        """The norms without settling a pending check (for the check itself)."""
        return self._norms

    def widen_norms(self) -> None:
        """Store the norms in float32 from now on (the stored ones convert exactly)."""
        self._norms = self._norms.float()

    def __getstate__(self) -> dict:
        if self.pending is not None:
            self.pending.settle()
        return dict(self.__dict__)

    def __setstate__(self, state: dict) -> None:
        if "norms" in state:  # pickled before the norms became a property
            state["_norms"] = state.pop("norms")
        self.__dict__.update(state)

    @property
    def capacity(self) -> int:
        return self.packed.shape[2]

    def reserve(self, extra: int) -> None:
        """Make room for `extra` more tokens at the end, growing by chunks; old data is copied, not re-quantized."""
        need = self.start + self.length + extra
        if need <= self.capacity:
            return
        if self.start and self.length + extra <= self.capacity:  # compact a sliding buffer in place of growing
            self._move(self.packed, self.norms)
            return
        live = self.length + extra
        # 1 to GROW_TOKENS spare slots: re-copying the packed bytes every 256 decode steps costs little,
        # proportional headroom would cost context length
        cap = (live // GROW_TOKENS + 1) * GROW_TOKENS
        b, h, _, nb = self.packed.shape
        packed = torch.empty(b, h, cap, nb, dtype=torch.uint8, device=self.packed.device)
        norms = torch.empty(b, h, cap, dtype=self.norms.dtype, device=self.norms.device)
        self._move(packed, norms)

    def _move(self, packed: torch.Tensor, norms: torch.Tensor) -> None:
        live = slice(self.start, self.start + self.length)
        p, n = self.packed[:, :, live].clone(), self.norms[:, :, live].clone()
        packed[:, :, : self.length].copy_(p)
        norms[:, :, : self.length].copy_(n)
        self.packed, self.norms, self.start = packed, norms, 0

    def append_slots(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the next n slots; the caller fills them, then they count as live."""
        self.reserve(n)
        at = self.start + self.length
        self.length += n
        return self.packed[:, :, at : at + n], self.norms[:, :, at : at + n]

    def live(self) -> tuple[torch.Tensor, torch.Tensor]:
        s = slice(self.start, self.start + self.length)
        return self.packed[:, :, s], self.norms[:, :, s]

    def drop_front(self, n: int) -> None:
        n = min(n, self.length)
        self.start += n
        self.length -= n

    def truncate(self, length: int) -> None:
        self.length = min(self.length, max(length, 0))

    def map_batch(self, fn) -> None:
        self.packed, self.norms = fn(self.packed), fn(self.norms)

    def to(self, device) -> None:
        self.packed, self.norms = self.packed.to(device, non_blocking=True), self.norms.to(device, non_blocking=True)

    def nbytes(self) -> int:
        return self.packed.numel() + self.norms.numel() * self.norms.element_size()
