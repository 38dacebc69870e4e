"""`FixedState`: a layer state of fixed capacity whose lengths live on the device (the allocation policy of
`TurboQuantStaticCache`): every shape fixed, so a compiled step can be captured in a CUDA graph.

One uint8 buffer (`packed_kv.static_parts`: packed keys/values, their norms, the sink copies, the lengths, the norm
guard, a centred layer's key mean) and a window each for keys and values, of the newest `window_size` positions kept
exact, as a ring buffer (position p at slot p % window size). Three tensors per layer, so that a compiled step's
guards and CUDA-graph input checks cost about what `StaticCache`'s two do. Every append quantizes its tokens into their
slots (`ops.static_append`); nothing is re-quantized and no branch depends on the current length.

The window is what the layer's `update` returns; it carries the `StaticKV` that the attention reads as its attribute
`turboquant_packed`. Norms past float16's range: an eager append keeps the float32 norms of what it stored
(`pending`) and records their largest in the norm guard; `settle` acts on the guard (see there).
"""

from __future__ import annotations

import dataclasses

import torch

from ..kernels import ops
from ..quant.norm_check import FP16_MAX, note_largest, stored_norms
from ..quant.packed_kv import PACKED_ATTR, PackedKV, StaticKV, static_parts, static_views
from ..quant.packing import packed_bytes
from ..quant.reference import overlay_exact
from ..quant.rope import RopeAngles, key_mean
from .layer_state import LayerState, check_tensors, is_paged



class FixedState(LayerState):
    """The buffer and windows of one static layer; see the module docstring and `LayerState`. `window_k` /
    `window_v` are the windows (the layer's `keys` / `values`)."""

    def __init__(self, quantizers, *, capacity: int, window_size: int, scratch: torch.Tensor, counters: torch.Tensor,
                 **kwargs):
        super().__init__(quantizers, **kwargs)
        if self.rope is not None:  # its angles on the device: a captured step must not copy from the host
            self.rope = RopeAngles(self.rope.theta.to(self.device), self.rope.scale)
        self.capacity, self.sinks = capacity, min(self.sink_tokens, capacity)
        self.pending: tuple | None = None  # (first position, float32 norms) of the last eager append not checked
        self.mean_pending = self.rope is not None  # a centred layer takes its key mean from its first eager append
        b, h, d = self.batch, self.heads, self.head_dim
        store, self._guard_at = self._new_store(self.norm_dtype)
        self.window_k = torch.zeros(b, h, window_size, d, dtype=self.dtype, device=self.device)
        self.window_v = torch.zeros(b, h, window_size, d, dtype=self.dtype, device=self.device)
        setattr(self.window_k, PACKED_ATTR, StaticKV(store, capacity, self.sinks, ops.dtype_name(self.norm_dtype), -1,
                                                     -1, scratch, counters))
        self.bind()

    def _key_bytes(self) -> tuple[int, tuple[int, ...]]:
        """Bytes a position takes in the packed keys, and in each further part of split keys."""
        if self.key_split is None:
            return packed_bytes(self.head_dim, self.k_codebook.bits), ()
        first, *more = self.key_split.part_bytes
        return first, tuple(more)

    def _new_store(self, norm_dtype: torch.dtype) -> tuple[torch.Tensor, int]:
        """A zeroed buffer of this layout with norms of `norm_dtype`, and its norm guard's byte offset."""
        key_bytes, more = self._key_bytes()
        parts, nbytes = static_parts(self.batch, self.heads, self.capacity, self.head_dim, key_bytes,
                                     packed_bytes(self.head_dim, self.v_codebook.bits), self.sinks, norm_dtype,
                                     self.dtype, more, self.rope is not None)
        at = next(off for name, _, _, off in parts if name == "norm_guard")
        return torch.zeros(nbytes, dtype=torch.uint8, device=self.device), at

    @property
    def source(self) -> StaticKV:
        return getattr(self.window_k, PACKED_ATTR)

    def bind(self) -> None:
        """Name the quantizers, key split and RoPE to the custom ops by this process's ids, and build what the fused
        path caches for them (made inside a captured graph, it would outlive the graph). Run when the buffers are
        made and again when the state is unpickled or copied: ids never leave their process."""
        s = self.source
        setattr(self.window_k, PACKED_ATTR, dataclasses.replace(
            s, k_quantizer=ops.quantizer_id(self.rotation, self.k_codebook),
            v_quantizer=ops.quantizer_id(self.rotation, self.v_codebook), key_split=ops.object_id(self.key_split),
            key_rope=ops.object_id(self.rope)))
        if self.key_split is not None:
            for r, cb in self.key_split.parts:
                ops.quantizer_id(r, cb)
        ops.prepare_fused(self.view())
        if self.rope is not None:
            d, dev = self.head_dim, self.window_k.device
            self.rope.scores(torch.zeros(1, d, device=dev), torch.zeros(1, d, device=dev), 0, self.capacity)
        for t in (s.store, s.scratch, s.counters, self.window_k, self.window_v):
            mark_static(t)

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.bind()

    def view(self) -> PackedKV:
        """The state as a `PackedKV` of views of the buffer and windows (traced as view ops when compiled)."""
        s = self.source
        return ops.static_packed_kv(s.store, self.window_k, self.window_v, s.capacity, s.sinks, s.norm_dtype,
                                    s.k_quantizer, s.v_quantizer, s.scratch, s.counters, s.key_split, s.key_rope)

    def views(self) -> dict[str, torch.Tensor]:
        """Views of the buffer by part name (`packed_kv.static_views`)."""
        key_bytes, more = self._key_bytes()
        return static_views(self.source.store, self.window_k, self.capacity, self.sinks, self.norm_dtype, key_bytes,
                            packed_bytes(self.head_dim, self.v_codebook.bits), more, self.rope is not None)

    @property
    def length(self) -> torch.Tensor:
        """Positions held, a 0-d int64 tensor on the device (a view of the buffer)."""
        return self.view().length

    # ---- the write path ----------------------------------------------------------------------------------------

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor, before: int | None, compiling: bool,
               length_read: torch.Tensor | None) -> bool:
        """Quantize the new tokens into their slots and the window. An eager float16 append keeps its float32 norms
        (`pending`, checked later: the host does not wait for the GPU here) and returns True. `length_read`: a
        compiled step's read of the length before the append."""
        s, n = self.source, key_states.shape[2]
        if self.mean_pending and not compiling:
            self._set_key_mean(key_states)
        half = self.norm_dtype == torch.float16
        norms = self._exact_norms(key_states, value_states, before) if half and not compiling and n else None
        ops.static_append(key_states, value_states, s.store, self.window_k, self.window_v, s.capacity, s.sinks,
                          s.norm_dtype, s.k_quantizer, s.v_quantizer, s.key_split, s.key_rope, length_read,
                          half and compiling)
        if norms is None:
            return False
        note_largest(self.norm_guard()[1], norms)
        self.pending = (before, norms)
        return True

    def _set_key_mean(self, key_states: torch.Tensor) -> None:
        """A centred layer's mu: the pre-RoPE mean of the first update's keys past the sinks, as `GrowableState`
        takes it (eager, at length 0: later positions' codes depend on it). Without such keys it stays 0 (no
        centring), as it does for a first update inside a compiled step."""
        self.mean_pending = False
        if int(self.length) != 0 or key_states.shape[2] <= self.sink_tokens:
            return
        pos = torch.arange(key_states.shape[2], device=key_states.device)
        first = self.sink_tokens
        self.view().key_offset.mu.copy_(key_mean(self.rope, key_states[:, :, first:], pos[first:]))

    def _exact_norms(self, key_states: torch.Tensor, value_states: torch.Tensor, start: int) -> list[torch.Tensor]:
        """The float32 norms an eager append at position `start` stores: of each key part's codes (k - R(t) mu for
        centred keys), then of the values."""
        codes = key_states
        if self.rope is not None:
            pos = torch.arange(start, start + key_states.shape[2], device=key_states.device)
            codes = key_states.float() - self.rope.apply(self.view().key_offset.mu, pos)
        parts = self.key_split.split(codes) if self.key_split is not None else [codes]
        return stored_norms([*parts, value_states], [*self._key_quantizers(), (self.rotation, self.v_codebook)])

    def _key_quantizers(self) -> list:
        return list(self.key_split.parts) if self.key_split is not None else [(self.rotation, self.k_codebook)]

    def norm_guard(self) -> torch.Tensor:
        """The buffer's norm guard (`packed_kv.static_parts`): [largest finite norm a compiled append stored or
        read, largest an eager append stored since the last check], a (2,) float32 view."""
        return self.source.store[self._guard_at : self._guard_at + 8].view(torch.float32)

    def settle(self, guard: list[float]) -> tuple[bool, float, float]:
        """Act on the norm guard's values: widen the norms where the unchecked eager append stored one past
        float16's range (its exact norms replace the stored ones). Returns (whether it widened, the largest norm an
        eager append stored, the largest a compiled step stored or read); the check stays pending until the norms
        are final (an error while widening leaves it so)."""
        compiled, eager = guard
        widen = self.pending is not None and eager > FP16_MAX
        if widen:
            self._widen_norms(*self.pending)
        if self.pending is not None:
            self.norm_guard()[1].zero_()
            self.pending = None
        return widen, eager, compiled

    def _widen_norms(self, start: int, norms: list[torch.Tensor]) -> None:
        """Re-lay the buffer out with float32 norms (a new buffer: the caller is outside any captured graph, and a
        compiled step recompiles for it), then write `norms` (key parts', values') at positions [start, start + n)."""
        old = self.views()
        store, at = self._new_store(torch.float32)
        key_bytes, more = self._key_bytes()
        new = static_views(store, self.window_k, self.capacity, self.sinks, torch.float32, key_bytes,
                           packed_bytes(self.head_dim, self.v_codebook.bits), more, self.rope is not None)
        for name, t in old.items():
            if name not in ("length", "exact_from"):
                new[name].copy_(t)
        names = ["k_norms", *(f"k{p}_norms" for p in range(1, len(more) + 1)), "v_norms"]
        for name, n in zip(names, norms):
            new[name][:, :, start : start + n.shape[2]].copy_(n)
        setattr(self.window_k, PACKED_ATTR, dataclasses.replace(self.source, store=store, norm_dtype="float32"))
        self.norm_dtype, self._guard_at = torch.float32, at
        mark_static(store)

    # ---- the read path -----------------------------------------------------------------------------------------

    def dense(self, key_states: torch.Tensor, value_states: torch.Tensor, stop: int, held: int):
        """Keys and values of positions [0, held) after this step's append: the first `stop` slots dequantized, the
        exact copies and the step's own tokens over them."""
        p, name, n = self.view(), ops.dtype_name(self.dtype), key_states.shape[2]
        pos = p.length - n + torch.arange(n, device=self.device)  # this step's, after the append
        if p.key_split is None:
            k = ops.dequantize(p.k_packed[:, :, :stop], p.k_norms[:, :, :stop], p.k_quantizer, name)
        else:  # each part dequantized (its own quantizer id), then its channels put back in their places
            dense = [ops.dequantize(pk[:, :, :stop], nk[:, :, :stop], ops.quantizer_id(r, cb), name)
                     for (pk, nk), (r, cb) in zip(p.key_parts, p.key_split.parts)]
            k = p.key_split.join(dense, dense[0].new_empty(*dense[0].shape[:-1], self.head_dim))
        if p.key_offset is not None:  # centred: the packed keys are k - R(t) mu
            p.key_offset.add_to(k, 0)
        v = ops.dequantize(p.v_packed[:, :, :stop], p.v_norms[:, :, :stop], p.v_quantizer, name)
        overlay_exact(k, self.window_k, p.sink_k[:, :, : p.sinks], p.length, p.exact_from)
        overlay_exact(v, self.window_v, p.sink_v[:, :, : p.sinks], p.length, p.exact_from)
        k.index_copy_(2, pos, key_states)
        v.index_copy_(2, pos, value_states)
        return k[:, :, :held], v[:, :, :held]

    # ---- edits -------------------------------------------------------------------------------------------------

    def crop(self, target: int) -> None:
        """Keep the first `target` positions."""
        p = self.view()
        p.length.fill_(target)
        p.exact_from.clamp_(max=target)

    def reset(self) -> None:
        """Empty the state, its norm guard too. Norms widened to float32 stay so: the buffers keep their addresses."""
        for t in (self.source.store, self.window_k, self.window_v):
            t.zero_()
        self.mean_pending = self.rope is not None
        self.pending = None

    def map_batch(self, fn) -> None:
        """Apply a batch-dim map to every tensor, in place (their addresses stay, as compiled graphs need)."""
        p = self.view()
        keys = [t for part in p.key_parts for t in part] if p.key_parts else [p.k_packed, p.k_norms]
        if p.key_offset is not None:
            keys.append(p.key_offset.mu)
        for t in (*keys, p.v_packed, p.v_norms, p.sink_k, p.sink_v, self.window_k, self.window_v):
            t.copy_(fn(t))

    def nbytes(self) -> dict[str, int]:
        p = self.view()
        size = lambda *ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        keys = [t for part in p.key_parts for t in part] if p.key_parts else [p.k_packed, p.k_norms]
        return {"packed": size(*keys, p.v_packed, p.v_norms), "residual": size(self.window_k, self.window_v),
                "sinks": size(p.sink_k, p.sink_v)}

    # ---- state by name -----------------------------------------------------------------------------------------

    def lengths(self) -> dict[str, int]:
        """Positions held and the first position the window holds (the host reads the device)."""
        length, exact_from = (int(x) for x in self.views()["lengths"])
        return {"length": length, "exact_from": exact_from}

    def state(self) -> dict[str, torch.Tensor]:
        """Views of everything held, by name (`layer_state`): the codes and norms (all `capacity` rows), the sinks
        (`sinks` + 1 rows), the key mean and the windows ("window_k", "window_v"). Writing into them writes the state.
        The caller settles the norm check first."""
        views = self.views()
        for name in ("length", "exact_from", "norm_guard", "lengths"):
            views.pop(name)
        return {**views, "window_k": self.window_k, "window_v": self.window_v}

    def load_state(self, tensors: dict[str, torch.Tensor], lengths: dict[str, int], where: str = "load_state") -> None:
        """Write `tensors` (as `state()` names them, paged ones cut to `lengths["length"]` rows) and the lengths;
        refused whole, naming the bad tensor, before anything changes."""
        views, n = self.state(), lengths["length"]
        dst = {name: v[:, :, :n] if is_paged(name) else v for name, v in views.items()}
        check_tensors(where, tensors, {name: (tuple(v.shape), v.dtype) for name, v in dst.items()})
        for name, v in dst.items():
            v.copy_(tensors[name])
        self.views()["lengths"].copy_(torch.tensor([n, lengths["exact_from"]], dtype=torch.int64))
        self.mean_pending = False  # the key mean, when there is one, came with the state


def mark_static(t: torch.Tensor) -> None:
    if not torch.compiler.is_compiling():
        torch._dynamo.mark_static_address(t)
