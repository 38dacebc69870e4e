"""`attn_implementation="turboquant"`: transformers attention that reads TurboQuant-packed K/V directly.

`import tq_hf_cache` registers the name in transformers' `AttentionInterface` and, with the sdpa mask function,
in `ALL_MASK_ATTENTION_FUNCTIONS` (`register()` does it again, idempotently, e.g. after a transformers reload).
Nothing here imports Triton until a fused step runs on CUDA.

What the function does with the keys a layer returned (`packed_kv.packed_source(key)`):
- no PackedKV (DynamicCache, no cache, layers kept in full precision, prefill chunks): transformers' SDPA.
- a static layer's (`TurboQuantStaticCache`): the fused custom op `tq_hf_cache::static_attention`.
- a dynamic layer's (`TurboQuantCache` decode steps and prefill chunks over a packed history): the fused kernel
  (CUDA; on a CPU its C counterpart, `kernels.cpu`), where the step fits it (few queries, head dim 64 / 128, or 256 at the group widths, no
  dropout or extra features); otherwise SDPA on the keys and values themselves, which are `LazyKV`s that fill on
  first use. A long chunk of a large batch is attended a group of batch rows at a time (`ROW_GROUP_BYTES`): the
  dense history, and the copies per query head that SDPA makes under a mask, then exist for one group, not for the
  whole batch.
Under transformers' "sdpa" attention (the default), `scaled_dot_product_attention` on a dynamic layer's LazyKVs runs
the same fused attention (`sdpa_on_packed`), so `generate(cache=TurboQuantCache(...))` reads the packed K/V on decode
steps without any setting on the model; "turboquant" adds the row-grouped long chunks and the static cache's op.
Nothing is remembered between calls: which attention runs is decided by the model at every step, and the cache
gives every implementation what it needs.
"""

from __future__ import annotations

import logging
import weakref

import torch
from torch.utils._pytree import tree_map_only

from ..kernels import ops  # registers the tq_hf_cache:: custom ops
from ..quant.packed_kv import MAX_FUSED_QUERIES, PACKED_ATTR, PackedKV, StaticKV, packed_source

NAME = "turboquant"
# dense bytes one row group of a long step may take: its keys and values plus SDPA's copies per query head
ROW_GROUP_BYTES = 512 * 2**20
_UNSUPPORTED_KWARGS = ("s_aux", "sinks", "softcap", "position_bias", "head_mask")

logger = logging.getLogger(__name__)
_warned: set = set()


def _unsupported(kwargs) -> list[str]:
    """The attention features among kwargs that the fused op and the row-group path do not serve."""
    return [k for k in _UNSUPPORTED_KWARGS if kwargs.get(k) is not None]


def _sdpa(*args, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(*args, **kwargs)


def _warn_once(key, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(msg)


def _takes(query, dropout, kwargs) -> bool:
    """Whether the fused attention may take this call at all: no dropout or other features, a decode-sized step."""
    return not (dropout or _unsupported(kwargs) or query.shape[2] > MAX_FUSED_QUERIES)


def turboquant_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
):
    """transformers attention-function signature; returns (attn_output (B, n, Hq, D), None) like SDPA's."""
    kv = packed_source(key)
    if kv is None:  # not a TurboQuant layer's packed state: transformers' SDPA, traceable
        return _sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs)
    if isinstance(kv, StaticKV):
        return _static(query, key, value, kv, attention_mask, dropout, scaling, kwargs), None
    return _dynamic(module, query, key, value, kv, attention_mask, dropout, scaling, is_causal, **kwargs)


def _static(query, window_k, window_v, kv, mask, dropout, scaling, kwargs):
    """The fused op over a static layer's PackedKV; traced by torch.compile as one opaque op."""
    bad = _unsupported(kwargs)
    if dropout or bad:
        raise ValueError(
            f"the turboquant attention on a TurboQuantStaticCache has no dropout, {', '.join(_UNSUPPORTED_KWARGS)}; "
            f"got dropout={dropout}, {bad}"
        )
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(torch.float32)
    return torch.ops.tq_hf_cache.static_attention(
        query, window_k, window_v, kv.store, mask, kv.capacity, kv.sinks, kv.norm_dtype, kv.k_quantizer, kv.v_quantizer,
        scale, kv.scratch, kv.counters, kv.key_split, kv.key_rope,
    )


@torch.compiler.disable
def _dynamic(module, query, key, value, kv, attention_mask, dropout, scaling, is_causal, **kwargs):
    """A dynamic layer's step (eager: the dynamic cache's shapes change every step)."""
    out = ops.fused_decode(query, kv, attention_mask, scaling) if _takes(query, dropout, kwargs) else None
    if out is not None:
        if kwargs.get("output_attentions", False):
            _warn_once("output_attentions", "tq_hf_cache: the turboquant attention returns no attention weights")
        return out, None
    rows = _group_rows(query, key)
    supported = not _unsupported(kwargs)
    plain = supported and _plain_causal(attention_mask, query.shape[2], key.shape[2])
    if rows < query.shape[0] and supported:
        return _by_row_groups(module, query, key, attention_mask, rows, dropout, scaling, is_causal, plain,
                              **kwargs), None
    return _chunk_sdpa(module, query, key, value, attention_mask, plain, dropout, scaling, is_causal, **kwargs)


# the verdicts of `_plain_causal` by mask tensor (the layers of one forward share theirs), each dropped with its mask
_PLAIN: dict[int, tuple] = {}


def _plain_causal(mask, n: int, t: int) -> bool:
    """Whether a chunk's boolean mask (B, 1 | H, n, >= t) is exactly causal with its n queries at the last n of t
    positions (no padding, no window): the one mask that `is_causal` can stand for. Read once per mask tensor (a
    host read of one reduction: a forward's layers share the mask); only for chunks over a held history, longer than
    the fused attention takes."""
    if (n <= MAX_FUSED_QUERIES or n >= t or not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool
            or mask.dim() != 4 or mask.shape[-2] != n or mask.shape[-1] < t or torch.compiler.is_compiling()):
        return False
    key = id(mask)
    version = None if mask.is_inference() else mask._version  # (inference tensors count no versions)
    seen = _PLAIN.get(key)
    if seen is not None and seen[0]() is mask and seen[1:3] == (version, t):
        return seen[3]
    pos = torch.arange(t, device=mask.device)
    want = pos <= pos[t - n:, None]
    verdict = bool(torch.equal(mask[..., :t], want.expand_as(mask[..., :t])))
    _PLAIN[key] = (weakref.ref(mask, lambda _, k=key: _PLAIN.pop(k, None)), version, t, verdict)
    return verdict


def _chunk_sdpa(module, query, key, value, mask, plain, dropout, scaling, is_causal, **kwargs):
    """SDPA of a chunk over a held history. Where the mask is plain causal and the history at most twice the chunk,
    the chunk is attended as the last rows of a query padded in front to the keys' length under `is_causal`: the
    flash kernel's causal skipping, on every key, costs less than a materialized (n, t) mask (docs/kernels.md); the
    padding's rows are thrown away."""
    b, hq, n, d = query.shape
    hist = key.shape[2] - n
    if not plain or hist > 2 * n:
        return _sdpa(module, query, key, value, mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs)
    padded = torch.cat([query.new_zeros(b, hq, hist, d), query], dim=2)
    out, _ = _sdpa(module, padded, key, value, None, dropout=dropout, scaling=scaling, is_causal=True, **kwargs)
    return out[:, hist:], None


def sdpa_on_packed(args, kwargs) -> torch.Tensor | None:
    """`scaled_dot_product_attention(query, key, value, ...)` over a LazyKV pair by the fused attention over its
    PackedKV, where that serves the call; None where it does not (the caller fills the dense keys and values).

    It serves what transformers' sdpa attention passes on a decode step: one query per head (`enable_gqa`, or
    the query heads of a KV head packed as rows under a mask shared by them), or up to `MAX_FUSED_QUERIES` under
    a mask, no dropout, no `is_causal`. The result is SDPA's: (B, heads, queries, D) in the query's dtype."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    call = {**dict(zip(names, args)), **kwargs}
    query, key, value, mask = call.get("query"), call.get("key"), call.get("value"), call.get("attn_mask")
    if set(call) - set(names) or torch.compiler.is_compiling():
        return None
    state, other = getattr(key, "__dict__", {}), getattr(value, "__dict__", {})
    kv = state.get("turboquant_packed")
    if (kv is None or other.get("_pair") is not state.get("_pair") or (state.get("_kind"), other.get("_kind"))
            != ("key", "value") or state["_dense"] is not None):
        return None
    if call.get("dropout_p") or call.get("is_causal") or not isinstance(query, torch.Tensor) or query.dim() != 4:
        return None
    b, hq, n, d = query.shape
    hkv = kv.k_packed.shape[1]
    if mask is not None and (mask.dim() != 4 or mask.shape[-2] not in (1, n)):
        return None
    if mask is None and n > 1:  # SDPA without a mask lets every query see every key; the fused path is causal
        return None
    q = query
    if hq == hkv and n > 1 and mask is not None and mask.shape[-2] == 1 and mask.shape[1] == 1:
        q = query.reshape(b, hq * n, 1, d)  # the query heads of a KV head, packed as rows: heads again
    elif hq != hkv and not call.get("enable_gqa"):
        return None
    if q.shape[2] > MAX_FUSED_QUERIES:
        return None
    # (SDPA was asked for: no warning where the fused attention does not serve)
    out = ops.fused_decode(q, kv, mask, call.get("scale"), fused=state["_pair"]["fused_sdpa"], quiet=True)
    return None if out is None else out.transpose(1, 2).reshape(query.shape)  # (B, n, Hq, D) -> SDPA's


def _group_rows(query, key) -> int:
    """Batch rows per group: as many as ROW_GROUP_BYTES of dense K/V (with SDPA's per-query-head copies) hold, >= 1."""
    _, hq, _, d = query.shape
    per_row = 2 * key.shape[2] * d * key.element_size() * (key.shape[1] + hq)
    return max(1, ROW_GROUP_BYTES // per_row)


def _by_row_groups(module, query, lazy_key, mask, rows, dropout, scaling, is_causal, plain=False, **kwargs):
    """SDPA over `rows` batch rows at a time, each group's keys and values filled into the workspace just before."""
    b, hq, n, d = query.shape
    out = query.new_empty(b, n, hq, d)
    for start in range(0, b, rows):
        stop = min(b, start + rows)
        k, v = fill_rows(lazy_key, start, stop)
        m = mask[start:stop] if mask is not None and mask.shape[0] == b else mask
        out[start:stop] = _chunk_sdpa(
            module, query[start:stop], k, v, m, plain, dropout, scaling, is_causal, **kwargs
        )[0]
    return out


def _made_once(mask_fn):
    """`mask_fn` (transformers' sdpa mask), its mask made once in a compiled forward (`ops.snapshot`): inductor
    otherwise builds it again inside each layer's kernels (one bool per slot of a static cache's capacity), since
    every layer's attention op takes it."""

    def mask(*args, **kwargs):
        m = mask_fn(*args, **kwargs)
        return ops.snapshot(m) if isinstance(m, torch.Tensor) and torch.compiler.is_compiling() else m

    return mask


def register(name: str = NAME) -> None:
    """Register `name` as an attention implementation (and its mask function: transformers' sdpa mask, made once
    per compiled forward)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(name, turboquant_attention_forward)
    AttentionMaskInterface.register(name, _made_once(ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]))


register()


# ---------------------------------------------------------------------------------------------------------------
# LazyKV: what a dynamic layer returns, read by the fused attention above or filled on first use

def fill_dense(out: torch.Tensor, kv: PackedKV, kind: str) -> torch.Tensor:
    """Write a dynamic PackedKV's keys (kind "key") or values, dequantized, into out (B, H, length, D)."""
    lq = kv.exact_from
    if kind == "key":
        packed, norms, cb, sinks, window = kv.k_packed, kv.k_norms, kv.k_codebook, kv.sink_k, kv.window_k
    else:
        packed, norms, cb, sinks, window = kv.v_packed, kv.v_norms, kv.v_codebook, kv.sink_v, kv.window_v
    if lq:
        if kind == "key" and kv.key_split is not None:
            parts = [(p[:, :, :lq], n[:, :, :lq]) for p, n in kv.key_parts]
            ops.dequantize_split_into(parts, kv.key_split, out[:, :, :lq])
        else:
            ops.dequantize_into(packed[:, :, :lq], norms[:, :, :lq], kv.rotation, cb, out[:, :, :lq])
        if kind == "key" and kv.key_offset is not None:
            kv.key_offset.add_to(out[:, :, :lq], 0)
        if kv.sinks:
            out[:, :, : kv.sinks].copy_(sinks[:, :, : kv.sinks])
    out[:, :, lq : kv.length].copy_(window[:, :, : kv.length - lq])
    return out


# metadata that reading does not need the data for: answered without filling a LazyKV
_METADATA = frozenset({
    "shape", "dtype", "device", "size", "dim", "ndim", "ndimension", "stride", "is_cuda", "requires_grad", "numel",
    "element_size", "is_contiguous", "layout", "data_ptr", "__len__", "is_floating_point", "is_complex",
    "storage_offset", "get_device", "is_meta", "is_sparse", "is_quantized", "is_nested", "grad_fn", "is_leaf",
})


class LazyKV(torch.Tensor):
    """Dense keys or values of a dynamic layer that are written only when something reads them.

    A dynamic layer's decode step (or long chunk over a packed history) returns a pair of these, carrying the
    layer's `PackedKV` (attribute `turboquant_packed`). The turboquant attention reads the PackedKV and never
    touches the data, so a decode step allocates nothing (a long chunk is filled by row groups, `fill_rows`). Any
    `scaled_dot_product_attention` on a pair (transformers' "sdpa" attention) runs that same fused attention where it
    serves the call (`attention.sdpa_on_packed`; off with `fused_sdpa=False`). Any
    other consumer (eager, flex, user code) triggers the fill on its first torch operation: the pair takes its
    views of the cache's shared workspace, the dequantized keys or values are written there, and the consumer gets
    that plain dense tensor. So every attention implementation sees the
    right keys and values at every step. Like any workspace view, a LazyKV is valid until the next layer's update.
    Until filled, a LazyKV is a stride-0 view of one element: metadata reads (shape, dtype, device) need no data.
    """

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "__get__":  # a property such as .shape
            name = getattr(getattr(func, "__self__", None), "__name__", name)
        if func is torch.nn.functional.scaled_dot_product_attention:
            out = sdpa_on_packed(args, kwargs)
            if out is not None:
                return out
        with torch._C.DisableTorchFunctionSubclass():
            if name not in _METADATA:
                args, kwargs = tree_map_only(LazyKV, LazyKV.dense, (args, kwargs))
            return func(*args, **kwargs)

    def dense(self) -> torch.Tensor:
        """The filled plain tensor (allocated and filled once)."""
        state = self.__dict__
        if state["_dense"] is None:
            pair = state["_pair"]
            if pair["views"] is None:
                pair["views"] = pair["alloc"](self.shape[0])
            out = pair["views"][0 if state["_kind"] == "key" else 1]
            with torch._C.DisableTorchFunctionSubclass():
                state["_dense"] = fill_dense(out, state[PACKED_ATTR], state["_kind"])
        return state["_dense"]


def lazy_pair(kv: PackedKV, shape: tuple, dtype: torch.dtype, alloc, fused_sdpa: bool = True) -> tuple[LazyKV, LazyKV]:
    """LazyKVs of kv's keys and values, of `shape` (B, H, length, D); `alloc(rows) -> (key buffer, value buffer)`
    of shape (rows, H, length, D) gives their storage when they are filled (rows = B) or read by rows. fused_sdpa:
    whether SDPA on the pair may run the fused attention over kv instead of filling them."""
    placeholder = torch.empty(1, dtype=dtype, device=kv.k_packed.device).expand(*shape)
    pair = {"alloc": alloc, "views": None, "fused_sdpa": fused_sdpa}
    out = []
    for kind in ("key", "value"):
        t = placeholder.as_subclass(LazyKV)
        t.__dict__.update({PACKED_ATTR: kv, "_kind": kind, "_pair": pair, "_dense": None})
        out.append(t)
    return out[0], out[1]


def fill_rows(lazy: LazyKV, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense keys and values of batch rows [start, stop) of a LazyKV pair (either member), written into the pair's
    storage for that many rows: valid until its next use, so one row group is consumed before the next is filled."""
    state = lazy.__dict__
    kv = state[PACKED_ATTR].rows(start, stop)
    k, v = state["_pair"]["alloc"](stop - start)
    with torch._C.DisableTorchFunctionSubclass():
        return fill_dense(k, kv, "key"), fill_dense(v, kv, "value")
