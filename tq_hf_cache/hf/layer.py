"""`TurboQuantLayer`: transformers' `DynamicLayer` over a `state.GrowableState` (packed history, exact window,
sinks; see there).

`update` returns [dequantized history | window | new tokens], the history written into the cache's shared
workspace. For a decode step (at most MAX_FUSED_QUERIES new tokens) the new tokens join the window and `update`
returns `LazyKV`s carrying the state's `PackedKV`: the turboquant attention reads the packed codes directly, and
anything else that reads the keys fills them then. The window's overflow from such a step is quantized at the
layer's next update (`GrowableState.settle`), so the step attends to exactly what the dense path would have given
it. A longer chunk over a packed history (a full-attention layer's prefill chunk) also returns `LazyKV`s, of a copy
of [window | new] beside the packed views, and is pushed at once; the turboquant attention fills them a few batch
rows at a time.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from .._compat import IS_V5, query_length
from .attention import lazy_pair
from ..quant.packed_kv import MAX_FUSED_QUERIES, PackedKV
from ..quant.rope import RopeAngles
from ..state import GrowableState, make_quantizers
from ..state.growable import FLUSH_BLOCK
from ..state.packed_buffer import GROW_TOKENS, PackedBuffer  # noqa: F401  (imported from here too)
from .workspace import Workspace

MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class TurboQuantLayer(DynamicLayer):
    """A full-attention layer whose history is TurboQuant-packed: the transformers side (validation, what `update`
    returns, crop and batch edits as generate calls them) over the layer's `GrowableState`, `kv` (None until the
    first update)."""

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
        self.kv: GrowableState | None = None
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
        self.kv = None

    @property
    def cumulative_length(self) -> int:
        return self.kv.seen if self.kv is not None else 0

    @cumulative_length.setter
    def cumulative_length(self, value: int) -> None:
        if self.kv is not None:
            self.kv.seen = int(value)
        elif value:
            raise AttributeError("an empty TurboQuantLayer holds no positions")

    @property
    def norm_dtype(self) -> torch.dtype:
        """The norms' dtype: the config's, or float32 once a norm went past float16's range (`norm_check`)."""
        return self.kv.norm_dtype if self.kv is not None else self.config_norm_dtype

    @property
    def key_split(self):
        """The layer's `KeySplit` when its keys are split in parts (known after the first update), else None."""
        return self.kv.key_split if self.kv is not None else None

    @property
    def quantized_length(self) -> int:
        return self.kv.quantized if self.kv is not None else 0

    @property
    def residual_tokens(self) -> int:
        return self.kv.window.length if self.kv is not None else 0

    @property
    def residual_capacity(self) -> int:
        return self.residual_length + min(FLUSH_BLOCK, self.residual_length)

    # DynamicLayer keeps `keys`/`values` tensors; here they are materialized on demand from the packed state
    keys = property(lambda self: self._materialize(0), lambda self, v: self._refuse("keys", v))
    values = property(lambda self: self._materialize(1), lambda self, v: self._refuse("values", v))

    def _refuse(self, name: str, value) -> None:
        if value is not None:
            raise AttributeError(f"TurboQuantLayer.{name} is derived from the packed cache and cannot be assigned")

    def _materialize(self, which: int) -> torch.Tensor | None:
        if self.kv is None:
            return None
        kv = self.kv
        kv.settle()
        out = torch.empty(kv.batch, kv.heads, kv.quantized + kv.window.length, kv.head_dim, dtype=kv.dtype,
                          device=kv.window.k.device)
        kv.dense_into(*((out, None) if which == 0 else (None, out)))
        return out

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
        kv = self.kv
        expect = (kv.batch, kv.heads, kv.head_dim)
        got = (key_states.shape[0], key_states.shape[1], key_states.shape[3])
        if got != expect:
            raise ValueError(
                f"layer {self.layer_idx}: states of shape {tuple(key_states.shape)} do not match the cache's "
                f"(batch, heads, head_dim) = {expect}"
            )
        if key_states.dtype != kv.dtype or key_states.device != kv.device:
            raise ValueError(
                f"layer {self.layer_idx}: states are {key_states.dtype} on {key_states.device}, the cache holds "
                f"{kv.dtype} on {kv.device}"
            )

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        b, h, _, d = key_states.shape
        quantizers = make_quantizers(self.layer_idx, h, d, self.key_bits, self.value_bits, self._rotation_for,
                                     self._codebook_for, self.key_split_spec, key_states.device)
        self.kv = GrowableState(
            quantizers, residual_length=self.residual_length, batch=b, heads=h, head_dim=d, dtype=key_states.dtype,
            device=key_states.device, sink_tokens=self.sink_tokens, norm_dtype=self.config_norm_dtype, rope=self.rope,
            layer_idx=self.layer_idx)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    # torch.compile: the cache step stays eager (a graph break) instead of being traced, since its shapes and
    # buffers change every step; the model's projections and MLPs around it still compile
    @torch.compiler.disable
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self._validate(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        kv = self.kv
        kv.settle()
        n = key_states.shape[2]
        kv.seen += n
        if n <= MAX_FUSED_QUERIES and self._lazy_ok(key_states, value_states):
            kv.append_window(key_states, value_states)
            if kv.quantized == 0:  # nothing packed: the window is the whole history
                return kv.window.keys, kv.window.values
            return self._lazy(kv.view())
        if not self.is_sliding and kv.quantized and self._lazy_ok(key_states, value_states):
            return self._chunk_step(key_states, value_states)
        out_k, out_v = self._visible(*self._assemble(key_states, value_states), n)
        kv.push(key_states, value_states)
        return out_k, out_v

    def _visible(self, k: torch.Tensor, v: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What attention sees of [history | window | new]: all of it here; sliding layers trim (see there)."""
        return k, v

    def _lazy_ok(self, key_states: torch.Tensor, value_states: torch.Tensor) -> bool:
        """Whether a step may return LazyKVs: not where the output must outlive the workspace (KV-sharing
        producers, autograd)."""
        grad = torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad)
        return not (self.private_output or grad)

    def _lazy(self, packed: PackedKV):
        """LazyKVs of `packed`, filled (whole or by batch rows) into the shared workspace."""
        kv = self.kv
        shape = (kv.batch, kv.heads, packed.length, kv.head_dim)

        def alloc(rows: int):
            return self.workspace.views(rows, kv.heads, packed.length, kv.head_dim, kv.dtype, kv.device)

        return lazy_pair(packed, shape, kv.dtype, alloc, self.fused_sdpa)

    def _chunk_step(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """A long chunk over a packed history: LazyKVs of [history | window | new], then the usual push.

        The turboquant attention fills them a few batch rows at a time, so a whole batch's dense history never
        exists at once; any other consumer fills them whole. Their exact tail is a copy of the window and the new
        tokens, and their packed views are taken after the push's room is made, so the push changes nothing they
        read."""
        kv = self.kv
        lr, n = kv.window.length, key_states.shape[2]
        fp = kv.with_window(key_states, value_states)
        if lr + n > kv.window_capacity:  # the push quantizes all but the newest residual_length tokens
            kv.reserve_packed(lr + n - self.residual_length)
        out = self._lazy(kv.view(*fp))
        kv.push(key_states, value_states, fp=fp)
        return out

    def _assemble(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """[dequantized history | window | new] for this step's attention."""
        kv = self.kv
        lq, lr, n = kv.quantized, kv.window.length, key_states.shape[2]
        if lq == 0:
            return kv.with_window(key_states, value_states)
        # autograd saves what attention reads: under grad the output must not be a workspace that the next layer
        # overwrites, and KV-sharing producers' outputs are kept by later layers
        shape = (kv.batch, kv.heads, lq + lr + n, kv.head_dim)
        if self.private_output or (torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad)):
            wk, wv = key_states.new_empty(shape), value_states.new_empty(shape)
        else:
            wk, wv = self.workspace.views(*shape, kv.dtype, kv.device)
        kv.dense_into(wk, wv, key_states, value_states)
        return wk, wv

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length_or_cache_position, *args) -> tuple[int, int]:
        q = query_length(query_length_or_cache_position)
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
        self.kv.settle()
        seq = self.get_seq_length()
        target = seq - abs(max_length) if max_length < 0 or (max_length == 0 and IS_V5) else max_length
        if target >= seq:
            return
        self.kv.truncate(max(target, 0))
        self.kv.seen = max(target, 0)

    def _map_batch(self, fn) -> None:
        if self.is_initialized:
            self.kv.settle()
            self.kv.map_batch(fn)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        idx = beam_idx.to(self.device) if self.is_initialized else beam_idx
        self._map_batch(lambda t: t.index_select(0, idx))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices.to(t.device) if isinstance(indices, torch.Tensor) else indices])

    def offload(self) -> None:
        if self.is_initialized:
            self.kv.settle()
            self.kv.to("cpu")

    def prefetch(self) -> None:
        if self.is_initialized and self.kv.window.k.device != self.device:
            self.kv.to(self.device)

    def nbytes(self) -> dict[str, int]:
        """Bytes held between steps: packed buffers, the window's buffers (allocated capacity), sink copies."""
        if not self.is_initialized:
            return {"packed": 0, "residual": 0, "sinks": 0}
        return self.kv.nbytes()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(k{self.key_bits}v{self.value_bits}, residual={self.residual_length}, "
            f"quantized={self.quantized_length}, fp={self.residual_tokens})"
        )
