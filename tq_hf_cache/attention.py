"""`attn_implementation="turboquant"`: transformers attention that reads TurboQuant-packed K/V directly.

`import tq_hf_cache` registers the name in transformers' `AttentionInterface` and, with the sdpa mask function,
in `ALL_MASK_ATTENTION_FUNCTIONS` (`register()` does it again, idempotently, e.g. after a transformers reload).
Nothing here imports Triton until a fused step runs on CUDA.

What the function does, per call:
- key not from a TurboQuantLayer (DynamicCache, no cache, layers the config keeps in full precision): transformers'
  own SDPA attention, unchanged.
- key from a TurboQuantLayer, not deferred (the layer's first step, or a step after the cache was disarmed):
  SDPA on the tensors given, then `layer.arm_deferred()`.
- deferred, few queries (n <= 16 and n * query heads per KV head <= 128), supported head dim (64, 128) and bits:
  the fused kernel (`kernels.decode_attention`, CUDA) or the same rotated-domain math in torch (other devices);
  then `layer.flush()` and `layer.arm_deferred()`.
- deferred, anything else (a prefill chunk, another head dim, extra features such as sinks): the layer assembles
  [history | residual | new] in the workspace (`assemble_pending()`), SDPA runs on it, flush, arm.

The arming rule. A layer is armed only by this function, at the end of a call, for that layer's next update: the
next step's update then returns the new tokens alone. The arming remembers the calling module's config, so after
`model.set_attn_implementation("sdpa")` (or "eager") that update is a normal one. A cache handed to another model
with another attention implementation is caught instead (`layer.DeferredLedger`): the next update of any layer
refuses the step, takes its tokens back out and clears the arming, so that the step run again is right (with a
single quantized layer, one step's output is wrong before the refusal). `disarm(cache)` clears the arming up front.
"""

from __future__ import annotations

import logging
import os
from functools import partial

import torch

from . import ops, reference  # noqa: F401  (ops registers the tq_hf_cache:: custom ops)
from .kernels import DECODE_HEAD_DIMS, DECODE_MAX_ROWS, SUPPORTED_BITS  # limits only: no triton import

NAME = "turboquant"
MAX_FUSED_QUERIES = 16  # longer queries (prefill chunks) take the workspace path
_UNSUPPORTED_KWARGS = ("s_aux", "sinks", "softcap", "position_bias", "head_mask")

logger = logging.getLogger(__name__)
_warned: set = set()

# "auto": the Triton kernel on CUDA, the torch math elsewhere; "triton": the kernel everywhere (CPU needs
# TRITON_INTERPRET=1 set before triton is imported); "torch": the torch math everywhere.
FUSED_BACKEND = os.environ.get("TQ_FUSED_BACKEND", "auto")


def _sdpa(*args, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(*args, **kwargs)


def _warn_once(key, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(msg)


def _fused(query, layer, mask, scale):
    backend = FUSED_BACKEND
    if backend == "torch" or (backend == "auto" and not query.is_cuda):
        return reference.packed_attention(query, layer.attention_state(), mask, scale)
    from .kernels import decode_attention as da

    if mask is None:
        # the common decode step: launch arguments cached on the layer, no state dict
        out = da.decode_attention_layer(query, layer, scale)
        if out is not None:
            return out
    return da.decode_attention(query, layer.attention_state(), mask, scale)


def _fusable(query, key, layer, dropout, kwargs) -> bool:
    if dropout or any(kwargs.get(k) is not None for k in _UNSUPPORTED_KWARGS):
        return False
    b, hq, n, d = query.shape
    hkv = key.shape[1]
    if n > MAX_FUSED_QUERIES or hq % hkv or (hq // hkv) * n > DECODE_MAX_ROWS:
        return False
    if d not in DECODE_HEAD_DIMS or layer.key_bits not in SUPPORTED_BITS or layer.value_bits not in SUPPORTED_BITS:
        _warn_once(
            ("unsupported", d, layer.key_bits, layer.value_bits),
            f"tq_hf_cache: no fused decode attention for head dim {d} with k{layer.key_bits}v{layer.value_bits}; "
            "those steps use the workspace (dequantize + SDPA) path",
        )
        return False
    return True


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
    packed = getattr(key, "turboquant_packed", None)  # a TurboQuantStaticLayer's ring (see static_cache.py)
    if packed is not None:
        return _static(query, key, value, packed, attention_mask, dropout, scaling, kwargs), None
    if getattr(key, "_tq_layer", None) is None:  # not a TurboQuant layer's: transformers' SDPA, traceable
        return _sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs)
    return _dynamic_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)


def _static(query, ring_k, ring_v, kv, mask, dropout, scaling, kwargs):
    """The fused op over a static layer's PackedKV; traced by torch.compile as one opaque op."""
    bad = [k for k in _UNSUPPORTED_KWARGS if kwargs.get(k) is not None]
    if dropout or bad:
        raise ValueError(
            f"the turboquant attention on a TurboQuantStaticCache has no dropout, {', '.join(_UNSUPPORTED_KWARGS)}; "
            f"got dropout={dropout}, {bad}"
        )
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(torch.float32)
    return torch.ops.tq_hf_cache.static_attention(
        query, ring_k, ring_v, kv.k_packed, kv.k_norms, kv.v_packed, kv.v_norms, kv.sink_k, kv.sink_v, kv.length,
        kv.exact_from, mask, kv.sinks, kv.k_quantizer, kv.v_quantizer, scale, kv.scratch, kv.counters,
    )


@torch.compiler.disable
def _dynamic_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs):
    """A TurboQuantLayer's step (eager: the dynamic cache's shapes change every step)."""
    layer = key._tq_layer
    if not getattr(key, "_tq_deferred", False):
        out = _sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs)
        _arm(layer, module)
        return out
    if layer.pending is None:
        # someone flushed the pending tokens (e.g. read layer.keys) between update and attention
        k, v = layer.keys, layer.values
        out = _sdpa(module, query, k, v, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs)
        _arm(layer, module)
        return out
    try:
        if _fusable(query, key, layer, dropout, kwargs):
            if kwargs.get("output_attentions", False):
                _warn_once("output_attentions", "tq_hf_cache: the turboquant attention returns no attention weights")
            out = (_fused(query, layer, attention_mask, scaling), None)
        else:
            k, v = layer.assemble_pending()
            out = _sdpa(module, query, k, v, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs)
    finally:
        layer.flush()
    _arm(layer, module)
    return out


def disarm(cache) -> None:
    """Undo the arming of every layer of a cache, before using it with another attention implementation."""
    for layer in getattr(cache, "layers", []):
        if hasattr(layer, "disarm"):
            layer.disarm()


def _still_turboquant(config) -> bool:
    """Whether the config that armed a layer still selects this attention (checked at the layer's next update)."""
    return getattr(config, "_attn_implementation", NAME) == NAME


def _arm(layer, module) -> None:
    config = getattr(module, "config", None)
    layer.arm_deferred(partial(_still_turboquant, config) if config is not None else None)


def register(name: str = NAME) -> None:
    """Register `name` as an attention implementation (and its mask function: transformers' sdpa mask)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(name, turboquant_attention_forward)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


register()
