"""The `turboquant_config.json` document: reading and version-checking it, its digest, and the model facts it
binds (what calibrated codebooks and allocations depend on). Below `config` and `calibration`, which both read it."""

from __future__ import annotations

import json
import os
from typing import Any

from ._io import read_json, sha256_bytes

TURBOQUANT_CONFIG_NAME = "turboquant_config.json"
TURBOQUANT_FORMAT = "tq_hf_cache.turboquant"
TURBOQUANT_FORMAT_VERSION = 1
MODEL_FACT_KEYS = ("model_type", "num_hidden_layers", "num_key_value_heads", "head_dim")


def model_facts(model_config) -> dict[str, Any]:
    """The facts of a transformers config that calibrated codebooks depend on."""
    cfg = model_config
    if hasattr(cfg, "get_text_config"):
        try:
            cfg = cfg.get_text_config(decoder=True)
        except TypeError:  # transformers 4.x signature
            cfg = cfg.get_text_config()
    elif isinstance(cfg, dict) and isinstance(cfg.get("text_config"), dict):
        cfg = {"model_type": cfg.get("model_type"), **cfg["text_config"]}
    get = cfg.get if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
    heads = get("num_attention_heads")
    layers = get("num_hidden_layers")
    kv_heads = get("num_key_value_heads") or heads
    head_dim = get("head_dim") or (get("hidden_size") // heads if heads and get("hidden_size") else None)
    if layers is None or kv_heads is None or head_dim is None:
        raise ValueError(
            "the model config must give num_hidden_layers, num_key_value_heads (or num_attention_heads) and head_dim "
            f"(or hidden_size), got layers={layers!r}, kv_heads={kv_heads!r}, head_dim={head_dim!r}"
        )
    return {
        "model_type": get("model_type"),
        "num_hidden_layers": int(layers),
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(head_dim),
    }


DOC_DIGEST = "sha256"


def doc_digest(doc: dict[str, Any]) -> str:
    """SHA-256 of a turboquant_config.json document without its own digest, as canonical JSON."""
    body = {k: v for k, v in doc.items() if k != DOC_DIGEST}
    return sha256_bytes(json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8"))


def check_doc_digest(doc: dict[str, Any], where: str) -> None:
    """Refuse a document whose content differs from its `sha256` (written by save_pretrained): a corrupted or
    edited file. A document without one (older files, hand-written ones) is taken as it is; deleting the field is
    how a deliberate hand edit is accepted. Called after the fields are validated, so a bad field is named first."""
    digest = doc.get(DOC_DIGEST)
    if digest is None and DOC_DIGEST not in doc:
        return
    if not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise ValueError(f"{where}: {DOC_DIGEST} must be 64 lowercase hex digits, got {digest!r}")
    if digest != doc_digest(doc):
        raise ValueError(f"{where}: the content differs from its {DOC_DIGEST} (corrupted or edited after saving); "
                         f"save it again, or delete the {DOC_DIGEST!r} field to accept a hand edit")


def read_format_json(path: str, fmt: str, version: int, missing_hint: str) -> dict[str, Any]:
    """Load a tq_hf_cache JSON document and check its `format` and `format_version` (raises naming the path and
    the bad value); `missing_hint` says how to make the file when it is absent."""
    if not os.path.isfile(path):
        folder, name = os.path.split(path)
        raise FileNotFoundError(f"no {name} in {folder!r}: {missing_hint}")
    doc = read_json(path)
    if not isinstance(doc, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(doc).__name__}")
    if doc.get("format") != fmt:
        raise ValueError(f"{path}: format is {doc.get('format')!r}, expected {fmt!r}")
    if doc.get("format_version") != version:
        raise ValueError(
            f"{path}: format_version {doc.get('format_version')!r} is not supported; this tq_hf_cache reads version {version}"
        )
    return doc


def read_turboquant_json(directory) -> dict[str, Any]:
    """Load and version-check `directory/turboquant_config.json` (raises with the path and the bad value)."""
    path = os.path.join(directory, TURBOQUANT_CONFIG_NAME)
    doc = read_format_json(
        path, TURBOQUANT_FORMAT, TURBOQUANT_FORMAT_VERSION, "run `tq-hf-cache calibrate` or save_pretrained first"
    )
    if not isinstance(doc.get("tq_config"), dict):
        raise ValueError(f"{path}: missing or invalid 'tq_config' section (expected a JSON object)")
    model = doc.get("model")
    if model is not None:
        if not isinstance(model, dict) or set(model) != set(MODEL_FACT_KEYS):
            raise ValueError(f"{path}: the 'model' section must have exactly the keys {list(MODEL_FACT_KEYS)}, got {model!r}")
        if model["model_type"] is not None and not isinstance(model["model_type"], str):
            raise ValueError(f"{path}: model.model_type must be a string or null, got {model['model_type']!r}")
        for k in MODEL_FACT_KEYS[1:]:
            v = model[k]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{path}: model.{k} must be an integer >= 1, got {v!r}")
    return doc


def fact_mismatch(stored: dict[str, Any], facts: dict[str, Any]) -> tuple[str, Any, Any] | None:
    """The first model fact (name, stored value, given value) that differs, or None. Exact, model_type too: one
    unknown on one side does not match a known one (the layer count and shapes alone bind nothing)."""
    for k in MODEL_FACT_KEYS:
        if stored.get(k) != facts.get(k):
            return k, stored.get(k), facts.get(k)
    return None


def check_model_facts(doc: dict[str, Any], directory, config=None) -> None:
    """Compare the stored model facts with `config` and with `directory/config.json` (when present)."""
    stored = doc.get("model")
    if stored is None:
        return
    sources = []
    if config is not None:
        sources.append(("the given model config", model_facts(config)))
    cfg_path = os.path.join(directory, "config.json")
    if os.path.isfile(cfg_path):
        sources.append((cfg_path, model_facts(read_json(cfg_path))))
    for where, facts in sources:
        diff = fact_mismatch(stored, facts)
        if diff:
            k, want, got = diff
            raise ValueError(
                f"{TURBOQUANT_CONFIG_NAME} in {directory!r} was calibrated for {k}={want!r}, "
                f"but {where} has {k}={got!r}; recalibrate for this model"
            )
