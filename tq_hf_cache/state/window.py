"""`Window`: the exact copies of a growable layer's newest tokens, oldest first."""

from __future__ import annotations

import torch


class Window:
    """Key and value buffers (B, H, capacity, D) whose first `length` slots are live (`keys`, `values`: views)."""

    def __init__(self, like: torch.Tensor):
        self.k = like.new_empty(*like.shape[:2], 0, like.shape[3])
        self.v = self.k.clone()
        self.length = 0

    @property
    def keys(self) -> torch.Tensor:
        return self.k[:, :, : self.length]

    @property
    def values(self) -> torch.Tensor:
        return self.v[:, :, : self.length]

    def reserve(self, tokens: int, most: int) -> None:
        """Grow the buffers to hold `tokens`: doubling up to `most`, then exactly `tokens`."""
        cap = self.k.shape[2]
        if tokens <= cap:
            return
        new_cap = max(tokens, min(2 * cap, most))
        k, v = self.k.new_empty(*self.k.shape[:2], new_cap, self.k.shape[3]), self.v.new_empty(
            *self.v.shape[:2], new_cap, self.v.shape[3])
        k[:, :, : self.length].copy_(self.keys)
        v[:, :, : self.length].copy_(self.values)
        self.k, self.v = k, v

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor, most: int) -> None:
        n, at = key_states.shape[2], self.length
        self.reserve(at + n, most)
        self.k[:, :, at : at + n].copy_(key_states)
        self.v[:, :, at : at + n].copy_(value_states)
        self.length = at + n

    def replace(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Hold exactly these tokens, in new buffers (the inputs may be views of the old ones, and so may the
        unread LazyKVs of a decode step) of at least the old capacity."""
        keep = keys.shape[2]
        cap = max(keep, self.k.shape[2])
        k = keys.new_empty(*keys.shape[:2], cap, keys.shape[3])
        v = values.new_empty(*values.shape[:2], cap, values.shape[3])
        k[:, :, :keep].copy_(keys)
        v[:, :, :keep].copy_(values)
        self.k, self.v, self.length = k, v, keep

    def drop_front(self, n: int) -> None:
        rest = self.length - n
        self.k[:, :, :rest] = self.k[:, :, n : self.length].clone()
        self.v[:, :, :rest] = self.v[:, :, n : self.length].clone()
        self.length = rest

    def map(self, fn) -> None:
        self.k, self.v = fn(self.k), fn(self.v)

    def nbytes(self) -> int:
        return (self.k.numel() + self.v.numel()) * self.k.element_size()
