"""Reusable quantized prompt caches: save a TurboQuantCache holding a prefix (a system prompt, a document) and load it
for later requests that start with the same tokens.

A prefix folder holds `turboquant_prefix.safetensors` (every layer's packed codes, norms, residual window and sink
copies, each part of split keys and a centred layer's key mean, or the keys and values of layers kept in full
precision) and `turboquant_prefix.json` (the format version,
the TurboQuantConfig, the model facts, a digest of each layer's rotation and codebooks, the SHA-256 of the prefix's
token ids, and each layer's lengths). Nothing is pickled. Loading refuses another model, other codebooks or
rotations, other token ids, and a file that does not match its index, with an error that names the difference.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import torch

from ._compat import IS_V5
from .config import TurboQuantConfig, fact_mismatch, model_facts, read_format_json

PREFIX_JSON = "turboquant_prefix.json"
PREFIX_TENSORS = "turboquant_prefix.safetensors"
PREFIX_FORMAT = "tq_hf_cache.prefix"
PREFIX_FORMAT_VERSION = 1
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def token_digest(token_ids) -> str:
    """SHA-256 of token ids (a 1-D sequence or a (batch, seq) tensor), as int64 little-endian bytes."""
    t = torch.as_tensor(token_ids, dtype=torch.int64).detach().cpu().contiguous()
    return hashlib.sha256(str(tuple(t.shape)).encode() + t.numpy().astype("<i8").tobytes()).hexdigest()


def _layer_digest(layer) -> str:
    """What the stored codes mean: the rotation and both codebooks of a TurboQuant layer, and with split keys each
    part's rotation, codebook and channels."""
    h = hashlib.sha256()
    ts = [layer.rotation.matrix, layer.k_codebook.centroids, layer.v_codebook.centroids]
    if layer.key_split is not None:
        ts.append(layer.key_split.order)
        ts += [t for rot, cb in layer.key_split.parts for t in (rot.matrix, cb.centroids)]
    for t in ts:
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _packed_buffers(layer) -> list[tuple[str, Any]]:
    """(stored name, buffer) of a layer's packed buffers: keys (each part of split keys: k, k1, k2, ...), values."""
    return [("k", layer.k_buf), *((f"k{j}", b) for j, b in enumerate(layer.k_more, start=1)), ("v", layer.v_buf)]


def _dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in _DTYPES.items() if v == dtype)


def save_prefix(cache, path: str, token_ids) -> str:
    """Write `cache` (a TurboQuantCache holding exactly the tokens `token_ids`) into folder `path`; returns it."""
    from safetensors.torch import save_file

    from .layer import TurboQuantLayer

    for layer in cache.layers:
        if isinstance(layer, TurboQuantLayer) and layer.is_initialized:
            layer._settle()  # what a decode step left beyond the residual window: stored as a dense step leaves it
    ids = torch.as_tensor(token_ids)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2:
        raise ValueError(f"token_ids must be (seq,) or (batch, seq), got shape {tuple(ids.shape)}")
    if cache.num_model_layers is None:
        raise ValueError("save_prefix needs a cache built with config=model.config (the model facts are stored)")
    if cache.model_facts is None:
        raise ValueError(
            "save_prefix needs one layer count, KV head count and head dim for the whole model; this model's config "
            "does not give them (per-layer head dims?)"
        )
    seq = cache.get_seq_length()
    if ids.shape[1] != seq:
        raise ValueError(f"the cache holds {seq} tokens but token_ids has {ids.shape[1]}; pass the prefix's token ids")
    tensors: dict[str, torch.Tensor] = {}
    layers: list[dict[str, Any]] = []
    for i, layer in enumerate(cache.layers):
        if hasattr(layer, "conv_states") or hasattr(layer, "recurrent_states"):
            info = None  # a linear-attention state, alone or beside attention KV (hybrid layers)
        elif isinstance(layer, TurboQuantLayer):
            info = _save_tq_layer(layer, i, tensors)
        elif type(layer).__name__ in ("DynamicLayer", "DynamicSlidingWindowLayer"):
            info = _save_plain_layer(layer, i, tensors)
        else:
            info = None
        if info is None:
            raise ValueError(
                f"layer {i} is a {type(layer).__name__}: save_prefix stores attention layers only (recurrent or "
                "convolution states are not supported)"
            )
        if info.get("batch") not in (None, ids.shape[0]):
            raise ValueError(f"layer {i} holds batch {info['batch']} but token_ids has batch {ids.shape[0]}")
        layers.append(info)
    doc = {
        "format": PREFIX_FORMAT,
        "format_version": PREFIX_FORMAT_VERSION,
        "tq_config": cache.tq_config.to_dict(),
        "model": cache.model_facts,
        "num_tokens": seq,
        "batch": ids.shape[0],
        "token_ids_sha256": token_digest(ids),
        "layers": layers,
    }
    os.makedirs(path, exist_ok=True)
    tmp = os.path.join(path, PREFIX_TENSORS + ".tmp")
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp, metadata={"format": PREFIX_FORMAT})
    os.replace(tmp, os.path.join(path, PREFIX_TENSORS))
    with open(os.path.join(path, PREFIX_JSON + ".tmp"), "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
    os.replace(os.path.join(path, PREFIX_JSON + ".tmp"), os.path.join(path, PREFIX_JSON))
    return path


def _save_tq_layer(layer, i: int, tensors: dict) -> dict[str, Any]:
    if not layer.is_initialized:
        return {"kind": "turboquant", "initialized": False}
    p = f"layers.{i}."
    for name, buf in _packed_buffers(layer):
        tensors[p + f"{name}_packed"], tensors[p + f"{name}_norms"] = buf.live()
    tensors.update({
        p + "res_k": layer.res_k, p + "res_v": layer.res_v,
        p + "sink_k": layer._sk[:, :, : layer._slen], p + "sink_v": layer._sv[:, :, : layer._slen],
    })
    if layer._mu is not None:
        tensors[p + "key_mean"] = layer._mu
    return {
        "kind": "turboquant", "initialized": True, "class": type(layer).__name__,
        "key_bits": layer.key_bits, "value_bits": layer.value_bits, "dtype": _dtype_name(layer.dtype),
        "norm_dtype": _dtype_name(layer.norm_dtype), "batch": layer.batch, "heads": layer.heads,
        "head_dim": layer.head_dim, "cumulative_length": layer.cumulative_length,
        "quantized": layer.k_buf.length, "residual": layer._rlen, "sinks": layer._slen, "digest": _layer_digest(layer),
        "key_parts": 1 + len(layer.k_more), "key_mean": layer._mu is not None,
    }


def _save_plain_layer(layer, i: int, tensors: dict) -> dict[str, Any]:
    keys = getattr(layer, "keys", None)
    if keys is None or not getattr(layer, "is_initialized", True):  # 4.x layers have no is_initialized
        return {"kind": "plain", "initialized": False}
    tensors[f"layers.{i}.keys"], tensors[f"layers.{i}.values"] = layer.keys, layer.values
    return {
        "kind": "plain", "initialized": True, "class": type(layer).__name__, "dtype": _dtype_name(keys.dtype),
        "batch": keys.shape[0], "cumulative_length": int(getattr(layer, "cumulative_length", keys.shape[2])),
    }


def read_prefix_info(path: str) -> dict[str, Any]:
    """The JSON index of a prefix folder, version-checked."""
    return read_format_json(
        os.path.join(path, PREFIX_JSON), PREFIX_FORMAT, PREFIX_FORMAT_VERSION,
        "save one with cache.save_prefix(path, token_ids)",
    )


def load_prefix(cls, path: str, config, *, token_ids=None, codebooks=None, device=None):
    """A `cls` (TurboQuantCache) holding the saved prefix; see `TurboQuantCache.load_prefix`."""
    from safetensors import safe_open

    doc = read_prefix_info(path)
    where = os.path.join(path, PREFIX_JSON)
    diff = fact_mismatch(doc["model"], model_facts(config))
    if diff:
        k, want, got = diff
        raise ValueError(f"the prefix in {path!r} was saved for {k}={want!r}, but this model has {k}={got!r}")
    if token_ids is not None:
        ids = torch.as_tensor(token_ids)
        ids = ids.unsqueeze(0) if ids.dim() == 1 else ids
        n = doc["num_tokens"]
        if ids.shape[0] != doc["batch"] or ids.shape[1] < n or token_digest(ids[:, :n]) != doc["token_ids_sha256"]:
            raise ValueError(
                f"the prefix in {path!r} holds other tokens than the first {n} of token_ids (their SHA-256 differs): "
                "a cache is only reusable for prompts that start with its exact prefix"
            )
    cache = cls(TurboQuantConfig.from_dict(doc["tq_config"]), config=config, codebooks=codebooks)
    if len(doc["layers"]) != len(cache.layers):
        raise ValueError(f"{where} stores {len(doc['layers'])} layers, this model's cache has {len(cache.layers)}")
    try:
        f = safe_open(os.path.join(path, PREFIX_TENSORS), framework="pt")
    except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
        raise ValueError(f"{os.path.join(path, PREFIX_TENSORS)} cannot be read: {e}") from None
    with f:
        names = set(f.keys())

        def get(name):
            if name not in names:
                raise ValueError(f"{PREFIX_TENSORS} in {path!r} lacks the tensor {name!r} that {PREFIX_JSON} lists")
            names.discard(name)
            t = f.get_tensor(name)
            return t if device is None else t.to(device)

        for i, (layer, info) in enumerate(zip(cache.layers, doc["layers"])):
            if not info.get("initialized"):
                continue
            if info["kind"] == "turboquant":
                _restore_tq_layer(layer, i, info, get, path)
            else:
                _restore_plain_layer(layer, i, info, get, path)
        if names:
            raise ValueError(f"{PREFIX_TENSORS} in {path!r} holds tensors {sorted(names)} that {PREFIX_JSON} does not list")
    if cache.get_seq_length() != doc["num_tokens"]:
        raise ValueError(f"{where} says {doc['num_tokens']} tokens, the restored cache holds {cache.get_seq_length()}")
    return cache


def _restore_tq_layer(layer, i: int, info: dict, get, path: str) -> None:
    from .layer import PackedBuffer, TurboQuantLayer

    if not isinstance(layer, TurboQuantLayer) or type(layer).__name__ != info["class"]:
        raise ValueError(f"layer {i} was saved as {info['class']}, this cache builds {type(layer).__name__}")
    if (layer.key_bits, layer.value_bits) != (info["key_bits"], info["value_bits"]):
        raise ValueError(f"layer {i} was saved at k{info['key_bits']}v{info['value_bits']}, this cache uses "
                         f"k{layer.key_bits}v{layer.value_bits}")
    p = f"layers.{i}."
    res_k, res_v = get(p + "res_k"), get(p + "res_v")
    b, h, d = info["batch"], info["heads"], info["head_dim"]
    dtype = _DTYPES[info["dtype"]]
    layer.lazy_initialization(res_k.new_empty(b, h, 0, d, dtype=dtype))
    if _layer_digest(layer) != info["digest"]:
        raise ValueError(
            f"layer {i} of the prefix in {path!r} was quantized with another rotation or other codebooks than this "
            "cache's (seed, rotation kind or calibrated codebooks differ): its codes would decode to other vectors"
        )
    layer.norm_dtype = _DTYPES[info["norm_dtype"]]
    buffers = _packed_buffers(layer)
    if info.get("key_parts", 1) != len(buffers) - 1:
        raise ValueError(f"layer {i} was saved with keys in {info.get('key_parts', 1)} part(s), this cache's config "
                         f"splits them in {len(buffers) - 1}")
    fresh_bufs = []
    for kind, buf in buffers:
        packed, norms = get(p + f"{kind}_packed"), get(p + f"{kind}_norms")
        if tuple(packed.shape) != (b, h, info["quantized"], buf.nbytes_per_vec) or norms.dtype != layer.norm_dtype:
            raise ValueError(f"layer {i}: stored {kind} codes of shape {tuple(packed.shape)} ({norms.dtype} norms) do "
                             f"not fit {info['quantized']} tokens at {buf.bits} bits")
        fresh = PackedBuffer(b, h, buf.dim, buf.bits, layer.norm_dtype, packed.device)
        slots_p, slots_n = fresh.append_slots(info["quantized"])
        slots_p.copy_(packed)
        slots_n.copy_(norms)
        fresh_bufs.append(fresh)
    layer.k_buf, *layer.k_more, layer.v_buf = fresh_bufs
    centred = layer.rope is not None
    if info.get("key_mean", False) and not centred or centred and info["quantized"] and not info.get("key_mean"):
        raise ValueError(f"layer {i} was saved {'with' if info.get('key_mean') else 'without'} a key mean (key "
                         f"centring); this cache's config has key_centering={centred}")
    if info.get("key_mean"):
        mu = get(p + "key_mean")
        if tuple(mu.shape) != (b, h, 1, d) or mu.dtype != torch.float32:
            raise ValueError(f"layer {i}: the stored key mean is {tuple(mu.shape)} {mu.dtype}, expected "
                             f"{(b, h, 1, d)} float32")
        layer._mu = mu
    expect = (b, h, info["residual"], d)
    if tuple(res_k.shape) != expect or tuple(res_v.shape) != expect or res_k.dtype != dtype:
        raise ValueError(f"layer {i}: stored residual window of shape {tuple(res_k.shape)} does not fit {expect}")
    layer._reserve_residual(info["residual"])
    layer._rk[:, :, : info["residual"]].copy_(res_k)
    layer._rv[:, :, : info["residual"]].copy_(res_v)
    layer._rlen = info["residual"]
    layer._sk, layer._sv, layer._slen = get(p + "sink_k"), get(p + "sink_v"), info["sinks"]
    if layer._sk.shape[2] != info["sinks"]:
        raise ValueError(f"layer {i}: {layer._sk.shape[2]} stored sink copies, the index says {info['sinks']}")
    layer.cumulative_length = info["cumulative_length"]


def _restore_plain_layer(layer, i: int, info: dict, get, path: str) -> None:
    if type(layer).__name__ != info["class"]:
        raise ValueError(f"layer {i} was saved as {info['class']}, this cache builds {type(layer).__name__}")
    keys, values = get(f"layers.{i}.keys"), get(f"layers.{i}.values")
    if IS_V5:
        layer.lazy_initialization(keys, values)
    else:  # 4.x takes the keys alone
        layer.lazy_initialization(keys)
    layer.keys, layer.values = keys, values
    if hasattr(layer, "cumulative_length"):
        layer.cumulative_length = info["cumulative_length"]
