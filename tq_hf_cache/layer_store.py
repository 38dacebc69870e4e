"""How a `TurboQuantLayer` stores tokens (a part of it, by concern): the residual window, whose overflow is
quantized once into the packed buffers; the exact copies of the sink tokens; the key centring's mean
(`rope.key_mean`); the norms' float16 range checked without waiting for the GPU (`norm_check`)."""

from __future__ import annotations

import torch

from . import ops
from .norm_check import NormCheck, largest_finite_norm
from .rope import key_mean


class LayerStore:
    """The write path of `TurboQuantLayer` (state: see `TurboQuantLayer._clear`)."""

    def _settle(self) -> None:
        """Quantize what a decode step left beyond the residual window, and drop what left a sliding window: the
        state a dense step's `_push` leaves."""
        lr = self._rlen
        drop = self._drop_old(lr)
        if drop == 0 and lr <= self.residual_capacity:
            return
        self._store_window(self.res_k[:, :, drop:], self.res_v[:, :, drop:])

    def _reserve_residual(self, tokens: int) -> None:
        """Grow the residual buffers to hold `tokens`: doubling up to `residual_capacity`, then exactly what a
        decode step that has not settled yet needs (at most MAX_FUSED_QUERIES more)."""
        cap = self._rk.shape[2]
        if tokens <= cap:
            return
        new_cap = max(tokens, min(2 * cap, self.residual_capacity))
        rk = self._rk.new_empty(self.batch, self.heads, new_cap, self.head_dim)
        rv = self._rv.new_empty(self.batch, self.heads, new_cap, self.head_dim)
        rk[:, :, : self._rlen].copy_(self.res_k)
        rv[:, :, : self._rlen].copy_(self.res_v)
        self._rk, self._rv = rk, rv

    def _push(self, key_states: torch.Tensor, value_states: torch.Tensor, fp=None) -> None:
        """Append the new tokens to the residual window; quantize the oldest ones once it overflows. fp: the
        caller's [residual | new] keys and values, when it already has them.

        The cache keeps values, not autograd history: gradients reach only the tokens of the current call."""
        key_states, value_states = key_states.detach(), value_states.detach()
        n, lr = key_states.shape[2], self._rlen
        drop = self._drop_old(lr + n)
        if drop == 0 and lr + n <= self.residual_capacity:  # the common decode step: two small copies
            self._reserve_residual(lr + n)
            self._rk[:, :, lr : lr + n].copy_(key_states)
            self._rv[:, :, lr : lr + n].copy_(value_states)
            self._rlen = lr + n
            return
        if fp is None:
            fp = self._with_residual(key_states, value_states)
        self._store_window(fp[0][:, :, drop:].detach(), fp[1][:, :, drop:].detach())

    def _store_window(self, fp_k: torch.Tensor, fp_v: torch.Tensor) -> None:
        """Keep the newest `residual_length` of these full-precision tokens as the residual window and quantize
        the older ones. The window moves to new buffers: the inputs may be views of the old ones, and so may the
        unread LazyKVs of a decode step (transformers' offloading settles a layer before its attention runs)."""
        overflow = fp_k.shape[2] - self.residual_length
        if overflow > 0:
            self._quantize_append(fp_k[:, :, :overflow], fp_v[:, :, :overflow], self.cumulative_length - fp_k.shape[2])
            fp_k, fp_v = fp_k[:, :, overflow:], fp_v[:, :, overflow:]
        keep = fp_k.shape[2]
        cap = max(keep, self._rk.shape[2])
        rk = fp_k.new_empty(self.batch, self.heads, cap, self.head_dim)
        rv = fp_v.new_empty(self.batch, self.heads, cap, self.head_dim)
        rk[:, :, :keep].copy_(fp_k)
        rv[:, :, :keep].copy_(fp_v)
        self._rk, self._rv, self._rlen = rk, rv, keep

    def _drop_old(self, fp_tokens: int) -> int:
        """Full-attention layers keep everything; sliding layers drop what left the window (see there)."""
        return 0

    def _quantize_append(self, k: torch.Tensor, v: torch.Tensor, pos0: int) -> None:
        """Quantize k, v (absolute positions pos0, pos0 + 1, ...) into the packed buffers."""
        n = k.shape[2]
        kq = k
        if self.rope is not None:  # pre-RoPE key centring: quantize k - R(t) mu
            pos = torch.arange(pos0, pos0 + n, device=k.device)
            if self._mu is None:
                first = max(self.sink_tokens - pos0, 0)  # the sinks stay exact: they would pull the mean
                first = first if first < n else 0
                self._mu = key_mean(self.rope, k[:, :, first:], pos[first:])  # one huge key cannot take it
            kq = k.float() - self.rope.apply(self._mu, pos)
        self._settle_norm_check()
        biggest = largest_finite_norm(kq, v) if self.norm_dtype == torch.float16 else None
        if self._slen < self.sink_tokens:
            # the sequence's first tokens are being quantized: keep exact copies of them (attention sinks). While
            # they sit in the residual window they are exact anyway, so a short prompt holds no second copy.
            take = min(self.sink_tokens - self._slen, n)
            self._sk = torch.cat([self._sk[:, :, : self._slen], k[:, :, :take]], dim=2)
            self._sv = torch.cat([self._sv[:, :, : self._slen], v[:, :, :take]], dim=2)
            self._slen += take
        bufs = self._buffers()  # keys (part 0, the other parts), values
        slots = [b.append_slots(n) for b in bufs]
        # under a pending check the quantize writes float32 norms to the side, stored as float16 after it
        outs = slots if biggest is None else [(p, torch.empty(nm.shape, dtype=torch.float32, device=nm.device))
                                               for p, nm in slots]
        (pk, nk), (pv, nv) = outs[0], outs[-1]
        if self.key_split is not None:
            ops.quantize_split_into(kq, self.key_split, outs[:-1])
            ops.quantize_into(v, self.rotation, self.v_codebook, pv, nv)
        elif kq is k:
            ops.quantize_kv_into(k, v, self.rotation, self.k_codebook, self.v_codebook, pk, nk, pv, nv)
        else:
            ops.quantize_into(kq, self.rotation, self.k_codebook, pk, nk)
            ops.quantize_into(v, self.rotation, self.v_codebook, pv, nv)
        if biggest is not None:
            for (_, stored), (_, exact) in zip(slots, outs):
                stored.copy_(exact)
            NormCheck(biggest, self, [(b, b.start + b.length - n, exact) for b, (_, exact) in zip(bufs, outs)])

    def __getstate__(self) -> dict:
        """A copy or pickle takes the layer as it will read: its norm check settled first (the check may widen the
        norms' dtype, which the layer's `norm_dtype` records)."""
        self._settle_norm_check()
        return dict(self.__dict__)

    def _settle_norm_check(self) -> None:
        """Settle the last quantize call's norm check (`norm_check`), if it is still pending."""
        for buf in self._buffers():
            if buf.pending is not None:
                buf.pending.settle()
