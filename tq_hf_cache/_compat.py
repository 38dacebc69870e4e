"""What differs between the supported transformers releases (4.56 ... 5.x), in one place."""

from __future__ import annotations

import inspect

import torch
import transformers
from packaging.version import Version
from transformers import cache_utils

TRANSFORMERS_VERSION = Version(transformers.__version__)
IS_V5 = TRANSFORMERS_VERSION.major >= 5


def layer_types_and_kwargs(config) -> tuple[list[str], list[dict]]:
    """The cache layer type of every decoder layer, as `DynamicCache(config=...)` derives it."""
    text_config = config.get_text_config(decoder=True) if IS_V5 else config.get_text_config()
    if hasattr(cache_utils, "get_layer_types_and_kwargs"):
        types, kwargs = cache_utils.get_layer_types_and_kwargs(text_config)
        if isinstance(kwargs, dict):  # transformers <= 5.17: one kwargs dict for every layer
            kwargs = [dict(kwargs) for _ in types]
        return list(types), list(kwargs)
    # transformers 4.x: one window for the whole model, shared layers carry no cache
    window = getattr(text_config, "sliding_window", None) or getattr(text_config, "attention_chunk_size", None)
    types = getattr(text_config, "layer_types", None)
    if types is None:
        kind = "sliding_attention" if window is not None else "full_attention"
        types = [kind] * text_config.num_hidden_layers
    if getattr(text_config, "num_kv_shared_layers", None):
        types = types[: -text_config.num_kv_shared_layers]
    kwargs = [{"sliding_window": window} if t in ("sliding_attention", "chunked_attention") else {} for t in types]
    return list(types), kwargs


def transformers_layer(layer_type: str, kwargs: dict, layer_idx: int):
    """The layer transformers itself would build for a type that TurboQuant leaves untouched."""
    mapping = getattr(cache_utils, "DYNAMIC_LAYER_TYPE_MAPPING", None)
    if mapping is None:  # transformers 4.x
        if layer_type == "full_attention":
            return cache_utils.DynamicLayer()
        if layer_type in ("sliding_attention", "chunked_attention"):
            return cache_utils.DynamicSlidingWindowLayer(sliding_window=kwargs["sliding_window"])
    if mapping is None or layer_type not in mapping:
        raise ValueError(
            f"layer {layer_idx} has layer type {layer_type!r}, which TurboQuantCache does not support with "
            f"transformers {transformers.__version__}"
        )
    return mapping[layer_type](**kwargs)


def kv_sharing_producers(config) -> set[int]:
    """Layers whose returned K/V later layers reuse (KV sharing): they must not return workspace views."""
    text_config = config.get_text_config(decoder=True) if IS_V5 else config.get_text_config()
    modes = getattr(text_config, "kv_sharing_modes", None)
    if modes is not None:
        return {i for i, mode in enumerate(modes) if mode == "store"}
    if getattr(text_config, "num_kv_shared_layers", 0):
        raise ValueError(
            f"{type(text_config).__name__} shares KV between layers (num_kv_shared_layers="
            f"{text_config.num_kv_shared_layers}); TurboQuantCache supports KV sharing with transformers >= 5 only, "
            f"this is {transformers.__version__}"
        )
    return set()



def cache_kwargs(model, cache) -> dict:
    """`{name: cache}` under the keyword the model's `forward` and `generate` take: `cache` from transformers 5.24,
    `past_key_values` before (5.24 deprecates it: removed from `forward` in 5.40 and from `generate` in 6.0).

    `model` may also be a model class. Example: `model.generate(ids, **cache_kwargs(model,
    TurboQuantCache(config=model.config)))` runs on every supported release without a deprecation warning.
    """
    forward = getattr(model if isinstance(model, type) else type(model), "forward", None)
    try:
        takes_cache = forward is not None and "cache" in inspect.signature(forward).parameters
    except (TypeError, ValueError):  # a forward without a signature (a C extension, a partial)
        takes_cache = False
    return {"cache" if takes_cache else "past_key_values": cache}


def query_length(arg) -> int:
    """transformers 5.x passes the query length; 4.x passes cache_position."""
    if isinstance(arg, torch.Tensor):
        return int(arg.shape[0])
    return int(arg)
