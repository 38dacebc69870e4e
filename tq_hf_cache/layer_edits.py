"""What generate does to a `TurboQuantLayer` besides updating it (a part of it, by concern): crop (assisted
decoding, contrastive search), batch reorder / repeat / select (beam search), offload and prefetch."""

from __future__ import annotations

import torch

from ._compat import IS_V5


class LayerEdits:
    """Crop, batch edits and offloading of `TurboQuantLayer` (state: see `TurboQuantLayer._clear`)."""

    def crop(self, max_length: int) -> None:
        """Negative: remove that many newest tokens; positive: keep the first `max_length` tokens.

        Zero follows the installed transformers: a no-op on 5.x (where generate calls `crop(-rejected)`, which is
        `crop(0)` when every candidate was accepted), "keep 0 tokens" on 4.x (where crop takes a length).
        """
        if not self.is_initialized:
            return
        self._settle()
        seq = self.get_seq_length()
        if max_length < 0 or (max_length == 0 and IS_V5):
            target = seq - abs(max_length)
        else:
            target = max_length
        if target >= seq:
            return
        self._truncate(max(target, 0))
        self.cumulative_length = max(target, 0)

    def _truncate(self, stored: int) -> None:
        """Keep the oldest `stored` of the tokens this layer holds."""
        lq = self.k_buf.length
        if stored >= lq:
            self._rlen = min(self._rlen, stored - lq)
        else:
            for buf in self._buffers():
                buf.truncate(stored)
            self._rlen = 0
        self._slen = min(self._slen, stored)

    def _map_batch(self, fn) -> None:
        if not self.is_initialized:
            return
        self._settle()
        for buf in self._buffers():
            buf.map_batch(fn)
        self._rk, self._rv = fn(self._rk), fn(self._rv)
        self._sk, self._sv = fn(self._sk), fn(self._sv)
        if self._mu is not None:
            self._mu = fn(self._mu)
        self.batch = self._rk.shape[0]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        idx = beam_idx.to(self.device) if self.is_initialized else beam_idx
        self._map_batch(lambda t: t.index_select(0, idx))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices.to(t.device) if isinstance(indices, torch.Tensor) else indices])

    def offload(self) -> None:
        if self.is_initialized:
            self._settle()
            for buf in self._buffers():
                buf.to("cpu")
            self._rk, self._rv = self._rk.to("cpu", non_blocking=True), self._rv.to("cpu", non_blocking=True)
            self._sk, self._sv = self._sk.to("cpu", non_blocking=True), self._sv.to("cpu", non_blocking=True)
            if self._mu is not None:
                self._mu = self._mu.to("cpu", non_blocking=True)

    def prefetch(self) -> None:
        if self.is_initialized and self._rk.device != self.device:
            for buf in self._buffers():
                buf.to(self.device)
            self._rk, self._rv = self._rk.to(self.device, non_blocking=True), self._rv.to(self.device, non_blocking=True)
            self._sk, self._sv = self._sk.to(self.device, non_blocking=True), self._sv.to(self.device, non_blocking=True)
            if self._mu is not None:
                self._mu = self._mu.to(self.device, non_blocking=True)
