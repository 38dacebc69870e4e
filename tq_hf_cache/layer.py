"""`TurboQuantLayer`: one layer's KV cache as append-only packed buffers plus a full-precision residual window.

Tokens enter the residual window; those pushed out of it are quantized once, appended to the packed
buffers, and never re-quantized. `update` returns [dequantized history | residual | new tokens], the
history being written into the cache's shared workspace. For a decode step (at most MAX_FUSED_QUERIES new
tokens) the new tokens join the residual window and `update` returns `LazyKV`s carrying the layer's
`PackedKV`: the turboquant attention reads the packed codes directly, and anything else that reads the keys
fills them then. The window's overflow from such a step is quantized at the layer's next update (`_settle`),
so the step attends to exactly what the dense path would have given it. A longer chunk over a packed history
(a full-attention layer's prefill chunk) also returns `LazyKV`s, of a copy of [residual | new] beside the packed
views, and is pushed at once; the turboquant attention fills them a few batch rows at a time.

Attention sinks: the first `sink_tokens` tokens of the sequence draw a large share of the attention while
often having small keys, so their quantization error costs more than anyone else's (benchmarks/
key_fix_study.py). A full-attention layer keeps an exact copy of them and writes it over their dequantized
slots; they are quantized and packed like every other token, so nothing else changes shape.
"""

from __future__ import annotations

import warnings

import torch
from transformers.cache_utils import DynamicLayer

from . import ops
from ._compat import IS_V5
from .codebook import Codebook, theoretical_codebook
from .key_split import KeySplit, make_split
from .attention import lazy_pair
from .packed_kv import MAX_FUSED_QUERIES, PackedKV
from .packing import packed_bytes
from .rope import KeyOffset, RopeAngles
from .rotation import Rotation
from .workspace import Workspace

GROW_TOKENS = 256
# During decode the residual window may run up to this many tokens past residual_length before its oldest
# tokens are quantized together: one quantize launch and no allocation per FLUSH_BLOCK decode steps
FLUSH_BLOCK = 32
MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP16_MAX = 65504.0


class SlidingCropError(RuntimeError, ValueError):
    """A crop a sliding-window layer cannot do; transformers raises RuntimeError (5.x) or ValueError (4.x) there."""


class PackedBuffer:
    """Packed indices (B, H, capacity, nbytes) and norms (B, H, capacity); tokens [start, start + length) are live."""

    def __init__(self, batch: int, heads: int, dim: int, bits: int, norm_dtype: torch.dtype, device: torch.device):
        self.dim, self.bits = dim, bits
        self.nbytes_per_vec = packed_bytes(dim, bits)
        self.packed = torch.empty(batch, heads, 0, self.nbytes_per_vec, dtype=torch.uint8, device=device)
        self.norms = torch.empty(batch, heads, 0, dtype=norm_dtype, device=device)
        self.start = 0
        self.length = 0

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


class TurboQuantLayer(DynamicLayer):
    """A full-attention layer whose history is TurboQuant-packed; see the module docstring."""

    is_sliding = False
    is_compileable = False
    is_croppable = True
    fused_sdpa = True  # SDPA on a step's LazyKVs runs the fused attention (`TurboQuantCache(fused_sdpa=...)`)

    def __init__(
        self,
        *,
        key_bits: int,
        value_bits: int,
        residual_length: int,
        rotation_for,
        codebook_for,
        workspace: Workspace,
        norm_dtype: torch.dtype = torch.float16,
        layer_idx: int | None = None,
        private_output: bool = False,
        sink_tokens: int = 0,
        codebook_check=None,
        rope: RopeAngles | None = None,
        key_split: dict | None = None,
    ):
        DynamicLayer.__init__(self)
        self.sink_tokens = 0 if self.is_sliding else int(sink_tokens)
        self.key_bits, self.value_bits = key_bits, value_bits
        self.residual_length = residual_length
        self.config_norm_dtype = norm_dtype
        self.layer_idx = layer_idx
        self._codebook_check = codebook_check  # (layer_idx, heads, head_dim) -> None, raises on a mismatch
        self.workspace = workspace
        # KV-sharing producers: later layers keep what update returns, so it cannot live in the shared workspace
        self.private_output = private_output
        self._rotation_for = rotation_for  # dim -> Rotation
        self._codebook_for = codebook_for  # (kind, bits, dim) -> Codebook
        self.rope = rope  # set: keys are centred before quantizing (pre-RoPE key centring, see `rope`)
        self.key_split_spec = key_split  # set: keys are split in parts (`key_split`), checked at the first update
        self._clear()

    def _clear(self) -> None:
        self.is_initialized = False
        self.norm_dtype = self.config_norm_dtype
        self.cumulative_length = 0
        self.k_buf: PackedBuffer | None = None
        self.v_buf: PackedBuffer | None = None
        self.k_more: list[PackedBuffer] = []  # split keys: k_buf holds part 0, these the other parts
        self.key_split: KeySplit | None = None
        self._rk: torch.Tensor | None = None  # residual buffers (B, H, capacity, D); the first _rlen are live
        self._rv: torch.Tensor | None = None
        self._rlen = 0
        self._sk: torch.Tensor | None = None  # exact copies of the first sink_tokens tokens (B, H, sink_tokens, D)
        self._sv: torch.Tensor | None = None
        self._slen = 0  # how many of them are kept: the quantized ones among the first sink_tokens
        self._mu: torch.Tensor | None = None  # pre-RoPE key mean (B, H, 1, D) float32, from the first quantized block

    @property
    def res_k(self) -> torch.Tensor | None:
        """The full-precision residual window of keys, oldest first (a view)."""
        return None if self._rk is None else self._rk[:, :, : self._rlen]

    @property
    def res_v(self) -> torch.Tensor | None:
        return None if self._rv is None else self._rv[:, :, : self._rlen]

    @property
    def exact_sinks(self) -> int:
        """Sink tokens whose packed slots the exact copies overwrite (those already quantized)."""
        return min(self._slen, self.k_buf.length) if self.is_initialized else 0

    @property
    def residual_capacity(self) -> int:
        return self.residual_length + min(FLUSH_BLOCK, self.residual_length)

    # DynamicLayer keeps `keys`/`values` tensors; here they are materialized on demand from the packed state.
    @property
    def keys(self) -> torch.Tensor | None:
        return self._materialize("key")

    @keys.setter
    def keys(self, value) -> None:
        if value is not None:
            raise AttributeError("TurboQuantLayer.keys is derived from the packed cache and cannot be assigned")

    @property
    def values(self) -> torch.Tensor | None:
        return self._materialize("value")

    @values.setter
    def values(self, value) -> None:
        if value is not None:
            raise AttributeError("TurboQuantLayer.values is derived from the packed cache and cannot be assigned")

    def _validate(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Every check of an update's inputs, before anything changes."""
        for name, t in (("key", key_states), ("value", value_states)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"layer {self.layer_idx}: {name} states must be (batch, heads, seq, head_dim), got {shape}")
            if t.dtype not in MODEL_DTYPES:
                raise TypeError(f"TurboQuantCache supports model dtypes {MODEL_DTYPES}, got {name} states of {t.dtype}")
        if key_states.shape != value_states.shape:
            raise ValueError(
                f"layer {self.layer_idx}: key states {tuple(key_states.shape)} and value states {tuple(value_states.shape)} "
                "must have the same (batch, heads, seq, head_dim)"
            )
        if key_states.dtype != value_states.dtype or key_states.device != value_states.device:
            raise ValueError(
                f"layer {self.layer_idx}: key states are {key_states.dtype} on {key_states.device}, value states "
                f"{value_states.dtype} on {value_states.device}; they must match"
            )
        if not self.is_initialized:
            if self._codebook_check is not None:
                self._codebook_check(self.layer_idx, key_states.shape[1], key_states.shape[3])
            return
        expect = (self.batch, self.heads, self.head_dim)
        got = (key_states.shape[0], key_states.shape[1], key_states.shape[3])
        if got != expect:
            raise ValueError(
                f"layer {self.layer_idx}: states of shape {tuple(key_states.shape)} do not match the cache's "
                f"(batch, heads, head_dim) = {expect}"
            )
        if key_states.dtype != self.dtype or key_states.device != self.device:
            raise ValueError(
                f"layer {self.layer_idx}: states are {key_states.dtype} on {key_states.device}, the cache holds "
                f"{self.dtype} on {self.device}"
            )

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        b, h, _, d = key_states.shape
        split = None
        if self.key_split_spec is not None:
            # the parts are vectors of their own dims: the theoretical codebooks of those dims, never calibrated ones
            split = make_split(self.key_split_spec, self.layer_idx, h, d, self._rotation_for, theoretical_codebook)
        rot = self._rotation_for(d)
        k_codebook: Codebook = self._codebook_for("key", self.key_bits, d)
        v_codebook: Codebook = self._codebook_for("value", self.value_bits, d)
        for name, cb in (("key", k_codebook), ("value", v_codebook)):
            if cb.per_head and cb.centroids.shape[0] != h:
                raise ValueError(
                    f"layer {self.layer_idx}: the {name} codebook has {cb.centroids.shape[0]} heads but the model has {h} KV heads"
                )
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch, self.heads, self.head_dim = b, h, d
        self.rotation = rot.to(self.device)
        self.k_codebook, self.v_codebook = k_codebook.to(self.device), v_codebook.to(self.device)
        if split is not None:
            self.key_split = split.to(self.device)
            self.k_codebook = self.key_split.parts[0][1]
            parts = [PackedBuffer(b, h, rot.dim, cb.bits, self.norm_dtype, self.device) for rot, cb in split.parts]
            self.k_buf, self.k_more = parts[0], parts[1:]
        else:
            self.k_buf = PackedBuffer(b, h, d, self.key_bits, self.norm_dtype, self.device)
        self.v_buf = PackedBuffer(b, h, d, self.value_bits, self.norm_dtype, self.device)
        # residual window and sink copies grow with the sequence: a short prompt holds no more than it needs
        self._rk = key_states.new_empty(b, h, 0, d)
        self._rv = key_states.new_empty(b, h, 0, d)
        self._rlen = 0
        self._sk = key_states.new_empty(b, h, 0, d)
        self._sv = key_states.new_empty(b, h, 0, d)
        self._slen = 0
        self.is_initialized = True

    def _key_buffers(self) -> list[PackedBuffer]:
        """The packed key buffers: one, or one per part of split keys."""
        return [self.k_buf, *self.k_more]

    def _buffers(self) -> list[PackedBuffer]:
        """Every packed buffer the layer holds (they hold the same tokens)."""
        return [b for b in (*self._key_buffers(), self.v_buf) if b is not None]

    @property
    def quantized_length(self) -> int:
        return self.k_buf.length if self.is_initialized else 0

    @property
    def residual_tokens(self) -> int:
        return self._rlen if self.is_initialized else 0

    # torch.compile: the cache step stays eager (a graph break) instead of being traced, since its shapes and
    # buffers change every step; the model's projections and MLPs around it still compile
    @torch.compiler.disable
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self._validate(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._settle()
        n = key_states.shape[2]
        self.cumulative_length += n
        if n <= MAX_FUSED_QUERIES and self._lazy_ok(key_states, value_states):
            return self._decode_step(key_states, value_states)
        if not self.is_sliding and self.k_buf.length and self._lazy_ok(key_states, value_states):
            return self._chunk_step(key_states, value_states)
        out_k, out_v = self._visible(*self._assemble(key_states, value_states), n)
        self._push(key_states, value_states)
        return out_k, out_v

    def _visible(self, k: torch.Tensor, v: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What attention sees of [history | residual | new]: all of it here; sliding layers trim (see there)."""
        return k, v

    def _lazy_ok(self, key_states: torch.Tensor, value_states: torch.Tensor) -> bool:
        """Whether a step may return LazyKVs: not where the output must outlive the workspace (KV-sharing
        producers, autograd)."""
        grad = torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad)
        return not (self.private_output or grad)

    def _decode_step(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """Append the new tokens to the residual window and return LazyKVs of every stored token."""
        n, lr = key_states.shape[2], self._rlen
        self._reserve_residual(lr + n)
        self._rk[:, :, lr : lr + n].copy_(key_states)
        self._rv[:, :, lr : lr + n].copy_(value_states)
        self._rlen = lr + n
        lq = self.k_buf.length
        if lq == 0:  # nothing packed: the residual window is the whole history
            return self.res_k, self.res_v
        return self._lazy(self.packed_kv())

    def _chunk_step(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """A long chunk over a packed history: LazyKVs of [history | residual | new], then the usual push.

        The turboquant attention fills them a few batch rows at a time, so a whole batch's dense history never
        exists at once; any other consumer fills them whole, as `_assemble` would. Their exact tail is a copy of
        the residual and the new tokens, and their packed views are taken after the push's room is made, so the
        push changes nothing they read."""
        lr, n = self._rlen, key_states.shape[2]
        fp = self._with_residual(key_states, value_states)
        if lr + n > self.residual_capacity:  # the push quantizes all but the newest residual_length tokens
            for buf in self._buffers():
                buf.reserve(lr + n - self.residual_length)
        out = self._lazy(self.packed_kv(*fp))
        self._push(key_states, value_states, fp=fp)
        return out

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

    def _settle(self) -> None:
        """Quantize what a decode step left beyond the residual window, and drop what left a sliding window: the
        state a dense step's `_push` leaves."""
        lr = self._rlen
        drop = self._drop_old(lr)
        if drop == 0 and lr <= self.residual_capacity:
            return
        self._store_window(self.res_k[:, :, drop:], self.res_v[:, :, drop:])

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
                self._mu = self.rope.invert(k[:, :, first:], pos[first:]).mean(dim=2, keepdim=True)
            kq = k.float() - self.rope.apply(self._mu, pos)
        if self.norm_dtype == torch.float16:
            self._widen_norms_if_needed(kq, v)
        if self._slen < self.sink_tokens:
            # the sequence's first tokens are being quantized: keep exact copies of them (attention sinks). While
            # they sit in the residual window they are exact anyway, so a short prompt holds no second copy.
            take = min(self.sink_tokens - self._slen, n)
            self._sk = torch.cat([self._sk[:, :, : self._slen], k[:, :, :take]], dim=2)
            self._sv = torch.cat([self._sv[:, :, : self._slen], v[:, :, :take]], dim=2)
            self._slen += take
        pk, nk = self.k_buf.append_slots(n)
        pv, nv = self.v_buf.append_slots(n)
        if self.key_split is not None:
            ops.quantize_split_into(kq, self.key_split, [(pk, nk)] + [b.append_slots(n) for b in self.k_more])
            ops.quantize_into(v, self.rotation, self.v_codebook, pv, nv)
        elif kq is k:
            ops.quantize_kv_into(k, v, self.rotation, self.k_codebook, self.v_codebook, pk, nk, pv, nv)
        else:
            ops.quantize_into(kq, self.rotation, self.k_codebook, pk, nk)
            ops.quantize_into(v, self.rotation, self.v_codebook, pv, nv)

    def _widen_norms_if_needed(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """float16 norms end at 65504: before a finite norm above that is stored, switch this layer's norms to
        float32 (the stored ones convert exactly), so that no norm is clamped. One device sync per quantize call."""
        norms = torch.stack([k.float().norm(dim=-1).amax(), v.float().norm(dim=-1).amax()])
        big = norms[torch.isfinite(norms)]
        if big.numel() and float(big.max()) > FP16_MAX:
            warnings.warn(
                f"tq_hf_cache: layer {self.layer_idx} has a key/value norm of {float(big.max()):.4g}, above float16's "
                f"range ({FP16_MAX:.0f}); its norms are stored in float32 from now on (2 more bytes per vector). "
                "Set norm_dtype='float32' to choose this up front.",
                RuntimeWarning,
                stacklevel=2,
            )
            self.norm_dtype = torch.float32
            for buf in self._buffers():
                buf.norms = buf.norms.float()

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

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length_or_cache_position, *args) -> tuple[int, int]:
        q = _query_length(query_length_or_cache_position)
        return self.get_seq_length() + q, 0

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:  # transformers 4.x name
        return -1

    def reset(self) -> None:
        self._clear()

    def check_crop(self, max_length: int) -> None:
        """Raise what `crop(max_length)` would raise, changing nothing: a full-attention layer takes every crop."""

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

    def nbytes(self) -> dict[str, int]:
        """Bytes held between steps: packed buffers, residual window buffers (allocated capacity), sink copies."""
        if not self.is_initialized:
            return {"packed": 0, "residual": 0, "sinks": 0}
        self._settle()
        res = (self._rk.numel() + self._rv.numel()) * self._rk.element_size()
        sinks = (self._sk.numel() + self._sv.numel()) * self._sk.element_size()
        return {"packed": sum(b.nbytes() for b in self._buffers()), "residual": res, "sinks": sinks}

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(k{self.key_bits}v{self.value_bits}, residual={self.residual_length}, "
            f"quantized={self.quantized_length}, fp={self.residual_tokens})"
        )


class TurboQuantSlidingLayer(TurboQuantLayer):
    """A sliding-window layer: keeps only the newest `sliding_window - 1` tokens, quantized past the residual window."""

    is_sliding = True
    # as transformers' DynamicSlidingWindowLayer: crop is exact while past recording is on (assisted decoding turns it
    # on before its first crop; transformers >= 5.24 checks this flag before assisted decoding)
    is_croppable = True

    def __init__(self, *, sliding_window: int, **kwargs):
        TurboQuantLayer.__init__(self, **kwargs)
        self.sliding_window = int(sliding_window)
        self.record_past = False

    def _drop_old(self, fp_tokens: int) -> int:
        """Drop tokens beyond `sliding_window - 1` from the packed front; return how many of the oldest
        full-precision tokens (residual, then new) must go too. Nothing is dropped while recording the past."""
        if self.record_past:
            return 0
        excess = self.k_buf.length + fp_tokens - (self.sliding_window - 1)
        if excess <= 0:
            return 0
        from_packed = min(excess, self.k_buf.length)
        for buf in self._buffers():
            buf.drop_front(from_packed)
        return excess - from_packed

    def get_mask_sizes(self, query_length_or_cache_position, *args) -> tuple[int, int]:
        q = _query_length(query_length_or_cache_position)
        kv_offset = max(self.cumulative_length - self.sliding_window + 1, 0)
        if self.cumulative_length >= self.sliding_window:
            return self.sliding_window - 1 + q, kv_offset
        return self.cumulative_length + q, kv_offset

    def get_max_length(self) -> int:
        return self.sliding_window

    def get_max_cache_shape(self) -> int:
        return self.sliding_window

    def activate_past_recording(self) -> None:
        """Keep tokens that leave the window until the next `crop` (assisted decoding rolls back rejected ones)."""
        self.record_past = True

    def _lazy_ok(self, key_states: torch.Tensor, value_states: torch.Tensor) -> bool:
        # a LazyKV holds every stored token; while recording the layer keeps more than the window shows
        return not self.record_past and TurboQuantLayer._lazy_ok(self, key_states, value_states)

    def _visible(self, k: torch.Tensor, v: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """While recording, the layer holds more than the window: attention sees what `get_mask_sizes` says."""
        visible = self.sliding_window - 1 + new_tokens
        if self.record_past and k.shape[2] > visible:
            return k[:, :, -visible:], v[:, :, -visible:]
        return k, v

    def check_crop(self, max_length: int) -> None:
        """Raise what `crop(max_length)` would raise, changing nothing (a cache checks every layer before it crops
        any): past the window only while recording, and only by a count (<= 0) of newest tokens to remove."""
        if not self.is_initialized:
            return
        self._settle()  # what a decode step left beyond the residual window: no visible change
        if self.get_seq_length() < self.sliding_window:
            return
        if not self.record_past:
            raise SlidingCropError(
                "cannot crop a sliding-window TurboQuant layer once it has seen more tokens than its window "
                f"({self.sliding_window}): the older states are gone; call activate_past_recording() first"
            )
        if max_length > 0:
            raise SlidingCropError(
                "once its window is full, a sliding-window TurboQuant layer is cropped by a negative count of tokens "
                f"to remove, got {max_length}"
            )
        remove, stored = -max_length, self.k_buf.length + self._rlen
        needed = min(self.cumulative_length - remove, self.sliding_window - 1)
        if remove > stored or stored - remove < needed:
            raise SlidingCropError(
                f"cannot remove {remove} tokens from a sliding-window layer that keeps {stored}: the window would "
                f"need {max(needed, 0)} older tokens, dropped before activate_past_recording()"
            )

    def crop(self, max_length: int) -> None:
        """As `DynamicSlidingWindowLayer.crop` (see `check_crop`); it also trims what is kept back to the window."""
        if self.is_initialized:
            self._settle()
        if not self.is_initialized or self.get_seq_length() < self.sliding_window:
            super().crop(max_length)
            return
        self.check_crop(max_length)
        remove, stored = -max_length, self.k_buf.length + self._rlen
        self._truncate(stored - remove)
        self.cumulative_length -= remove
        self._trim_front(self.sliding_window - 1)

    def _trim_front(self, keep: int) -> None:
        """Drop the oldest stored tokens beyond `keep`: packed ones first, then the residual's front."""
        excess = self.k_buf.length + self._rlen - keep
        if excess <= 0:
            return
        from_packed = min(excess, self.k_buf.length)
        for buf in self._buffers():
            buf.drop_front(from_packed)
        e = excess - from_packed
        if e:
            rest = self._rlen - e
            self._rk[:, :, :rest] = self._rk[:, :, e : self._rlen].clone()
            self._rv[:, :, :rest] = self._rv[:, :, e : self._rlen].clone()
            self._rlen = rest


_HYBRID_CLASSES = None


def hybrid_classes():
    """(full, sliding) layers holding a linear-attention state and quantized attention KV, built on first use
    because transformers 4.x has no LinearAttentionLayer."""
    global _HYBRID_CLASSES
    if _HYBRID_CLASSES is not None:
        return _HYBRID_CLASSES
    from transformers.cache_utils import LinearAttentionLayer

    def make(base, name):
        def __init__(self, number_of_states: int = 1, **kwargs):
            base.__init__(self, **kwargs)
            LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

        def lazy_initialization(self, *args, **kwargs):
            # attention `update` passes (keys, values) positionally; the linear-attention updates pass keywords
            if args:
                base.lazy_initialization(self, *args, **kwargs)
            else:
                LinearAttentionLayer.lazy_initialization(self, **kwargs)

        def both(method):
            def run(self, *args):
                getattr(LinearAttentionLayer, method)(self, *args)
                getattr(base, method)(self, *args)

            run.__name__ = method
            return run

        def crop(self, tokens_to_remove: int):
            LinearAttentionLayer.crop(self, tokens_to_remove)
            base.crop(self, tokens_to_remove)

        def check_crop(self, tokens_to_remove: int):
            from .crop import check_foreign_crop

            check_foreign_crop(self, tokens_to_remove, LinearAttentionLayer.crop)
            base.check_crop(self, tokens_to_remove)

        attrs = {
            "__init__": __init__,
            "lazy_initialization": lazy_initialization,
            "offload": both("offload"),
            "prefetch": both("prefetch"),
            "reset": both("reset"),
            "reorder_cache": both("reorder_cache"),
            "crop": crop,
            "check_crop": check_crop,
            "is_compileable": False,
            "supports_early_init": True,
            "__doc__": f"{base.__name__} plus the untouched linear-attention (conv/recurrent) states of a hybrid layer.",
        }
        return type(name, (LinearAttentionLayer, base), attrs)

    _HYBRID_CLASSES = (
        make(TurboQuantLayer, "TurboQuantLinearHybridLayer"),
        make(TurboQuantSlidingLayer, "TurboQuantLinearHybridSlidingLayer"),
    )
    return _HYBRID_CLASSES


def _query_length(arg) -> int:
    """transformers 5.x passes the query length; 4.x passes cache_position."""
    if isinstance(arg, torch.Tensor):
        return int(arg.shape[0])
    return int(arg)
