"""Reusable quantized prompt caches: save a TurboQuantCache holding a prefix (a system prompt, a document) and load it
for later requests that start with the same tokens.

A prefix folder holds `turboquant_prefix.safetensors` (every layer's packed codes, norms, residual window and sink
copies, each part of split keys and a centred layer's key mean, or the keys and values of layers kept in full
precision) and `turboquant_prefix.json`, the index: the format version, the TurboQuantConfig, the model facts, a
digest of the model's weights when saved with `model=`, a digest of each layer's rotation and codebooks, the SHA-256
of the prefix's token ids, each layer's lengths, the SHA-256 of the tensors file and one of the index itself.
Nothing is pickled.

Loading checks the index's schema (every field's type and range) before anything else, then both digests (a torn or
mixed pair of files, or an edited index, is refused), then the model, weights and tokens, then every stored tensor's
name, shape and dtype against the index and the model facts. Every refusal is a ValueError naming the file and the
field or tensor (FileNotFoundError for a missing file); nothing is returned half built.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import weakref
from typing import Any

import torch

from .. import _io
from .._compat import IS_V5
from ..config import MODEL_FACT_KEYS, TurboQuantConfig, model_facts
from ..quant.packing import packed_bytes

PREFIX_JSON = "turboquant_prefix.json"
PREFIX_TENSORS = "turboquant_prefix.safetensors"
PREFIX_FORMAT = "tq_hf_cache.prefix.file"
PREFIX_FORMAT_VERSION = 3
# version 2 named the exact window "res_k" / "res_v" (field "residual"): read and converted on load
_V2_NAMES = {"res_k": "window_k", "res_v": "window_v"}
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_NORM_DTYPES = ("float16", "float32")
MAX_COUNT = 2**40  # tokens, batch rows, heads: far above any real cache, low enough to refuse a corrupt huge number
WEIGHT_SAMPLE = 4096  # elements of each parameter that the weights digest reads
_HEX64 = re.compile(r"[0-9a-f]{64}")


# ---- digests ---------------------------------------------------------------------------------------------------


def token_digest(token_ids) -> str:
    """SHA-256 of token ids (a 1-D sequence or a (batch, seq) tensor), as int64 little-endian bytes."""
    t = torch.as_tensor(token_ids, dtype=torch.int64).detach().cpu().contiguous()
    return hashlib.sha256(str(tuple(t.shape)).encode() + t.numpy().astype("<i8").tobytes()).hexdigest()


def index_digest(doc: dict[str, Any]) -> str:
    """SHA-256 of the index without its `index_sha256` field, as sorted compact ASCII JSON: any edit shows."""
    body = {k: v for k, v in doc.items() if k != "index_sha256"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def weights_digest(model) -> str:
    """SHA-256 of every parameter's name, shape and dtype and the bytes of up to WEIGHT_SAMPLE elements of it,
    evenly spaced over the flattened tensor.

    Cheap (a few MB read whatever the model size) and independent of the architecture: another checkpoint of the
    same shape differs in nearly every element of its trained tensors. It depends on the dtype the weights are in
    (a prefix saved from bf16 weights does not load against fp32 ones), not on their device; a checkpoint that
    differs from the saved one only in elements between the samples passes. Parameters on the meta device
    (offloaded to disk) count by name, shape and dtype only."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        t = p.detach()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        if t.device.type == "meta" or t.numel() == 0:
            continue
        flat = t.reshape(-1)
        k = min(flat.numel(), WEIGHT_SAMPLE)
        idx = torch.arange(k, device=flat.device) * flat.numel() // k
        h.update(flat[idx].cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


_DIGESTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # rotation -> {codebook fingerprints: digest}


def quantizer_digest(rotation, k_codebook, v_codebook, key_split=None) -> str:
    """What stored codes mean: the rotation and both codebooks, and with split keys each part's rotation, codebook
    and channels.

    Remembered per rotation object and codebook fingerprints (the rotations are shared by the caches of a process):
    the tensors live on the GPU, and reading them back at every restored layer would make the host wait there."""
    key = (k_codebook.fingerprint, v_codebook.fingerprint)
    if key_split is None and all(key):
        known = _DIGESTS.get(rotation, {}).get(key)
        if known is None:
            known = _DIGESTS.setdefault(rotation, {})[key] = _quantizer_digest(rotation, k_codebook, v_codebook)
        return known
    return _quantizer_digest(rotation, k_codebook, v_codebook, key_split)


def _quantizer_digest(rotation, k_codebook, v_codebook, key_split=None) -> str:
    h = hashlib.sha256()
    ts = [rotation.matrix, k_codebook.centroids, v_codebook.centroids]
    if key_split is not None:
        ts.append(key_split.order)
        ts += [t for rot, cb in key_split.parts for t in (rot.matrix, cb.centroids)]
    for t in ts:
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    cbs = [k_codebook, v_codebook, *(cb for _, cb in (key_split.parts if key_split is not None else ()))]
    if any(cb.pair or cb.norm_correction for cb in cbs):  # (scalar codes' digests stay what older files hold)
        h.update(":".join(f"{cb.kind}{'+nc' if cb.norm_correction else ''}" for cb in cbs).encode())
    return h.hexdigest()


def state_digest(state) -> str:
    """`quantizer_digest` of a layer state's quantizers."""
    return quantizer_digest(state.rotation, state.k_codebook, state.v_codebook, state.key_split)


def _dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in _DTYPES.items() if v == dtype)


# ---- save ------------------------------------------------------------------------------------------------------


def save_prefix(cache, path: str, token_ids, model=None) -> str:
    """Write `cache` (a TurboQuantCache holding exactly the tokens `token_ids`) into folder `path`; returns it.
    With `model`, the prefix is bound to its weights (`weights_digest`)."""
    from ..hf.layer import TurboQuantLayer

    ids = _check_save_args(cache, token_ids, model)
    for layer in cache.layers:
        if isinstance(layer, TurboQuantLayer) and layer.is_initialized:
            layer.kv.settle()  # what a decode step left beyond the window: stored as a dense step leaves it
    tensors: dict[str, torch.Tensor] = {}
    layers = [_save_layer(layer, i, tensors, ids.shape[0]) for i, layer in enumerate(cache.layers)]
    blob = _io.safetensors_bytes(tensors, metadata={"format": PREFIX_FORMAT})
    doc = {
        "format": PREFIX_FORMAT,
        "format_version": PREFIX_FORMAT_VERSION,
        "tq_config": cache.tq_config.to_dict(),
        "model": cache.model_facts,
        "weights": None if model is None else {
            "sha256": weights_digest(model), "name_or_path": getattr(model.config, "name_or_path", None) or None,
        },
        "num_tokens": ids.shape[1],
        "batch": ids.shape[0],
        "token_ids_sha256": token_digest(ids),
        "tensors_sha256": _io.sha256_blocks(blob),
        "layers": layers,
    }
    doc["index_sha256"] = index_digest(doc)
    text = json.dumps(doc, indent=1, sort_keys=True, allow_nan=False) + "\n"
    # the index last: in an existing folder a torn pair (new tensors, old index) fails the tensors digest
    return _io.write_folder(path, {PREFIX_TENSORS: blob, PREFIX_JSON: text.encode("utf-8")})


def _check_save_args(cache, token_ids, model) -> torch.Tensor:
    """The token ids as (batch, seq); refuses a cache without model facts, a length mismatch or another model."""
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
    if model is not None:
        facts = model_facts(model.config)
        if facts != cache.model_facts:
            raise ValueError(f"model= is a {facts} model, but the cache was built for {cache.model_facts}")
    return ids


def _save_layer(layer, i: int, tensors: dict, batch: int) -> dict[str, Any]:
    from ..hf.layer import TurboQuantLayer

    info = None
    if hasattr(layer, "conv_states") or hasattr(layer, "recurrent_states"):
        info = None  # a linear-attention state, alone or beside attention KV (hybrid layers)
    elif isinstance(layer, TurboQuantLayer):
        info = _save_tq_layer(layer, i, tensors)
    elif type(layer).__name__ in ("DynamicLayer", "DynamicSlidingWindowLayer"):
        info = _save_plain_layer(layer, i, tensors)
    if info is None:
        raise ValueError(
            f"layer {i} is a {type(layer).__name__}: save_prefix stores attention layers only (recurrent or "
            "convolution states are not supported)"
        )
    if info.get("batch") not in (None, batch):
        raise ValueError(f"layer {i} holds batch {info['batch']} but token_ids has batch {batch}")
    return info


def _save_tq_layer(layer, i: int, tensors: dict) -> dict[str, Any]:
    if not layer.is_initialized:
        return {"kind": "turboquant", "initialized": False}
    kv, p = layer.kv, f"layers.{i}."
    state, lengths = kv.state(), kv.lengths()
    tensors.update({p + name: t for name, t in state.items()})
    return {
        "kind": "turboquant", "initialized": True, "class": type(layer).__name__,
        "key_bits": layer.key_bits, "value_bits": layer.value_bits, "dtype": _dtype_name(kv.dtype),
        "norm_dtype": _dtype_name(kv.norm_dtype), "batch": kv.batch, "heads": kv.heads,
        "head_dim": kv.head_dim, "cumulative_length": lengths["seen"],
        "quantized": lengths["quantized"], "window": lengths["window"], "sinks": lengths["sinks"],
        "digest": state_digest(kv), "key_parts": kv.key_parts, "key_mean": "key_mean" in state,
    }


def _save_plain_layer(layer, i: int, tensors: dict) -> dict[str, Any]:
    keys = getattr(layer, "keys", None)
    if keys is None or not getattr(layer, "is_initialized", True) or keys.dim() != 4:  # 4.x: no is_initialized
        return {"kind": "plain", "initialized": False}
    tensors[f"layers.{i}.keys"], tensors[f"layers.{i}.values"] = layer.keys, layer.values
    return {
        "kind": "plain", "initialized": True, "class": type(layer).__name__, "dtype": _dtype_name(keys.dtype),
        "batch": keys.shape[0], "length": keys.shape[2],
        "cumulative_length": int(getattr(layer, "cumulative_length", keys.shape[2])),
    }


# ---- the index's schema ----------------------------------------------------------------------------------------


def _v2_name(name: str) -> str:
    layer, _, short = name.rpartition(".")
    return f"{layer}.{_V2_NAMES[short]}" if short in _V2_NAMES else name


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_COUNT = ("an integer in [0, 2**40]", lambda v: _is_int(v) and 0 <= v <= MAX_COUNT)
_POSITIVE = ("an integer in [1, 2**40]", lambda v: _is_int(v) and 1 <= v <= MAX_COUNT)
_BITS = ("an integer in [1, 8]", lambda v: _is_int(v) and 1 <= v <= 8)
_BOOL = ("true or false", lambda v: isinstance(v, bool))
_HEX = ("a SHA-256 digest (64 characters 0-9a-f)", lambda v: isinstance(v, str) and _HEX64.fullmatch(v) is not None)
_DTYPE = (f"one of {sorted(_DTYPES)}", lambda v: isinstance(v, str) and v in _DTYPES)
_NORM_DTYPE = (f"one of {list(_NORM_DTYPES)}", lambda v: isinstance(v, str) and v in _NORM_DTYPES)
_NAME = ("a class name", lambda v: isinstance(v, str) and v.isidentifier())
_OBJECT = ("an object", lambda v: isinstance(v, dict))
_STR_OR_NULL = ("a string or null", lambda v: v is None or isinstance(v, str))

_TOP = {
    "format": ("'tq_hf_cache.prefix.file'", lambda v: v == PREFIX_FORMAT),
    "format_version": (str(PREFIX_FORMAT_VERSION), lambda v: _is_int(v) and v == PREFIX_FORMAT_VERSION),
    "tq_config": _OBJECT, "model": _OBJECT,
    "weights": ("null or an object", lambda v: v is None or isinstance(v, dict)),
    "num_tokens": _COUNT, "batch": _POSITIVE, "token_ids_sha256": _HEX, "tensors_sha256": _HEX,
    "layers": ("a list", lambda v: isinstance(v, list)), "index_sha256": _HEX,
}
_MODEL = {"model_type": _STR_OR_NULL, **dict.fromkeys(MODEL_FACT_KEYS[1:], _POSITIVE)}
_WEIGHTS = {"sha256": _HEX, "name_or_path": _STR_OR_NULL}
_LAYER_HEAD = {"kind": ("'turboquant' or 'plain'", lambda v: v in ("turboquant", "plain")), "initialized": _BOOL}
_PLAIN = {**_LAYER_HEAD, "class": _NAME, "dtype": _DTYPE, "batch": _POSITIVE, "length": _COUNT,
          "cumulative_length": _COUNT}
_TQ = {
    **_LAYER_HEAD, "class": _NAME, "key_bits": _BITS, "value_bits": _BITS, "dtype": _DTYPE,
    "norm_dtype": _NORM_DTYPE, "batch": _POSITIVE, "heads": _POSITIVE, "head_dim": _POSITIVE,
    "cumulative_length": _COUNT, "quantized": _COUNT, "window": _COUNT, "sinks": _COUNT, "digest": _HEX,
    "key_parts": _POSITIVE, "key_mean": _BOOL,
}


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


def _check_fields(obj: dict, spec: dict, where: str, at: str) -> None:
    """Every field of `spec` present with its type and range, nothing else (raises naming the field)."""
    for key, (want, ok) in spec.items():
        if key not in obj:
            raise ValueError(f"{where}: field {at}{key} is missing")
        if not ok(obj[key]):
            raise ValueError(f"{where}: field {at}{key} must be {want}, got {_short(obj[key])}")
    extra = sorted(set(obj) - set(spec), key=str)
    if extra:
        raise ValueError(f"{where}: field {at}{extra[0]} is not part of prefix format version {PREFIX_FORMAT_VERSION}")


def check_index(doc, where: str) -> None:
    """The whole index's schema: every field's type and range, before anything is built from it."""
    if not isinstance(doc, dict):
        raise ValueError(f"{where} must hold a JSON object, got {type(doc).__name__}")
    _check_fields(doc, _TOP, where, "")
    _check_fields(doc["model"], _MODEL, where, "model.")
    if doc["weights"] is not None:
        _check_fields(doc["weights"], _WEIGHTS, where, "weights.")
    try:
        TurboQuantConfig.from_dict(doc["tq_config"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: field tq_config is invalid: {e}") from None
    for i, info in enumerate(doc["layers"]):
        at = f"layers[{i}]."
        if not isinstance(info, dict):
            raise ValueError(f"{where}: field layers[{i}] must be an object, got {_short(info)}")
        _check_fields({k: info[k] for k in _LAYER_HEAD if k in info}, _LAYER_HEAD, where, at)
        spec = (_TQ if info["kind"] == "turboquant" else _PLAIN) if info["initialized"] else _LAYER_HEAD
        _check_fields(info, spec, where, at)


# ---- load ------------------------------------------------------------------------------------------------------


def read_prefix_info(path: str) -> dict[str, Any]:
    """The JSON index of a prefix folder: parsed, version- and schema-checked, its own digest verified (an index of
    version 2 comes back as version 3 names it)."""
    return _read_index(path)[0]


def _read_index(path: str) -> tuple[dict[str, Any], int]:
    """(the index as this version names it, the version it was written in)."""
    where = os.path.join(path, PREFIX_JSON)
    if not os.path.isfile(where):
        raise FileNotFoundError(f"no {PREFIX_JSON} in {path!r}: save one with cache.save_prefix(path, token_ids)")
    try:
        with open(where, encoding="utf-8") as f:
            doc = json.load(f)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ValueError(f"{where} is corrupt (not valid JSON): {e}") from None
    if isinstance(doc, dict) and doc.get("format") == PREFIX_FORMAT and doc.get("format_version") == 1:
        raise ValueError(
            f"{where}: field format_version is 1, a prefix from an older tq_hf_cache whose tensors are not bound to "
            f"its index; this release reads version {PREFIX_FORMAT_VERSION}: re-save the prefix with "
            "cache.save_prefix(path, token_ids)"
        )
    new = _converted(doc)
    check_index(new, where)
    if index_digest(doc) != doc["index_sha256"]:
        raise ValueError(f"{where}: field index_sha256 does not match the index's content: the file was edited or "
                         "damaged after save_prefix; re-save the prefix")
    return new, doc["format_version"]


def _converted(doc):
    """A version 2 index as version 3 names it (field "residual" is "window"); anything else as it is."""
    if not isinstance(doc, dict) or doc.get("format_version") != 2 or not isinstance(doc.get("layers"), list):
        return doc
    layers = [{("window" if k == "residual" else k): v for k, v in info.items()} if isinstance(info, dict) else info
              for info in doc["layers"]]
    return {**doc, "layers": layers, "format_version": PREFIX_FORMAT_VERSION}


def load_prefix(cls, path: str, config, *, token_ids=None, codebooks=None, device=None, model=None):
    """A `cls` (TurboQuantCache) holding the saved prefix; see `TurboQuantCache.load_prefix`."""
    doc, version = _read_index(path)
    where = os.path.join(path, PREFIX_JSON)
    facts = model_facts(config)
    for k in MODEL_FACT_KEYS:  # exact: a model_type unknown on one side does not match a known one
        if doc["model"][k] != facts[k]:
            raise ValueError(f"{where}: the prefix was saved for model.{k}={doc['model'][k]!r}, but this model has "
                             f"{k}={facts[k]!r}")
    _check_weights(doc, where, model)
    if token_ids is not None:
        _check_tokens(doc, where, token_ids)
    tensors = _read_tensors(path, doc["tensors_sha256"], device)
    if version == 2:
        tensors = {_v2_name(name): t for name, t in tensors.items()}
    try:
        cache = cls(TurboQuantConfig.from_dict(doc["tq_config"]), config=config, codebooks=codebooks)
    except ValueError as e:
        raise ValueError(f"{where}: field tq_config does not fit this model: {e}") from None
    if len(doc["layers"]) != len(cache.layers):
        raise ValueError(f"{where}: field layers lists {len(doc['layers'])} layers, this model's cache has "
                         f"{len(cache.layers)}")
    unread = set(tensors)

    def get(name: str, shape: tuple, dtype: torch.dtype, i: int) -> torch.Tensor:
        """The stored tensor `name`, which the index says is `shape` of `dtype` (raises naming both)."""
        t = tensors.get(name)
        if t is None:
            raise ValueError(f"{path}/{PREFIX_TENSORS} lacks the tensor {name!r} that layers[{i}] of {PREFIX_JSON} "
                             "implies")
        if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            raise ValueError(f"{path}/{PREFIX_TENSORS}: tensor {name!r} is {tuple(t.shape)} {t.dtype}, but layers[{i}] "
                             f"of {PREFIX_JSON} and the model facts say {tuple(shape)} {dtype}")
        unread.discard(name)
        return t

    for i, (layer, info) in enumerate(zip(cache.layers, doc["layers"])):
        _restore_layer(layer, i, info, doc, facts, get, where, "cpu" if device is None else device)
    if unread:
        raise ValueError(f"{path}/{PREFIX_TENSORS} holds tensors {sorted(unread)} that {PREFIX_JSON} does not list")
    if cache.get_seq_length() != doc["num_tokens"]:
        raise ValueError(f"{where}: field num_tokens says {doc['num_tokens']} tokens, the restored cache holds "
                         f"{cache.get_seq_length()}")
    return cache


def _check_weights(doc: dict, where: str, model) -> None:
    """Refuse other weights than the saved ones; never skip the check silently."""
    saved = doc["weights"]
    if saved is None:
        if model is not None:
            raise ValueError(f"{where}: field weights is null: the prefix was saved without model=, so it cannot be "
                             "checked against this model's weights; re-save it with save_prefix(..., model=model) or "
                             "load it without model=")
        return
    if model is None:
        raise ValueError(f"{where}: the prefix is bound to the weights of {saved['name_or_path']!r} (field "
                         "weights.sha256); pass model= to load_prefix so they can be checked")
    if weights_digest(model) != saved["sha256"]:
        name = getattr(model.config, "name_or_path", None) or None
        raise ValueError(f"{where}: field weights.sha256 differs from this model's weights: the prefix was saved "
                         f"from {saved['name_or_path']!r}, this model is {name!r}; its keys and values would be "
                         "another model's")


def _check_tokens(doc: dict, where: str, token_ids) -> None:
    ids = torch.as_tensor(token_ids)
    ids = ids.unsqueeze(0) if ids.dim() == 1 else ids
    n = doc["num_tokens"]
    if ids.dim() != 2 or ids.shape[0] != doc["batch"] or ids.shape[1] < n \
            or token_digest(ids[:, :n]) != doc["token_ids_sha256"]:
        raise ValueError(
            f"{where}: the prefix holds other tokens than the first {n} of token_ids (field token_ids_sha256 or "
            "batch differs): a cache is only reusable for prompts that start with its exact prefix"
        )


def _read_tensors(path: str, digest: str, device) -> dict[str, torch.Tensor]:
    """The tensors file, read once into private memory: its digest (`_io.sha256_blocks`) must be the index's, then
    each tensor is copied out of it (to `device`, CPU when None)."""
    file = os.path.join(path, PREFIX_TENSORS)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no {PREFIX_TENSORS} in {path!r}, which {PREFIX_JSON} indexes: the folder is "
                                "incomplete; re-save the prefix")
    data = _io.read_private(file)
    if _io.sha256_blocks(data) != digest:
        raise ValueError(f"{file}: its SHA-256 differs from field tensors_sha256 of {PREFIX_JSON}: the tensors are "
                         "not the ones saved with this index (damaged, torn or another prefix's); re-save the prefix")
    return _io.parse_safetensors(data, file, device)


def _restore_layer(layer, i: int, info: dict, doc: dict, facts: dict, get, where: str, device) -> None:
    from ..hf.layer import TurboQuantLayer

    kind = "turboquant" if isinstance(layer, TurboQuantLayer) else "plain"
    if info["kind"] != kind:
        raise ValueError(f"{where}: field layers[{i}].kind is {info['kind']!r}, this cache's layer {i} is "
                         f"{type(layer).__name__} ({kind!r}): the configs differ")
    if not info["initialized"]:
        return
    if info["class"] != type(layer).__name__:
        raise ValueError(f"{where}: field layers[{i}].class is {info['class']!r}, this cache builds "
                         f"{type(layer).__name__}")
    if info["batch"] != doc["batch"] or info["cumulative_length"] != doc["num_tokens"]:
        raise ValueError(f"{where}: layers[{i}] holds batch {info['batch']} and cumulative_length "
                         f"{info['cumulative_length']}, the prefix batch {doc['batch']} and num_tokens "
                         f"{doc['num_tokens']}")
    if kind == "turboquant":
        _restore_tq_layer(layer, i, info, facts, get, where, device)
    else:
        _restore_plain_layer(layer, i, info, facts, get, where)


def _check_stored_length(layer, i: int, stored: int, info: dict, where: str, fields: str) -> None:
    """Tokens a layer stores: all it has seen (full attention), or at least the window's (sliding)."""
    cum = info["cumulative_length"]
    window = getattr(layer, "sliding_window", None)
    low = cum if not getattr(layer, "is_sliding", False) or window is None else min(cum, window - 1)
    if not low <= stored <= cum:
        raise ValueError(f"{where}: layers[{i}] stores {stored} tokens ({fields}) but cumulative_length is {cum}: a "
                         f"{type(layer).__name__} holds {low if low == cum else f'{low} to {cum}'}")


def _restore_tq_layer(layer, i: int, info: dict, facts: dict, get, where: str, device) -> None:
    if (layer.key_bits, layer.value_bits) != (info["key_bits"], info["value_bits"]):
        raise ValueError(f"{where}: layers[{i}] was saved at k{info['key_bits']}v{info['value_bits']}, this cache "
                         f"uses k{layer.key_bits}v{layer.value_bits}")
    b, h, d, q, r, s = (info[k] for k in ("batch", "heads", "head_dim", "quantized", "window", "sinks"))
    if (h, d) != (facts["num_key_value_heads"], facts["head_dim"]):
        raise ValueError(f"{where}: layers[{i}] has heads={h}, head_dim={d}, the model "
                         f"{facts['num_key_value_heads']} KV heads of dim {facts['head_dim']}")
    _check_stored_length(layer, i, q + r, info, where, "quantized + window")
    if r > layer.residual_capacity or s != min(layer.sink_tokens, q):
        raise ValueError(f"{where}: layers[{i}] holds window={r} and sinks={s}; this config keeps a window of "
                         f"at most {layer.residual_capacity} and min(sink_tokens={layer.sink_tokens}, quantized={q}) "
                         "sinks")
    dtype = _DTYPES[info["dtype"]]
    layer.lazy_initialization(torch.empty(b, h, 0, d, dtype=dtype, device=device))
    kv = layer.kv
    if state_digest(kv) != info["digest"]:
        raise ValueError(
            f"{where}: field layers[{i}].digest: the codes were quantized with another rotation or other codebooks "
            "than this cache's (seed, rotation kind or calibrated codebooks differ): they would decode to other vectors"
        )
    if info["key_parts"] != kv.key_parts:
        raise ValueError(f"{where}: field layers[{i}].key_parts is {info['key_parts']}, this cache's config splits "
                         f"keys in {kv.key_parts} part(s)")
    centred = layer.rope is not None
    if info["key_mean"] and not centred or centred and q and not info["key_mean"]:
        raise ValueError(f"{where}: field layers[{i}].key_mean is {info['key_mean']} with {q} quantized tokens; this "
                         f"cache's config has key_centering={centred}")
    norm_dtype, p = _DTYPES[info["norm_dtype"]], f"layers.{i}."
    tensors = {}
    for name, dim, bits in kv.part_dims():
        tensors[f"{name}_packed"] = get(p + f"{name}_packed", (b, h, q, packed_bytes(dim, bits)), torch.uint8, i)
        tensors[f"{name}_norms"] = get(p + f"{name}_norms", (b, h, q), norm_dtype, i)
    if info["key_mean"]:
        tensors["key_mean"] = get(p + "key_mean", (b, h, 1, d), torch.float32, i)
    for name, n in (("window_k", r), ("window_v", r), ("sink_k", s), ("sink_v", s)):
        tensors[name] = get(p + name, (b, h, n, d), dtype, i)
    kv.load_state(tensors, {"seen": info["cumulative_length"], "quantized": q, "window": r, "sinks": s},
                  norm_dtype, where=f"{where}: layers[{i}]")


def _restore_plain_layer(layer, i: int, info: dict, facts: dict, get, where: str) -> None:
    shape = (info["batch"], facts["num_key_value_heads"], info["length"], facts["head_dim"])
    _check_stored_length(layer, i, info["length"], info, where, "length")
    keys, values = (get(f"layers.{i}.{n}", shape, _DTYPES[info["dtype"]], i) for n in ("keys", "values"))
    if IS_V5:
        layer.lazy_initialization(keys, values)
    else:  # 4.x takes the keys alone
        layer.lazy_initialization(keys)
    layer.keys, layer.values = keys, values
    if hasattr(layer, "cumulative_length"):
        layer.cumulative_length = info["cumulative_length"]
