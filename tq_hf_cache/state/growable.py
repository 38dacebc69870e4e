"""`GrowableState`: a layer state whose buffers grow with the sequence and whose lengths live on the host (the
allocation policy of `TurboQuantCache`).

Tokens enter the exact window; those pushed out of it are quantized once, appended to the packed buffers
(`PackedBuffer`, grown in blocks) and never re-quantized. A decode step may leave the window up to
`FLUSH_BLOCK` tokens longer than `residual_length`: the overflow is quantized at the next `settle`, one quantize
launch per FLUSH_BLOCK steps. The first `sink_tokens` positions keep exact copies (attention sinks), written over
their dequantized slots. A sliding layer sets `keep`: tokens past it leave from the front.
"""

from __future__ import annotations

import torch

from ..kernels import ops
from ..quant.norm_check import NormCheck, largest_finite
from ..quant.packed_kv import PackedKV
from ..quant.rope import KeyOffset, key_mean
from .layer_state import LayerState, check_tensors, part_names
from .packed_buffer import PackedBuffer
from .window import Window

FLUSH_BLOCK = 32


class GrowableState(LayerState):
    """Packed buffers, the exact `window`, sink copies and key mean of one layer; see the
    module docstring and `LayerState`. `seen`: positions the layer has taken (a sliding layer holds fewer)."""

    def __init__(self, quantizers, *, residual_length: int, **kwargs):
        super().__init__(quantizers, **kwargs)
        self.residual_length = residual_length
        self.keep: int | None = None  # a sliding layer: the most tokens it holds
        self.seen = 0
        b, h, d, dev = self.batch, self.heads, self.head_dim, self.device
        bufs = [PackedBuffer(b, h, dim, bits, self.norm_dtype, dev) for _, dim, bits in self.part_dims()]
        self.k_buf, self.k_more, self.v_buf = bufs[0], bufs[1:-1], bufs[-1]
        # window and sink copies grow with the sequence: a short prompt holds no more than it needs
        self.window = Window(torch.empty(b, h, 0, d, dtype=self.dtype, device=dev))
        self._sk, self._sv = self.window.k.clone(), self.window.v.clone()
        self._slen = 0  # sink copies kept: the quantized ones among the first sink_tokens
        self._mu: torch.Tensor | None = None  # pre-RoPE key mean (B, H, 1, D) float32, from the first quantized block

    # ---- what it holds -----------------------------------------------------------------------------------------

    @property
    def quantized(self) -> int:
        return self.k_buf.length

    @property
    def window_capacity(self) -> int:
        return self.residual_length + min(FLUSH_BLOCK, self.residual_length)

    @property
    def exact_sinks(self) -> int:
        """Sink positions whose packed slots the exact copies overwrite (those already quantized)."""
        return min(self._slen, self.k_buf.length)

    def key_buffers(self) -> list[PackedBuffer]:
        return [self.k_buf, *self.k_more]

    def buffers(self) -> list[PackedBuffer]:
        """Every packed buffer (they hold the same tokens): key parts, then values."""
        return [*self.key_buffers(), self.v_buf]

    # ---- the write path ----------------------------------------------------------------------------------------

    def settle(self) -> None:
        """Quantize what a decode step left beyond the window, and drop what left a sliding window."""
        w = self.window
        drop = self._drop_old(w.length)
        if drop == 0 and w.length <= self.window_capacity:
            return
        self._store_window(w.keys[:, :, drop:], w.values[:, :, drop:])

    def append_window(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Append tokens to the window as they are (a decode step: quantized at the next `settle`)."""
        self.window.append(key_states, value_states, self.window_capacity)

    def push(self, key_states: torch.Tensor, value_states: torch.Tensor, fp=None) -> None:
        """Append the new tokens to the window; quantize the oldest ones once it overflows. fp: the caller's
        [window | new] keys and values, when it already has them. The state keeps values, not autograd history."""
        key_states, value_states = key_states.detach(), value_states.detach()
        n, lr = key_states.shape[2], self.window.length
        drop = self._drop_old(lr + n)
        if drop == 0 and lr + n <= self.window_capacity:  # the common decode step: two small copies
            self.append_window(key_states, value_states)
            return
        if fp is None:
            fp = self.with_window(key_states, value_states)
        self._store_window(fp[0][:, :, drop:].detach(), fp[1][:, :, drop:].detach())

    def with_window(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """[window | new] keys and values (the new ones themselves when the window is empty)."""
        w = self.window
        if not w.length:
            return key_states, value_states
        return torch.cat([w.keys, key_states], dim=2), torch.cat([w.values, value_states], dim=2)

    def reserve_packed(self, tokens: int) -> None:
        for buf in self.buffers():
            buf.reserve(tokens)

    def _store_window(self, fp_k: torch.Tensor, fp_v: torch.Tensor) -> None:
        """Keep the newest `residual_length` of these exact tokens as the window and quantize the older ones. The
        window moves to new buffers: the inputs may be views of the old ones, and so may the unread LazyKVs of a
        decode step (transformers' offloading settles a layer before its attention runs)."""
        overflow = fp_k.shape[2] - self.residual_length
        if overflow > 0:
            self._quantize_append(fp_k[:, :, :overflow], fp_v[:, :, :overflow], self.seen - fp_k.shape[2])
            fp_k, fp_v = fp_k[:, :, overflow:], fp_v[:, :, overflow:]
        self.window.replace(fp_k, fp_v)

    def _drop_old(self, fp_tokens: int) -> int:
        """Drop tokens beyond `keep` from the packed front; return how many of the oldest exact tokens (window,
        then new) must go too."""
        if self.keep is None:
            return 0
        excess = self.k_buf.length + fp_tokens - self.keep
        if excess <= 0:
            return 0
        from_packed = min(excess, self.k_buf.length)
        for buf in self.buffers():
            buf.drop_front(from_packed)
        return excess - from_packed

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
        self.settle_norm_check()
        check = self.norm_dtype == torch.float16
        if self._slen < self.sink_tokens:
            # the first positions are being quantized: keep exact copies of them (while they sit in the window they
            # are exact anyway, so a short prompt holds no second copy)
            take = min(self.sink_tokens - self._slen, n)
            self._sk = torch.cat([self._sk[:, :, : self._slen], k[:, :, :take]], dim=2)
            self._sv = torch.cat([self._sv[:, :, : self._slen], v[:, :, :take]], dim=2)
            self._slen += take
        bufs = self.buffers()
        slots = [b.append_slots(n) for b in bufs]
        # under a pending check the quantize writes float32 norms to the side, stored as float16 after it
        outs = slots if not check else [(p, nm.new_empty(nm.shape, dtype=torch.float32)) for p, nm in slots]
        (pk, nk), (pv, nv) = outs[0], outs[-1]
        if self.key_split is not None:
            ops.quantize_split_into(kq, self.key_split, outs[:-1])
            ops.quantize_into(v, self.rotation, self.v_codebook, pv, nv)
        elif kq is k:
            ops.quantize_kv_into(k, v, self.rotation, self.k_codebook, self.v_codebook, pk, nk, pv, nv)
        else:
            ops.quantize_into(kq, self.rotation, self.k_codebook, pk, nk)
            ops.quantize_into(v, self.rotation, self.v_codebook, pv, nv)
        if check:  # the largest norm stored (a norm-correcting codebook stores more than the input's norm)
            for (_, stored), (_, exact) in zip(slots, outs):
                stored.copy_(exact)
            NormCheck(largest_finite([exact for _, exact in outs]), self,
                      [(b, b.start + b.length - n, exact) for b, (_, exact) in zip(bufs, outs)])

    def settle_norm_check(self) -> None:
        """Settle the last quantize call's norm check (`norm_check`), if it is still pending."""
        for buf in self.buffers():
            if buf.pending is not None:
                buf.pending.settle()

    def __getstate__(self) -> dict:
        """A copy or pickle takes the state as it will read: its norm check settled first."""
        self.settle_norm_check()
        return dict(self.__dict__)

    # ---- the read path -----------------------------------------------------------------------------------------

    def key_offset(self, held: int) -> KeyOffset | None:
        """The offset of the packed keys, when they are centred; `held`: the positions after packed slot 0 that the
        caller reads (packed, then exact), the newest ending at `seen`."""
        return None if self._mu is None else KeyOffset(self._mu, self.rope, self.seen - held)

    def view(self, window_k: torch.Tensor | None = None, window_v: torch.Tensor | None = None) -> PackedKV:
        """What the state holds, as a `PackedKV` of views (valid until the next write). window_k / window_v: the
        exact tokens after the packed ones, when they are not the window (a chunk step's [window | new])."""
        pk, nk = self.k_buf.live()
        pv, nv = self.v_buf.live()
        lq = self.k_buf.length
        if window_k is None:
            window_k, window_v = self.window.keys, self.window.values
        return PackedKV(
            pk, nk, pv, nv, self._sk, self._sv, window_k, window_v, lq + window_k.shape[2], lq, self.rotation,
            self.k_codebook, self.v_codebook, self.exact_sinks, -1, -1,
            key_offset=self.key_offset(lq + window_k.shape[2]), key_split=self.key_split,
            key_parts=tuple(b.live() for b in self.key_buffers()) if self.key_split is not None else None,
        )

    def dense_into(self, wk: torch.Tensor, wv: torch.Tensor, tail_k=None, tail_v=None) -> None:
        """[dequantized history | window | tail] into wk, wv (B, H, quantized + window + tail, D); either may be
        None (not wanted)."""
        lq, lr, ns = self.k_buf.length, self.window.length, self.exact_sinks
        for kind, out, sinks, window, tail in ((0, wk, self._sk, self.window.keys, tail_k),
                                               (1, wv, self._sv, self.window.values, tail_v)):
            if out is None:
                continue
            if lq and kind == 0:
                self._dequantize_keys(out[:, :, :lq])
                if self._mu is not None:
                    self.key_offset(out.shape[2]).add_to(out[:, :, :lq], 0)
            elif lq:
                ops.dequantize_into(*self.v_buf.live(), self.rotation, self.v_codebook, out[:, :, :lq])
            if ns:
                out[:, :, :ns].copy_(sinks[:, :, :ns])
            if lr:
                out[:, :, lq : lq + lr].copy_(window)
            if tail is not None:
                out[:, :, lq + lr :].copy_(tail)

    def _dequantize_keys(self, out: torch.Tensor) -> None:
        """The packed keys (without their centring offset) into out (B, H, quantized tokens, D)."""
        if self.key_split is not None:
            ops.dequantize_split_into([b.live() for b in self.key_buffers()], self.key_split, out)
        else:
            ops.dequantize_into(*self.k_buf.live(), self.rotation, self.k_codebook, out)

    # ---- edits -------------------------------------------------------------------------------------------------

    def truncate(self, stored: int) -> None:
        """Keep the oldest `stored` of the tokens held."""
        lq = self.k_buf.length
        if stored >= lq:
            self.window.length = min(self.window.length, stored - lq)
        else:
            for buf in self.buffers():
                buf.truncate(stored)
            self.window.length = 0
        self._slen = min(self._slen, stored)

    def trim_front(self, keep: int) -> None:
        """Drop the oldest tokens held beyond `keep`: packed ones first, then the window's front."""
        excess = self.k_buf.length + self.window.length - keep
        if excess <= 0:
            return
        from_packed = min(excess, self.k_buf.length)
        for buf in self.buffers():
            buf.drop_front(from_packed)
        if excess > from_packed:
            self.window.drop_front(excess - from_packed)

    def map_batch(self, fn) -> None:
        """Apply a batch-dim map (reorder, repeat, select, move) to every tensor held."""
        for buf in self.buffers():
            buf.map_batch(fn)
        self.window.map(fn)
        self._sk, self._sv = fn(self._sk), fn(self._sv)
        if self._mu is not None:
            self._mu = fn(self._mu)
        self.batch = self._sk.shape[0]

    def to(self, device) -> None:
        """Move every tensor held (offload / prefetch), without waiting."""
        for buf in self.buffers():
            buf.to(device)
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        self.window.map(move)
        self._sk, self._sv = move(self._sk), move(self._sv)
        if self._mu is not None:
            self._mu = move(self._mu)

    def nbytes(self) -> dict[str, int]:
        """Bytes held: packed buffers, the window's buffers (allocated capacity), sink copies."""
        self.settle()
        return {"packed": sum(b.nbytes() for b in self.buffers()),
                "residual": self.window.nbytes(),
                "sinks": (self._sk.numel() + self._sv.numel()) * self._sk.element_size()}

    # ---- state by name -----------------------------------------------------------------------------------------

    def lengths(self) -> dict[str, int]:
        """Positions seen, codes held (they precede the window), window tokens, sink copies."""
        return {"seen": self.seen, "quantized": self.k_buf.length, "window": self.window.length, "sinks": self._slen}

    def state(self) -> dict[str, torch.Tensor]:
        """The tensors held by name (`layer_state`): views, live parts only."""
        self.settle_norm_check()
        out = {}
        for name, buf in zip(part_names(self.key_parts), self.buffers()):
            out[f"{name}_packed"], out[f"{name}_norms"] = buf.live()
        out.update(window_k=self.window.keys, window_v=self.window.values, sink_k=self._sk[:, :, : self._slen],
                   sink_v=self._sv[:, :, : self._slen])
        if self._mu is not None:
            out["key_mean"] = self._mu
        return out

    def load_state(self, tensors: dict[str, torch.Tensor], lengths: dict[str, int], norm_dtype=None,
                   where: str = "load_state") -> None:
        """Replace what the state holds by `tensors` (as `state()` names them) of `lengths`, norms of `norm_dtype`
        (default: the state's); refused whole, naming the bad tensor, before anything changes."""
        b, h, d = self.batch, self.heads, self.head_dim
        norm_dtype = self.norm_dtype if norm_dtype is None else norm_dtype
        q, r, s = lengths["quantized"], lengths["window"], lengths["sinks"]
        expect = {}
        for (name, dim, bits), buf in zip(self.part_dims(), self.buffers()):
            expect[f"{name}_packed"] = ((b, h, q, buf.nbytes_per_vec), torch.uint8)
            expect[f"{name}_norms"] = ((b, h, q), norm_dtype)
        for name, n in (("window_k", r), ("window_v", r), ("sink_k", s), ("sink_v", s)):
            expect[name] = ((b, h, n, d), self.dtype)
        if "key_mean" in tensors:
            expect["key_mean"] = ((b, h, 1, d), torch.float32)
        check_tensors(where, tensors, expect)
        self.norm_dtype = norm_dtype
        bufs = []
        for (name, dim, bits), old in zip(self.part_dims(), self.buffers()):
            fresh = PackedBuffer(b, h, dim, bits, self.norm_dtype, tensors[f"{name}_packed"].device)
            slot_p, slot_n = fresh.append_slots(q)
            slot_p.copy_(tensors[f"{name}_packed"])
            slot_n.copy_(tensors[f"{name}_norms"])
            bufs.append(fresh)
        self.k_buf, self.k_more, self.v_buf = bufs[0], bufs[1:-1], bufs[-1]
        self._mu = tensors.get("key_mean")
        self.window.length = 0
        self.window.append(tensors["window_k"], tensors["window_v"], self.window_capacity)
        self._sk, self._sv, self._slen = tensors["sink_k"], tensors["sink_v"], s
        self.seen = lengths["seen"]
