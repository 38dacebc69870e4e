"""How a `TurboQuantLayer` is read (a part of it, by concern): as a `PackedKV` of views for the fused attention,
as `LazyKV`s filled on demand, or dequantized whole into [history | residual | new]."""

from __future__ import annotations

import torch

from . import ops
from .attention import lazy_pair
from .packed_kv import PackedKV
from .rope import KeyOffset


class LayerRead:
    """The read path of `TurboQuantLayer` (state: see `TurboQuantLayer._clear`)."""

    def _with_residual(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """[residual | new] keys and values (the new ones themselves when the window is empty)."""
        if not self._rlen:
            return key_states, value_states
        return torch.cat([self.res_k, key_states], dim=2), torch.cat([self.res_v, value_states], dim=2)

    def _lazy(self, kv: PackedKV):
        """LazyKVs of kv, filled (whole or by batch rows) into the shared workspace."""
        shape = (self.batch, self.heads, kv.length, self.head_dim)

        def alloc(rows: int):
            return self.workspace.views(rows, self.heads, kv.length, self.head_dim, self.dtype, self.device)

        return lazy_pair(kv, shape, self.dtype, alloc, self.fused_sdpa)

    def _key_offset(self, held: int) -> KeyOffset | None:
        """The offset of the packed keys, when they are centred; `held`: the positions after packed slot 0 that the
        caller reads (packed, then exact), the newest ending at `cumulative_length`."""
        if self._mu is None:
            return None
        return KeyOffset(self._mu, self.rope, self.cumulative_length - held)

    def packed_kv(self, ring_k: torch.Tensor | None = None, ring_v: torch.Tensor | None = None) -> PackedKV:
        """What the layer holds, as a `PackedKV` of views (valid until the next update; no quantizer ids: they
        serve the static layers' custom ops). ring_k / ring_v: the exact tokens after the packed ones, when they
        are not the residual window (a chunk step's [residual | new])."""
        pk, nk = self.k_buf.live()
        pv, nv = self.v_buf.live()
        lq = self.k_buf.length
        if ring_k is None:
            ring_k, ring_v = self.res_k, self.res_v
        return PackedKV(
            pk, nk, pv, nv, self._sk, self._sv, ring_k, ring_v, lq + ring_k.shape[2], lq, self.rotation,
            self.k_codebook, self.v_codebook, self.exact_sinks, -1, -1,
            key_offset=self._key_offset(lq + ring_k.shape[2]), key_split=self.key_split,
            key_parts=tuple(b.live() for b in self._key_buffers()) if self.key_split is not None else None,
        )

    def _assemble(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """[dequantized history | residual | new] for this step's attention."""
        lq, lr, n = self.k_buf.length, self._rlen, key_states.shape[2]
        if lq == 0:
            if lr == 0:
                return key_states, value_states
            return torch.cat([self.res_k, key_states], dim=2), torch.cat([self.res_v, value_states], dim=2)
        # autograd saves what attention reads: under grad the output must not be a workspace that the next layer
        # overwrites, and KV-sharing producers' outputs are kept by later layers
        if self.private_output or (torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad)):
            wk = key_states.new_empty(self.batch, self.heads, lq + lr + n, self.head_dim)
            wv = value_states.new_empty(self.batch, self.heads, lq + lr + n, self.head_dim)
        else:
            wk, wv = self.workspace.views(self.batch, self.heads, lq + lr + n, self.head_dim, self.dtype, self.device)
        pv, nv = self.v_buf.live()
        self._dequantize_keys(wk[:, :, :lq])
        ops.dequantize_into(pv, nv, self.rotation, self.v_codebook, wv[:, :, :lq])
        if self._mu is not None:
            self._key_offset(lq + lr + n).add_to(wk[:, :, :lq], 0)
        ns = self.exact_sinks
        if ns:
            wk[:, :, :ns].copy_(self._sk[:, :, :ns])
            wv[:, :, :ns].copy_(self._sv[:, :, :ns])
        if lr:
            wk[:, :, lq : lq + lr].copy_(self.res_k)
            wv[:, :, lq : lq + lr].copy_(self.res_v)
        wk[:, :, lq + lr :].copy_(key_states)
        wv[:, :, lq + lr :].copy_(value_states)
        return wk, wv

    def _materialize(self, kind: str) -> torch.Tensor | None:
        self._settle()
        if not self.is_initialized:
            return None
        buf, cb, res = (self.k_buf, self.k_codebook, self.res_k) if kind == "key" else (self.v_buf, self.v_codebook, self.res_v)
        packed, norms = buf.live()
        out = res.new_empty(self.batch, self.heads, buf.length + res.shape[2], self.head_dim)
        if buf.length:
            if kind == "key":
                self._dequantize_keys(out[:, :, : buf.length])
            else:
                ops.dequantize_into(packed, norms, self.rotation, cb, out[:, :, : buf.length])
            if kind == "key" and self._mu is not None:
                self._key_offset(out.shape[2]).add_to(out[:, :, : buf.length], 0)
            ns = self.exact_sinks
            out[:, :, :ns].copy_((self._sk if kind == "key" else self._sv)[:, :, :ns])
        out[:, :, buf.length :].copy_(res)
        return out

    def _dequantize_keys(self, out: torch.Tensor) -> None:
        """The packed keys (without their centring offset) into out (B, H, quantized tokens, D)."""
        if self.key_split is not None:
            ops.dequantize_split_into([b.live() for b in self._key_buffers()], self.key_split, out)
        else:
            ops.dequantize_into(*self.k_buf.live(), self.rotation, self.k_codebook, out)
