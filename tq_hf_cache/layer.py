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
often having small keys, so their quantization error costs more than anyone else's (benchmarks/key_fix_study.py at
commit 7f635a3). A full-attention layer keeps an exact copy of them and writes it over their dequantized
slots; they are quantized and packed like every other token, so nothing else changes shape.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from .codebook import Codebook, theoretical_codebook
from .key_split import KeySplit, make_split
from .layer_edits import LayerEdits
from .layer_read import LayerRead
from .layer_store import LayerStore
from .packed_buffer import GROW_TOKENS, PackedBuffer  # noqa: F401  (GROW_TOKENS: imported from here too)
from .packed_kv import MAX_FUSED_QUERIES
from .rope import RopeAngles
from .workspace import Workspace

# During decode the residual window may run up to this many tokens past residual_length before its oldest
# tokens are quantized together: one quantize launch and no allocation per FLUSH_BLOCK decode steps
FLUSH_BLOCK = 32
MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class TurboQuantLayer(LayerStore, LayerRead, LayerEdits, DynamicLayer):
    """A full-attention layer whose history is TurboQuant-packed; see the module docstring. Its write path, read
    path and edits live in `layer_store`, `layer_read` and `layer_edits`."""

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


def _query_length(arg) -> int:
    """transformers 5.x passes the query length; 4.x passes cache_position."""
    if isinstance(arg, torch.Tensor):
        return int(arg.shape[0])
    return int(arg)
