"""`TurboQuantStaticCache`: a `StaticCache` whose full-attention layers hold TurboQuant-packed keys and values, with
every shape fixed, so that `torch.compile(mode="reduce-overhead")` captures the decode step in CUDA graphs.

A layer preallocates, for `max_cache_len` positions, one uint8 buffer (`packed_kv.static_parts`: packed
keys/values, their norms, exact copies of the first `sink_tokens` positions (attention sinks) and the lengths) and
a window each for keys and values (a ring buffer), of the newest `residual_length + MAX_FUSED_QUERIES` positions
kept exact. Three tensors per layer, so that a compiled step's guards and CUDA-graph input checks cost about what
`StaticCache`'s two do. Every update quantizes its new tokens into their packed slots and writes them into the
window; nothing is re-quantized and no branch depends on the current length, which lives on the device.

What `update` returns depends only on the static shapes and on the model config's current
`_attn_implementation`, never on what ran before:
- "turboquant" and at most MAX_FUSED_QUERIES new tokens: the windows. They carry the layer's `StaticKV` as
  the attribute `turboquant_packed` (set once, when the buffers are made); the turboquant attention reads it and
  runs the fused op `tq_hf_cache::static_attention`. Any other attention given them fails loudly: its mask is
  `max_cache_len` long, the window is not.
- anything else: keys and values of `max_cache_len` positions, dequantized (`tq_hf_cache::dequantize`) with the
  exact copies written over theirs, as `StaticCache` returns its buffers.

Sliding-window layers are transformers' `StaticSlidingWindowLayer` (their window is bounded and small; a
`key_split` entry for one does not apply), as are layers the config keeps in full precision (`StaticLayer`).
Split keys (`key_split`) keep one packed part per split part in the layer's buffer; the fused op reads them part by
part, the dense path dequantizes each and puts its channels back. Centred keys (`key_centering`) keep their pre-RoPE
mean in the buffer (taken from the first update's keys, `rope.key_mean`); the codes are those of k - R(t) mu, and
every read adds R(t) mu back (to the dense keys, or as q . R(t) mu to the fused op's scores).

Norms past float16's range (65504), as `TurboQuantCache` handles them (`norm_check`), without the host waiting for
the GPU at an update: an eager update keeps the float32 norms of what it quantized and records their largest in the
buffer's norm guard; the layer reads that at its next check and, where a norm is past the range, re-lays its buffer
out with float32 norms, writes the exact ones and warns. A check runs at the next forward's mask (transformers makes
it eagerly before each compiled step of `generate`), at the layer's next eager update and before `state`, `crop`,
`reorder_cache`, a copy or a pickle. A compiled step cannot re-lay a buffer out: its append records the largest norm
it stores (and any an eager append left unchecked) in the guard, and the next check raises naming the layer and
`norm_dtype='float32'` (a norm past the range is stored there as inf). `TurboQuantStaticCache.check_norms()` runs
every layer's check at once.
"""

from __future__ import annotations

import copy
from functools import partial

import torch
from transformers import cache_utils
from transformers.cache_utils import Cache, StaticLayer

from .. import _compat
from ..kernels import ops
from .attention import NAME
from .cache import _check_codebook_rotation, _check_codebooks, _codebook, _rotation, resolve_config
from ..config import model_facts
from .crop import crop_layers
from ..kernels import DECODE_MAX_ROWS
from ..quant.norm_check import FP16_MAX, warn_widened
from ..quant.packed_kv import MAX_FUSED_QUERIES, PackedKV
from ..quant.rope import rope_angles
from ..state import FixedState, make_quantizers
from ..state.fixed import mark_static


class _KernelScratch:
    """The fused kernel's scratch and counters: one per cache, shared by its layers' ops, made outside any graph."""

    def __init__(self):
        self.scratch: torch.Tensor | None = None
        self.counters: torch.Tensor | None = None

    def ensure(self, numel: int, counters: int, device: torch.device) -> None:
        if self.scratch is None or self.scratch.numel() < numel or self.scratch.device != device:
            self.scratch = torch.empty(numel, dtype=torch.float32, device=device)
            mark_static(self.scratch)
        if self.counters is None or self.counters.numel() < counters or self.counters.device != device:
            self.counters = torch.zeros(counters, dtype=torch.int32, device=device)
            mark_static(self.counters)


class _Bookkeeping:
    """Held length and pending norm checks the layers share: an eager forward reads the device once, not per layer."""

    def __init__(self):
        self._held: int | None = None  # positions every full-attention layer holds before this eager forward
        self._taken: set[int] = set()
        self.layers: list = []  # the cache's quantized layers, whose norm checks `settle_norms` reads
        self.pending: dict = {}  # {layer_idx: layer} of layers with an eager append not yet checked

    def note_held(self, held: int) -> None:
        """The length the mask read (before the forward's updates): the layers take it instead of each reading
        the device's copy again, which would stop the host until the GPU caught up, twice a layer."""
        self._held, self._taken = held, set()

    def take_held(self, layer_idx: int) -> int | None:
        """That length, once per layer after each note (None: read the device's copy)."""
        if self._held is None or layer_idx in self._taken:
            return None
        self._taken.add(layer_idx)
        return self._held

    def settle_norms(self) -> None:
        """Run every layer's norm check (`TurboQuantStaticLayer.settle_norms`), one host read per device; every
        layer settles before the first error is raised."""
        layers = {id(x): x for x in (*self.layers, *self.pending.values()) if x.is_initialized}
        by_device: dict = {}
        for layer in layers.values():
            by_device.setdefault(layer.keys.device, []).append(layer)
        error = None
        for group in by_device.values():
            for layer, guard in zip(group, torch.stack([x.kv.norm_guard() for x in group]).tolist()):
                try:
                    layer._settle_norms(guard)
                except RuntimeError as e:
                    error = error or e
        if error is not None:
            raise error

    def __getstate__(self) -> dict:
        """Copied or pickled with every layer's check run first: none is left pending in the copy."""
        self.settle_norms()
        return dict(self.__dict__)


def held_only(attn_config, n: int) -> bool:
    """Whether a step of n new tokens attends over the positions held only, not over `max_cache_len`: an eager step
    that the fused attention does not take (a prefill chunk, or any step under another attention). A compiled step
    keeps every shape static. The cache's full-attention layers and `get_mask_sizes` all answer by this rule, so one
    mask fits them all."""
    return not torch.compiler.is_compiling() and (
        n > MAX_FUSED_QUERIES or getattr(attn_config, "_attn_implementation", None) != NAME
    )


def mask_sizes(layer, query_length) -> tuple[int, int]:
    """(kv_length, kv_offset) of a full-attention layer of the cache (see `held_only`). An eager step's mask reads
    the length held once, before the layers' updates, and leaves it for them (`_Bookkeeping.note_held`)."""
    n = _compat.query_length(query_length)
    if not held_only(layer._attn_config, n):
        if not torch.compiler.is_compiling() and layer._bookkeeping.pending:  # before a step that may be compiled
            layer._bookkeeping.settle_norms()
        return layer.max_cache_len, 0
    held = int(layer.get_seq_length()) if layer.is_initialized else 0
    if held:  # the host has just waited for the GPU: the norm checks cost nothing more
        layer._bookkeeping.settle_norms()
    layer._bookkeeping.note_held(held)
    return held + n, 0


def _held_before(layer) -> int:
    """Positions a full-attention layer holds before an eager update: what the step's mask read, else its own."""
    if not layer.is_initialized:
        return 0
    held = layer._bookkeeping.take_held(layer.layer_idx)
    return int(layer.get_seq_length()) if held is None else held


class ExactStaticLayer(StaticLayer):
    """A full-attention layer the config keeps in full precision: transformers' `StaticLayer`, whose eager steps
    attend over the positions held, as the quantized layers' do (`held_only`)."""

    def __init__(self, max_cache_len: int, attn_config, layer_idx: int, bookkeeping: _Bookkeeping):
        super().__init__(max_cache_len=max_cache_len)
        self._attn_config, self.layer_idx, self._bookkeeping = attn_config, layer_idx, bookkeeping

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        n = key_states.shape[2]
        if not held_only(self._attn_config, n):
            return super().update(key_states, value_states, *args, **kwargs)
        held = _held_before(self) + n
        k, v = super().update(key_states, value_states, *args, **kwargs)
        return k[:, :, :held], v[:, :, :held]

    def get_mask_sizes(self, query_length, *args, **kwargs) -> tuple[int, int]:
        return mask_sizes(self, query_length)


class TurboQuantStaticLayer(StaticLayer):
    """A full-attention layer of fixed capacity: the transformers side (checks, what `update` returns, masks, crop,
    beam reorder, pickling) over the layer's `FixedState`, `kv` (None until the first update); see the module
    docstring. `keys` / `values` are the state's windows."""

    is_compileable = True
    is_sliding = False

    def __init__(
        self,
        *,
        max_cache_len: int,
        key_bits: int,
        value_bits: int,
        residual_length: int,
        sink_tokens: int,
        rotation_for,
        codebook_for,
        norm_dtype: torch.dtype,
        layer_idx: int,
        attn_config,
        query_group: int,
        kernel_scratch: _KernelScratch,
        bookkeeping: _Bookkeeping,
        max_batch_size: int | None = None,
        codebook_check=None,
        key_split: dict | None = None,
        rope=None,
    ):
        self.kv: FixedState | None = None
        StaticLayer.__init__(self, max_cache_len=max_cache_len)
        self.key_split_spec = key_split  # keys split in parts (`key_split`), checked at the first update
        self.rope = rope  # set: keys are centred (k - R(t) mu is quantized; mu from the first update's keys)
        self.key_bits, self.value_bits = key_bits, value_bits
        self.residual_length, self.sink_tokens = residual_length, sink_tokens
        self.config_norm_dtype, self.layer_idx = norm_dtype, layer_idx
        self.max_batch_size = max_batch_size
        self._rotation_for, self._codebook_for = rotation_for, codebook_for
        self._attn_config, self._group = attn_config, query_group
        self._kernel_scratch, self._bookkeeping = kernel_scratch, bookkeeping
        self._codebook_check = codebook_check
        self._length_read: torch.Tensor | None = None  # a compiled step's read of the length before its append

    @property
    def window_size(self) -> int:
        return min(self.residual_length + MAX_FUSED_QUERIES, self.max_cache_len)

    @property
    def norm_dtype(self) -> torch.dtype:
        return self.kv.norm_dtype if self.kv is not None else self.config_norm_dtype

    @property
    def key_split(self):
        return self.kv.key_split if self.kv is not None else None

    @property
    def packed(self) -> PackedKV:
        """The state as a `PackedKV` of views of its buffer and windows (traced as view ops when compiled)."""
        return self.kv.view()

    def _check(self, key_states: torch.Tensor, value_states: torch.Tensor) -> int | None:
        """Refuse states that do not fit; returns the positions held before them (eager steps of an initialized
        layer; None otherwise)."""
        if key_states.shape != value_states.shape or key_states.dim() != 4:
            raise ValueError(
                f"layer {self.layer_idx}: key states {tuple(key_states.shape)} and value states "
                f"{tuple(value_states.shape)} must both be (batch, heads, seq, head_dim)"
            )
        b, h, n, d = key_states.shape
        if self.max_batch_size is not None and b > self.max_batch_size:
            raise ValueError(f"layer {self.layer_idx}: batch {b} exceeds max_batch_size={self.max_batch_size}")
        if self.is_initialized and (b, h, d) != (self.batch_size, self.num_heads, self.k_head_dim):
            raise ValueError(
                f"layer {self.layer_idx}: states of shape {tuple(key_states.shape)} do not match the cache's "
                f"(batch, heads, head_dim) = {(self.batch_size, self.num_heads, self.k_head_dim)}"
            )
        if not self.is_initialized and self._codebook_check is not None:
            self._codebook_check(self.layer_idx, h, d)
        if self.is_initialized and not torch.compiler.is_compiling():  # eager only: a compiled step cannot sync
            held = _held_before(self)
            if held + n > self.max_cache_len:
                raise ValueError(
                    f"layer {self.layer_idx}: {n} new tokens after {held} exceed max_cache_len={self.max_cache_len}"
                )
            return held
        if n > self.max_cache_len:
            raise ValueError(f"layer {self.layer_idx}: {n} tokens exceed max_cache_len={self.max_cache_len}")
        return None if self.is_initialized else 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads, self.k_head_dim, self.v_head_dim = b, h, d, d
        cap, dev = self.max_cache_len, self.device
        quantizers = make_quantizers(self.layer_idx, h, d, self.key_bits, self.value_bits, self._rotation_for,
                                     self._codebook_for, self.key_split_spec, dev)
        rows = min(DECODE_MAX_ROWS, _next_pow2(self._group * MAX_FUSED_QUERIES))
        splits = _max_splits(b * h, cap, dev, d, self.key_bits, self.value_bits, quantizers.key_split is not None)
        self._kernel_scratch.ensure(b * h * (splits + 1) * rows * (d + 2), b * h, dev)
        self.kv = FixedState(quantizers, capacity=cap, window_size=self.window_size,
                             scratch=self._kernel_scratch.scratch, counters=self._kernel_scratch.counters, batch=b,
                             heads=h, head_dim=d, dtype=self.dtype, device=dev, sink_tokens=self.sink_tokens,
                             norm_dtype=self.config_norm_dtype, rope=self.rope, layer_idx=self.layer_idx)
        self.keys, self.values = self.kv.window_k, self.kv.window_v
        self.is_initialized = True

    def settle_norms(self) -> None:
        """Run this layer's norm check now (the host waits for the GPU); see the module docstring."""
        if self.is_initialized:
            self._settle_norms(self.kv.norm_guard().tolist())

    def _settle_norms(self, guard: list[float]) -> None:
        """Settle the state's norm check (`FixedState.settle`), then raise where a compiled step stored or read a
        norm past float16's range, or warn where an eager one widened the norms."""
        widened, eager, compiled = self.kv.settle(guard)
        if self.kv.pending is None:
            self._bookkeeping.pending.pop(self.layer_idx, None)
        if compiled > FP16_MAX:
            raise RuntimeError(
                f"layer {self.layer_idx}: a compiled step stored or read a key/value norm of {compiled:.4g}, above "
                f"float16's range ({FP16_MAX:.0f}), as inf (a compiled step cannot widen the norms; attention over "
                "it gives NaN). Build the cache with norm_dtype='float32', or run TurboQuantStaticCache.check_norms() "
                "after an eager prefill; reset() clears the layer"
            )
        if widened:
            warn_widened(self.layer_idx, eager, stacklevel=4)

    def __getstate__(self) -> dict:
        """Pickled as it will read: the norm checks run first (they may widen the norms), every layer's at once, so
        that none settles while the layers they share are being pickled."""
        self._bookkeeping.settle_norms()
        return dict(self.__dict__)

    def __deepcopy__(self, memo: dict) -> "TurboQuantStaticLayer":
        """A copy of the buffers that, like the original, follows its model's live attention setting."""
        self._bookkeeping.settle_norms()
        memo[id(self._attn_config)] = self._attn_config
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update({k: copy.deepcopy(v, memo) for k, v in self.__dict__.items()})
        return new

    def state(self) -> dict[str, torch.Tensor]:
        """The state's tensors by name (`FixedState.state`), its norm check run first."""
        self.settle_norms()
        return self.kv.state()

    @property
    def cumulative_length(self) -> torch.Tensor:
        """Positions held, a 0-d int64 tensor (on the device once initialized: a view of the state's buffer)."""
        if not self.is_initialized:
            return torch.zeros((), dtype=torch.int64)
        return self.kv.length

    @cumulative_length.setter
    def cumulative_length(self, value) -> None:
        """`StaticLayer.__init__` sets a zero before the buffer exists; after, the length is the buffer's to keep."""
        if getattr(self, "is_initialized", False):
            raise AttributeError("a TurboQuantStaticLayer's length lives in its buffer: use crop() or reset()")

    def _fused(self, n: int) -> bool:
        """Whether this update serves the fused attention: static facts and the live attention setting only (the
        selector's answer is a constant of a compiled step)."""
        if getattr(self._attn_config, "_attn_implementation", None) != NAME or n > MAX_FUSED_QUERIES:
            return False
        split = self.kv.key_split
        return ops.static_step_fused(torch.device(self.device), self.k_head_dim, self.key_bits, self.value_bits,
                                     self._group, n, None if split is None else (tuple(split.sizes), tuple(split.bits)),
                                     self.max_cache_len, self.batch_size * self.num_heads * self.max_cache_len,
                                     self.kv.k_codebook.pair or self.kv.v_codebook.pair)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        before = self._check(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        compiling = torch.compiler.is_compiling()
        if not compiling and self.kv.pending is not None:  # an update with no mask since the last one
            self.settle_norms()
        read, self._length_read = getattr(self, "_length_read", None), None
        if self.kv.append(key_states, value_states, before, compiling, read):
            self._bookkeeping.pending[self.layer_idx] = self
        n = key_states.shape[2]
        if self._fused(n):
            return self.keys, self.values
        return self._full(key_states, value_states, before)

    def _full(self, key_states, value_states, before: int | None = None):
        """Keys and values of every position a step attends to: all `max_cache_len` positions in a compiled step;
        in an eager one (`held_only`) only the positions held, as `get_mask_sizes` says, so a long prefill costs
        what a dynamic cache's does."""
        n = key_states.shape[2]
        stop = held = self.max_cache_len
        if held_only(self._attn_config, n):
            # after the append (`before`: what the step's update found held, read once per forward for the mask)
            held = int(self.kv.length) if before is None else before + n
            if held == n:  # every position held is one of this step's tokens (a first prefill chunk)
                return key_states, value_states
            stop = min(self.max_cache_len, max(held, self.window_size, self.kv.sinks))  # dead window slots, sinks
        return self.kv.dense(key_states, value_states, stop, held)

    def get_seq_length(self) -> int:
        """Positions held: a 0-d tensor once initialized (a view of the buffer; in a compiled step a copy that this
        step's append takes as an input, so that the graph reads it first and appends into the buffer in place: a read
        of the buffer left after the append makes torch.compile copy the whole buffer every step)."""
        if not self.is_initialized:
            return 0
        if not torch.compiler.is_compiling():
            return self.kv.length
        self._length_read = ops.snapshot(self.kv.length)
        return self._length_read

    def get_mask_sizes(self, query_length, *args, **kwargs) -> tuple[int, int]:
        return mask_sizes(self, query_length)

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        """Empty the layer, its norm guard too (`FixedState.reset`)."""
        if self.is_initialized:
            self.kv.reset()
            self._bookkeeping.pending.pop(self.layer_idx, None)

    def check_crop(self, max_length: int) -> None:
        """Raise what `crop(max_length)` would raise, changing nothing: this layer takes every crop."""

    def crop(self, max_length: int) -> None:
        """Negative: remove that many newest positions; positive: keep the first `max_length` (a length)."""
        if not self.is_initialized:
            return
        self.settle_norms()  # the pending norms are those of positions a crop may drop
        seq = int(self.kv.length)
        target = seq - abs(max_length) if max_length < 0 or (max_length == 0 and _compat.IS_V5) else max_length
        if target < seq:
            self.kv.crop(max(target, 0))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self.settle_norms()
            idx = beam_idx.to(self.device)
            self.kv.map_batch(lambda t: t.index_select(0, idx))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("a static cache keeps its batch size; TurboQuantStaticCache cannot drop rows")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("a static cache keeps its batch size; build it with the batch you need")

    def nbytes(self) -> dict[str, int]:
        if not self.is_initialized:
            return {"packed": 0, "residual": 0, "sinks": 0}
        return self.kv.nbytes()

    def __repr__(self) -> str:
        return f"TurboQuantStaticLayer(k{self.key_bits}v{self.value_bits}, max_cache_len={self.max_cache_len})"


class TurboQuantStaticCache(Cache):
    """Drop-in for `StaticCache` with TurboQuant-packed full-attention layers; compileable (`is_compileable`).

    Args:
        config: the model's config (required, as for `StaticCache`).
        max_cache_len: positions each layer holds; a longer sequence raises.
        max_batch_size: optional; a larger batch is refused at the first update.
        tq_config: a `TurboQuantConfig`, a preset name, a dict or None (the default preset).
        codebooks: optional calibrated codebooks (as for `TurboQuantCache`).
        **overrides: any `TurboQuantConfig` field.

    Example:

        cache = TurboQuantStaticCache(config=model.config, max_cache_len=4096)
        out = model.generate(ids, cache=cache, max_new_tokens=256)  # compiles on CUDA

    Memory: packed K/V for `max_cache_len` positions plus the window and sinks per layer, all allocated at the first
    update (`nbytes()` reports them). `TurboQuantCache` remains the cache for eager use.

    Norms past float16's range (`norm_dtype="float16"`, the default): an eager step's widen that layer's norms to
    float32 with a warning, as in `TurboQuantCache`; a compiled step cannot, and the next check raises
    (`check_norms`). `norm_dtype="float32"` stores every norm exactly from the start.
    """

    def __init__(
        self,
        config,
        max_cache_len: int,
        max_batch_size: int | None = None,
        tq_config=None,
        *,
        codebooks=None,
        offloading: bool = False,
        offload_only_non_sliding: bool = True,
        **overrides,
    ):
        if not _compat.IS_V5:
            raise RuntimeError(
                f"TurboQuantStaticCache needs transformers >= 5 (this is {_compat.TRANSFORMERS_VERSION}); "
                "use TurboQuantCache"
            )
        if isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) or max_cache_len < 1:
            raise ValueError(f"max_cache_len must be a positive integer, got {max_cache_len!r}")
        if offloading:
            raise ValueError(
                "TurboQuantStaticCache does not offload layers (offloading=True): its buffers keep fixed device "
                "addresses for CUDA graphs, and transformers' offload would move the windows without the packed state. "
                "Use TurboQuantCache(offloading=True), or no offloading: the packed cache is ~1/4 of StaticCache's bytes"
            )
        if max_batch_size is not None and (
            isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1
        ):
            raise ValueError(f"max_batch_size must be a positive integer or None, got {max_batch_size!r}")
        self.tq_config = resolve_config(tq_config, **overrides)
        _check_codebook_rotation(codebooks, self.tq_config)
        self.codebooks = codebooks
        self.capacity = max_cache_len  # (Cache.max_cache_len is a read-only property in some transformers 5.x)
        self.model_facts = model_facts(config)
        text = config.get_text_config(decoder=True)
        layer_types, layer_kwargs = _compat.layer_types_and_kwargs(config)
        if _compat.kv_sharing_producers(config):
            raise ValueError("TurboQuantStaticCache does not support models that share KV between layers")
        self.tq_config.check_layers(len(layer_types))
        self.tq_config.check_model_facts(self.model_facts)
        if codebooks is not None and hasattr(codebooks, "check_model"):
            codebooks.check_model(config)
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        kernel_scratch, bookkeeping = _KernelScratch(), _Bookkeeping()
        layers = []
        cfg = self.tq_config
        for idx, (kind, kw) in enumerate(zip(layer_types, layer_kwargs)):
            bits = cfg.bits_for_layer(idx, len(layer_types), kind)
            if kind in ("sliding_attention", "chunked_attention"):
                layers.append(cache_utils.StaticSlidingWindowLayer(max_cache_len=max_cache_len, sliding_window=kw["sliding_window"]))
            elif kind != "full_attention":
                raise ValueError(
                    f"layer {idx} has layer type {kind!r}; TurboQuantStaticCache supports full and sliding attention "
                    "(use TurboQuantCache for other models)"
                )
            elif bits is None:
                if idx in cfg.key_split:
                    raise ValueError(f"key_split names layer {idx}, which the config keeps in full precision")
                layers.append(ExactStaticLayer(max_cache_len, text, idx, bookkeeping))
            else:
                layers.append(TurboQuantStaticLayer(
                    max_cache_len=max_cache_len, key_bits=bits[0], value_bits=bits[1],
                    residual_length=cfg.residual_length, sink_tokens=cfg.sink_tokens,
                    rotation_for=partial(_rotation, seed=cfg.seed + idx, kind=cfg.rotation),
                    codebook_for=partial(_codebook, codebooks, idx, codes=cfg.codes,
                                         norm_correction=cfg.norm_correction),
                    norm_dtype=ops.NORM_DTYPES[cfg.norm_dtype],
                    layer_idx=idx, attn_config=text, query_group=heads // kv_heads, kernel_scratch=kernel_scratch,
                    bookkeeping=bookkeeping,
                    max_batch_size=max_batch_size,
                    codebook_check=partial(_check_codebooks, codebooks) if codebooks is not None else None,
                    key_split=cfg.key_split.get(idx),
                ))
        if cfg.key_centering:
            centred = [(layer, t) for layer, t in zip(layers, layer_types) if isinstance(layer, TurboQuantStaticLayer)]
            ropes = rope_angles(config, sorted({t for _, t in centred}))
            for layer, t in centred:
                layer.rope = ropes[t]
        bookkeeping.layers = [layer for layer in layers if isinstance(layer, TurboQuantStaticLayer)]
        Cache.__init__(self, layers=layers, offloading=offloading, offload_only_non_sliding=offload_only_non_sliding)

    def check_norms(self) -> None:
        """Run every layer's norm check now (the host waits for the GPU): a layer whose eager steps stored a key or
        value norm past float16's range (65504) widens its norms to float32 (with a warning); one where a compiled
        step stored or read such a norm raises, naming the layer. Every eager forward's mask runs the checks, so
        `generate` needs no call; a loop whose compiled forwards make their own mask calls it after an eager prefill,
        before the first compiled step."""
        for layer in self.layers:
            if isinstance(layer, TurboQuantStaticLayer):
                layer._bookkeeping.settle_norms()
                return

    def crop(self, max_length: int) -> None:
        """As `StaticCache.crop`, all or nothing: a layer that would refuse is found before any layer is cut."""
        crop_layers(self.layers, max_length)

    def nbytes(self) -> dict[str, int]:
        """Device bytes the cache holds, by kind; `full_precision` counts the layers kept in full precision."""
        out = {"packed": 0, "residual": 0, "sinks": 0, "full_precision": 0}
        for layer in self.layers:
            if isinstance(layer, TurboQuantStaticLayer):
                for k, v in layer.nbytes().items():
                    out[k] += v
            elif getattr(layer, "is_initialized", False):
                out["full_precision"] += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))
        out["total"] = sum(out.values())
        return out

    def __repr__(self) -> str:
        return (f"TurboQuantStaticCache(k{self.tq_config.key_bits}v{self.tq_config.value_bits}, "
                f"max_cache_len={self.capacity}, layers={len(self.layers)})")


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _max_splits(batch_heads: int, capacity: int, device: torch.device, head_dim: int, key_bits: int, value_bits: int,
                split: bool) -> int:
    """The fused kernel's splits over the whole capacity: what its scratch must hold (the launcher's own count)."""
    from ..kernels import decode_plan, num_splits_for

    _, per_sm, _ = decode_plan(head_dim, key_bits, value_bits, split, batch_heads * capacity)
    return num_splits_for(batch_heads, capacity, device, per_sm)
