"""Dispatch to the kernels (Triton and CUDA on a GPU, C on a CPU) or the torch reference, as `kernels.select` answers,
and the custom ops (`tq_hf_cache::...`) that the static cache's compiled steps trace as opaque calls.

The cache calls only these functions; they write into caller-owned buffers so that no per-call
allocation of the packed or dequantized data is needed.
"""

from __future__ import annotations

import weakref

import torch

from .. import kernels
from ..quant import reference
from . import select
from ..quant.codebook import Codebook
from ..quant.norm_check import note_largest, stored_norms
from ..quant.rotation import Rotation


def _kernel_ok(t: torch.Tensor, rotation: Rotation, codebook: Codebook, quantize: bool = True) -> bool:
    return select.quantize_kernel(t, rotation, codebook, quantize)


def quantize_into(
    x: torch.Tensor,
    rotation: Rotation,
    codebook: Codebook,
    packed_out: torch.Tensor,
    norms_out: torch.Tensor,
) -> None:
    """Quantize x (B, H, T, D) into packed_out (B, H, T, nbytes) uint8 and norms_out (B, H, T)."""
    if _kernel_ok(x, rotation, codebook):
        kernels.quantize_into(x, rotation, codebook, packed_out, norms_out)
        return
    packed, norms = reference.quantize(x, rotation, codebook, norms_out.dtype)
    packed_out.copy_(packed)
    norms_out.copy_(norms)


def dequantize_into(
    packed: torch.Tensor,
    norms: torch.Tensor,
    rotation: Rotation,
    codebook: Codebook,
    out: torch.Tensor,
) -> None:
    """Dequantize packed (B, H, T, nbytes) + norms (B, H, T) into out (B, H, T, D), in out's dtype."""
    if _kernel_ok(out, rotation, codebook, quantize=False):
        kernels.dequantize_into(packed, norms, rotation, codebook, out)
        return
    out.copy_(reference.dequantize(packed, norms, rotation, codebook, out.dtype))


def quantize_kv_into(
    k: torch.Tensor,
    v: torch.Tensor,
    rotation: Rotation,
    k_codebook: Codebook,
    v_codebook: Codebook,
    k_packed: torch.Tensor,
    k_norms: torch.Tensor,
    v_packed: torch.Tensor,
    v_norms: torch.Tensor,
) -> None:
    """`quantize_into` for a layer's keys and values; one kernel launch for both on CUDA (decode steps)."""
    if (
        _kernel_ok(k, rotation, k_codebook)
        and _kernel_ok(v, rotation, v_codebook)
        and k.shape == v.shape
        and k.dtype == v.dtype
        and k_norms.dtype == v_norms.dtype
    ):
        kernels.quantize_kv_into(k, v, rotation, k_codebook, v_codebook, k_packed, k_norms, v_packed, v_norms)
        return
    quantize_into(k, rotation, k_codebook, k_packed, k_norms)
    quantize_into(v, rotation, v_codebook, v_packed, v_norms)


def quantize_split_into(x: torch.Tensor, split, outs) -> None:
    """Split keys (`key_split.KeySplit`): x (B, H, T, D) into each part's (packed, norms) of `outs` (the kernels, or
    the reference, on each part)."""
    for part, (rot, cb), (packed, norms) in zip(split.split(x), split.parts, outs):
        quantize_into(part, rot, cb, packed, norms)


def dequantize_split_into(parts, split, out: torch.Tensor) -> None:
    """Split keys, per part (packed, norms), back into out (B, H, T, D) in out's dtype: each part dequantized, then
    its channels put back."""
    dense = []
    for (packed, norms), (rot, cb) in zip(parts, split.parts):
        dense.append(out.new_empty(*out.shape[:-1], rot.dim))
        dequantize_into(packed, norms, rot, cb, dense[-1])
    split.join(dense, out)


# --- custom ops: what torch.compile sees of a static TurboQuant layer ---------------------------------------------
# Each op is opaque to dynamo (no graph break) and has a fake implementation for shapes. Custom ops take tensors and
# scalars only, so a layer's quantizers (rotation + codebook on one device), key split and RoPE reach them as ids.
# The layer owns the objects; the ids hold them weakly (an entry dies with the last cache that uses it) and are made
# again from the objects whenever a layer is unpickled or copied, so an id never outlives or leaves its process.


class _Ids:
    """Ids of weakly held objects. `key` names an entry: content for quantizers (every cache holding equal ones
    shares the id, so successive caches compile to the same graph), identity for the rest. An entry lives while
    one of the object tuples registered under it does; an identity key dies with its object, so no id is reused."""

    def __init__(self, kind: str):
        self.kind = kind
        self._ids: dict = {}  # key -> id
        self._refs: dict[int, list[tuple]] = {}  # id -> weak references of each holder's objects
        self._dead: list[tuple] = []  # (key, id, weak reference) of holders gone since the last sweep
        self._next = 0

    def _sweep(self) -> None:
        """Forget the holders that died, the entry with its last holder, and an identity key with its object. Run
        from `id_for` and `len`, never from a weakref callback: a callback can fire while torch.compile traces
        `get`, and the lists it reads must not change under it (dynamo guards on them)."""
        while self._dead:
            key, oid, ref = self._dead.pop()
            held = self._refs.get(oid)
            if held is None:
                continue
            held[:] = [refs for refs in held if not any(r is ref for r in refs)]
            if not held:
                del self._refs[oid]
                if key[0] == "identity":
                    self._ids.pop(key, None)

    def id_for(self, key, *objects) -> int:
        self._sweep()
        oid = self._ids.get(key)
        if oid is None:
            oid = self._ids[key] = self._next
            self._next += 1
        held = self._refs.setdefault(oid, [])
        if not any(all(r() is o for r, o in zip(refs, objects)) for refs in held):
            held.append(tuple(weakref.ref(o, _drop(self, key, oid)) for o in objects))
        return oid

    def get(self, oid: int) -> tuple:
        for refs in self._refs.get(oid, ()):
            objs = tuple(r() for r in refs)
            if all(o is not None for o in objs):
                return objs
        raise ValueError(
            f"unknown {self.kind} id {oid}: ids name the objects of live caches in this process (made by their "
            "layers, again when a cache is unpickled or copied); this one was never made here or its cache is gone"
        )

    def every(self, oid: int) -> list[tuple]:
        """The object tuples of every live holder of an id (`get` answers with the first)."""
        live = [tuple(r() for r in refs) for refs in self._refs.get(oid, ())]
        return [objs for objs in live if all(o is not None for o in objs)]

    def __len__(self) -> int:
        self._sweep()
        return len(self._refs)


def _drop(ids: _Ids, key, oid: int):
    """The weakref callback of one holder's objects: note it for the next sweep (`_Ids._sweep`)."""

    def callback(ref):
        ids._dead.append((key, oid, ref))

    return callback


_QUANTIZERS = _Ids("quantizer")
_OBJECTS = _Ids("object")
_OUT_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def quantizer_id(rotation: Rotation, codebook: Codebook) -> int:
    """The id of (rotation, codebook), held weakly: the same id for the same content on the same device."""
    key = (rotation.kind, rotation.dim, rotation.seed, str(rotation.matrix.device), codebook.bits,
           codebook.fingerprint or id(codebook), str(codebook.centroids.device))
    if not codebook.fingerprint:  # named by identity: the key dies with the codebook
        key = ("identity", *key)
    return _QUANTIZERS.id_for(key, rotation, codebook)


def quantizer(qid: int) -> tuple[Rotation, Codebook]:
    return _QUANTIZERS.get(qid)


def object_id(obj) -> int:
    """The id of a static layer's `key_split.KeySplit` or `rope.RopeAngles` (custom ops take ints, not objects),
    held weakly; -1 for None."""
    if obj is None:
        return -1
    return _OBJECTS.id_for(("identity", id(obj)), obj)


def object_of(oid: int, kind: type | None = None):
    """The object of an id (of type `kind` when given), None for -1."""
    if oid == -1:
        return None
    (obj,) = _OBJECTS.get(oid)
    if kind is not None and not isinstance(obj, kind):
        raise ValueError(f"object id {oid} names a {type(obj).__name__}, not a {kind.__name__}")
    return obj


def live_ids() -> dict[str, int]:
    """How many quantizer and object entries are alive (tests check that a deleted cache releases its own)."""
    return {"quantizers": len(_QUANTIZERS), "objects": len(_OBJECTS)}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


NORM_DTYPES = {"float16": torch.float16, "float32": torch.float32}


def static_packed_kv(store: torch.Tensor, window_k: torch.Tensor, window_v: torch.Tensor, capacity: int, sinks: int,
                     norm_dtype: str, k_quantizer: int, v_quantizer: int, scratch=None, counters=None,
                     key_split: int = -1, key_rope: int = -1):
    """The `PackedKV` (views) of a static layer's one buffer (`packed_kv.static_parts`) and its windows; `key_split`:
    the `object_id` of its keys' split, `key_rope`: that of its RoPE when its keys are centred (the packed keys are
    k - R(t) mu, mu in the buffer), or -1."""
    from ..quant.key_split import KeySplit
    from ..quant.packed_kv import PackedKV, static_views
    from ..quant.packing import packed_bytes
    from ..quant.rope import KeyOffset, RopeAngles

    if norm_dtype not in NORM_DTYPES:
        raise ValueError(f"norm_dtype must be one of {sorted(NORM_DTYPES)}, got {norm_dtype!r}")
    rotation, kcb = quantizer(k_quantizer)
    _, vcb = quantizer(v_quantizer)
    d = rotation.dim
    split, rope = object_of(key_split, KeySplit), object_of(key_rope, RopeAngles)
    kbytes, more = packed_bytes(d, kcb.bits), ()
    if split is not None:
        kbytes, *more = split.part_bytes
        kcb = split.parts[0][1]
    p = static_views(store, window_k, capacity, sinks, NORM_DTYPES[norm_dtype], kbytes, packed_bytes(d, vcb.bits),
                     tuple(more), rope is not None)
    parts = None
    if split is not None:
        parts = tuple((p[f"k{i or ''}_packed"], p[f"k{i or ''}_norms"]) for i in range(len(split.parts)))
    return PackedKV(p["k_packed"], p["k_norms"], p["v_packed"], p["v_norms"], p["sink_k"], p["sink_v"], window_k,
                    window_v, p["length"], p["exact_from"], rotation, kcb, vcb, sinks, k_quantizer, v_quantizer,
                    scratch, counters, key_split=split, key_parts=parts,
                    key_offset=None if rope is None else KeyOffset(p["key_mean"], rope, 0), norm_guard=p["norm_guard"])


@torch.library.custom_op("tq_hf_cache::snapshot", mutates_args=())
def snapshot(x: torch.Tensor) -> torch.Tensor:
    """A copy of x that torch.compile keeps as a buffer of its own (it drops a plain clone as a no-op): a value read
    from a buffer that a later op of the graph mutates (else read after the mutation, from a copy of the whole
    buffer), or one that many ops take (else built again inside each of their kernels)."""
    return x.clone()


@snapshot.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("tq_hf_cache::static_append", mutates_args=("store", "window_k", "window_v"))
def static_append(
    key: torch.Tensor,
    value: torch.Tensor,
    store: torch.Tensor,
    window_k: torch.Tensor,
    window_v: torch.Tensor,
    capacity: int,
    n_sinks: int,
    norm_dtype: str,
    k_quantizer: int,
    v_quantizer: int,
    key_split: int = -1,
    key_rope: int = -1,
    after: torch.Tensor | None = None,
    check_norms: bool = False,
) -> None:
    """A static layer's append of key, value (B, H, n, D) into its buffer and windows, with its lengths on the device
    (see `reference.static_append`): two launches on CUDA (quantize + exact copies, then the lengths; split or
    centred keys (`key_split`, `key_rope`: `object_id`s): a launch per key part), the reference elsewhere. Centred
    keys store the codes of k - R(t) mu and the exact copies of k. `after`: unused here; a value the caller read from
    the buffer before this append, passed so that a compiled graph computes it first (and can append in place).
    `check_norms`: a compiled step's float16 norms, which cannot widen there: record in the buffer's norm guard the
    largest finite norm this append stores, and any that eager appends left unsettled (see `static_cache`)."""
    kv = static_packed_kv(store, window_k, window_v, capacity, n_sinks, norm_dtype, k_quantizer, v_quantizer,
                          key_split=key_split, key_rope=key_rope)
    rotation, kcb, vcb, split = kv.rotation, kv.k_codebook, kv.v_codebook, kv.key_split
    args = (key, value, kv.k_packed, kv.k_norms, kv.v_packed, kv.v_norms, window_k, window_v, kv.sink_k, kv.sink_v,
            kv.length, kv.exact_from, n_sinks)
    codes = key
    if kv.key_offset is not None:
        pos = kv.length + torch.arange(key.shape[2], device=key.device)
        codes = key.float() - kv.key_offset.rope.apply(kv.key_offset.mu, pos)
    inputs = split.split(codes) if split is not None else [codes]
    quantizers = split.parts if split is not None else ((rotation, kcb),)
    corrected = any(cb.norm_correction for _, cb in (*quantizers, (rotation, vcb)))
    if check_norms and select.triton_runs(key) and not corrected:
        kernels.note_largest_norm(kv.norm_guard, [*inputs, value])
    elif check_norms:
        note_largest(kv.norm_guard[0], stored_norms([*inputs, value], [*quantizers, (rotation, vcb)]))
        torch.maximum(kv.norm_guard[0], kv.norm_guard[1], out=kv.norm_guard[0])
    if split is not None or kv.key_offset is not None:
        outs = kv.key_parts if split is not None else ((kv.k_packed, kv.k_norms),)
        if _kernel_ok(value, rotation, vcb) and all(_kernel_ok(key, rot, cb) for rot, cb in quantizers):
            kernels.append_parts_into(key, value, inputs, quantizers, outs, rotation, vcb, *args[4:])
            return
        reference.static_append(*args, rotation, kcb, vcb, key_split=split, key_parts=kv.key_parts, key_codes=codes)
        return
    if _kernel_ok(key, rotation, kcb) and _kernel_ok(value, rotation, vcb):
        kernels.append_kv_into(key, value, rotation, kcb, vcb, *args[2:])
        return
    reference.static_append(*args, rotation, kcb, vcb)


@static_append.register_fake
def _(key, value, store, window_k, window_v, capacity, n_sinks, norm_dtype, k_quantizer, v_quantizer, key_split=-1,
      key_rope=-1, after=None, check_norms=False):
    return None


@torch.library.custom_op("tq_hf_cache::dequantize", mutates_args=())
def dequantize(packed: torch.Tensor, norms: torch.Tensor, quantizer_id: int, dtype: str) -> torch.Tensor:
    """packed (B, H, T, bytes) + norms (B, H, T) -> (B, H, T, D) in `dtype`."""
    rotation, codebook = quantizer(quantizer_id)
    b, h, t, _ = packed.shape
    out = torch.empty(b, h, t, rotation.dim, dtype=_OUT_DTYPES[dtype], device=packed.device)
    dequantize_into(packed, norms, rotation, codebook, out)
    return out


@dequantize.register_fake
def _(packed, norms, quantizer_id, dtype):
    rotation, _ = quantizer(quantizer_id)
    b, h, t, _ = packed.shape
    return packed.new_empty(b, h, t, rotation.dim, dtype=_OUT_DTYPES[dtype])


def fused_decode(query: torch.Tensor, kv, mask: torch.Tensor | None, scale: float | None, *, fused: bool = True,
                 quiet: bool = False) -> torch.Tensor | None:
    """`decode_attention` where a fused kernel serves this step (`select.for_step`, its one warning per reason
    unless `quiet`; `fused=False`: only the workspace path is wanted), else None: the caller attends over dense
    keys and values instead."""
    choice = select.for_step(query, kv, fused=fused, quiet=quiet)
    return decode_attention(query, kv, mask, scale, choice) if choice.fused else None


def static_step_fused(device: torch.device, head_dim: int, key_bits: int, value_bits: int, group: int, n: int,
                      split, capacity: int, key_rows: int, pair: bool = False) -> bool:
    """Whether a static layer's step of n queries is served by a fused kernel (`select.step`: static facts only,
    so a compiled step's answer is a constant)."""
    return select.step(device, head_dim, key_bits, value_bits, group, n, split, capacity, key_rows, static=True,
                       quiet=True, pair=pair).fused


def decode_attention(query: torch.Tensor, kv, mask: torch.Tensor | None, scale: float | None,
                     choice: select.Choice | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of query (B, Hq, n, D) over a `PackedKV` -> (B, n, Hq, D) by the kernel `choice` names (made by
    `select` for this step where not given): the CUDA kernel, the Triton kernel, the C kernels on a CPU (a static
    layer through `kernels.cpu.dynamic_view`), or the torch math (`reference.packed_attention` for a dynamic layer,
    `reference.static_attention` for a static one). Where the chosen launcher declines at launch, its fallback
    serves. out: written where given (the GPU launchers write into it; the others' result is copied)."""
    if getattr(kv, "key_offset", None) is not None:
        mask = _static_centring_mask(query, kv, mask, scale) if kv.static else _centring_mask(query, kv, mask, scale)
    if choice is None or not choice.fused:
        choice = select.for_packed(query, kv)
    for name in (choice.kernel, choice.fallback, "torch"):
        got = _launch(name, query, kv, mask, scale, choice.chunk if name == choice.kernel else 0, out)
        if got is not None:
            break
    if out is not None and got is not out:
        return out.copy_(got)
    return got


def _launch(kernel: str, query: torch.Tensor, kv, mask, scale, chunk: int = 0, out=None) -> torch.Tensor | None:
    """The launcher of `kernel`; None where it declines this call (its layout, a failed build)."""
    if kernel == "cuda":
        from . import cuda

        try:
            return cuda.decode_attention(query, kv, mask, scale, out=out, chunk=chunk)
        except cuda.jit.JitError as e:
            select.cuda_failed(query.device, str(e).splitlines()[0])
            return None
    if kernel == "triton":
        from . import decode_attention as triton_launcher

        return triton_launcher.decode_attention(query, kv, mask, scale, out=out)
    if kernel == "cpu":
        from . import cpu

        view = cpu.dynamic_view(kv) if kv.static else kv
        return cpu.decode_attention(query, view, mask, scale) if cpu.serves(query, view) else None
    if kv.static:
        return reference.static_attention(query, kv, mask, scale)
    return reference.packed_attention(query, kv, mask, scale)


def _centring_mask(query: torch.Tensor, kv, mask: torch.Tensor | None, scale: float | None) -> torch.Tensor:
    """An additive mask (B, Hq, n, T) float32 that adds scale * q . R(t) mu to the scores of a centred layer's
    packed positions (its sinks and window are exact) and keeps what `mask` (or, without one, causality) allows."""
    b, hq, n, d = query.shape
    t, lq, ns = int(kv.length), int(kv.exact_from), kv.sinks
    bias = query.new_zeros(b, hq, n, t, dtype=torch.float32)
    if lq > ns:
        bias[..., ns:lq] = kv.key_offset.scores(query, ns, lq) * (d**-0.5 if scale is None else scale)
    if mask is None and n == 1:  # one query at the last position sees every key
        return bias
    return _under_mask(bias, mask, t)


def _static_centring_mask(query: torch.Tensor, kv, mask: torch.Tensor | None, scale: float | None) -> torch.Tensor:
    """`_centring_mask` for a static layer, on the device only (a CUDA graph replays it): (B, Hq, n, capacity)
    float32, scale * q . R(t) mu on the packed positions the layer reads packed (sinks <= t < exact_from), what
    `mask` (or causality over [0, length)) allows elsewhere."""
    b, hq, n, d = query.shape
    cap = kv.capacity
    pos = torch.arange(cap, device=query.device)
    packed = (pos >= kv.sinks) & (pos < kv.exact_from)
    bias = kv.key_offset.scores(query, 0, cap) * (d**-0.5 if scale is None else scale)
    return _under_mask(bias * packed, mask, kv.length)


def _under_mask(bias: torch.Tensor, mask: torch.Tensor | None, length) -> torch.Tensor:
    """bias (B, Hq, n, T) where `mask` (boolean, or additive: added) allows a key, -inf elsewhere; without a mask,
    causality: query i sees the positions <= length - n + i (`length` a host int or a device tensor)."""
    n, t = bias.shape[-2:]
    if mask is None:
        pos = torch.arange(t, device=bias.device)
        allowed = pos[None, :] <= (length - n + torch.arange(n, device=bias.device))[:, None]
        return bias.masked_fill(~allowed, float("-inf"))
    mask = mask[..., :t]
    if mask.dtype == torch.bool:
        return bias.masked_fill(~mask, float("-inf"))
    return bias + mask.float()


def prepare_fused(kv) -> None:
    """Build now, outside any CUDA graph, the tables that the kernels which can run here read of a static layer's
    quantizers (decode lookup and pair tables, Pi's fragments, the codebooks' search tables), each held by its
    rotation or codebook: made while torch.compile's cudagraph trees record, they would come from the graph's pool
    and outlive the recording. Built for every live quantizer the layer's ids name: an id resolves to whichever of
    them lives (equal codebooks of another cache, or of this one's copy, which may hold tables of their own)."""
    dev, heads = kv.k_packed.device, kv.k_packed.shape[1]
    if kv.key_split is not None:
        keys = list(kv.key_split.parts)
    else:
        keys = [(kv.rotation, kv.k_codebook), *(_QUANTIZERS.every(kv.k_quantizer) if kv.k_quantizer >= 0 else ())]
    values = [(kv.rotation, kv.v_codebook), *(_QUANTIZERS.every(kv.v_quantizer) if kv.v_quantizer >= 0 else ())]
    if select.machine_runs("triton", dev):
        from .decode_attention import lookup_table
        from .quantize import prepare

        for _, codebook in (*keys, *values):
            lookup_table(codebook, heads, dev)
            prepare(codebook, heads, dev)
    if kv.key_split is None and select.machine_runs("cuda", dev):
        from . import cuda

        for rotation, codebook in (*keys, *values):
            cuda.prepare(rotation, codebook, codebook, heads, dev)


@torch.library.custom_op("tq_hf_cache::static_attention", mutates_args=("scratch", "counters"))
def static_attention(
    query: torch.Tensor,
    window_k: torch.Tensor,
    window_v: torch.Tensor,
    store: torch.Tensor,
    mask: torch.Tensor | None,
    capacity: int,
    sinks: int,
    norm_dtype: str,
    k_quantizer: int,
    v_quantizer: int,
    scale: float,
    scratch: torch.Tensor,
    counters: torch.Tensor,
    key_split: int = -1,
    key_rope: int = -1,
) -> torch.Tensor:
    """Attention of query (B, Hq, n, D) over a static layer's positions (its buffer and windows, see `PackedKV`) ->
    (B, n, Hq, D), by the kernel `kernels.select` names for it (see `decode_attention`)."""
    kv = static_packed_kv(store, window_k, window_v, capacity, sinks, norm_dtype, k_quantizer, v_quantizer, scratch,
                          counters, key_split, key_rope)
    return decode_attention(query, kv, mask, scale)


@static_attention.register_fake
def _(query, window_k, window_v, store, mask, capacity, sinks, norm_dtype, k_quantizer, v_quantizer, scale, scratch,
      counters, key_split=-1, key_rope=-1):
    b, hq, n, d = query.shape
    return query.new_empty(b, n, hq, d)
