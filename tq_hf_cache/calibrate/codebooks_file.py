"""The calibrated codebooks' files: `turboquant_codebooks.safetensors` and its index in `turboquant_config.json`,
read and checked against each other. Below `config` (which keeps a folder's codebooks when it saves there) and
`calibration` (which fits and writes them)."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from .._io import sha256_bytes, sha256_file
from ..quant.codebook import Codebook, check_bits
from ..config_file import TURBOQUANT_CONFIG_NAME, check_doc_digest

CODEBOOKS_NAME = "turboquant_codebooks.safetensors"
CODEBOOKS_FORMAT_VERSION = 1
KINDS = ("key", "value")
CHOICES = ("theoretical", "shared", "per_head")
_INDEX_KEYS = ("file", "format_version", "bits", "entries", "info", "sha256")
_ENTRY_KEYS = ("layer", "kind", "bits", "choice", "heldout_rel_mse")

Key = tuple[int, str, int]  # (layer, kind, bits)


def sections(doc: dict[str, Any], directory) -> tuple[dict[str, Any], dict[str, Any]]:
    """The (model, codebooks) sections of a read turboquant_config.json, refused when either is missing."""
    where = os.path.join(directory, TURBOQUANT_CONFIG_NAME)
    model = doc.get("model")
    if model is None:
        raise ValueError(f"{where} has no 'model' section: codebooks need the model facts it was calibrated on")
    index = doc.get("codebooks")
    if index is None:
        raise ValueError(f"{where} has no 'codebooks' section: this folder holds a config without calibrated codebooks")
    if not isinstance(index, dict):
        raise ValueError(f"{where}: the 'codebooks' section must be a JSON object, got {index!r}")
    return model, index


def read(directory, doc: dict[str, Any], seed: int) -> tuple[dict[Key, dict], dict[Key, Codebook], dict[str, Any]]:
    """(entries, codebooks, info) of a folder whose turboquant_config.json is `doc` and whose layers rotate with
    `seed` + layer index: every index field, tensor, shape and digest checked (a bad one is named with its file)."""
    model, index = sections(doc, directory)
    where = os.path.join(directory, TURBOQUANT_CONFIG_NAME)
    unknown = sorted(set(index) - set(_INDEX_KEYS))
    if unknown:
        raise ValueError(f"{where}: codebooks holds unknown fields {unknown}; known fields are {list(_INDEX_KEYS)}")
    if index.get("format_version") != CODEBOOKS_FORMAT_VERSION or isinstance(index.get("format_version"), bool):
        raise ValueError(
            f"{where}: codebooks.format_version {index.get('format_version')!r} is not supported; "
            f"this tq_hf_cache reads version {CODEBOOKS_FORMAT_VERSION}"
        )
    file_name = index.get("file", CODEBOOKS_NAME)
    if (
        not isinstance(file_name, str) or file_name in ("", ".", "..") or any(c in file_name for c in "/\\")
        or os.path.isabs(file_name)
    ):
        raise ValueError(
            f"{where}: codebooks.file must name a file inside the folder (no path separators), got {file_name!r}"
        )
    if not isinstance(index.get("info", {}), dict):
        raise ValueError(f"{where}: codebooks.info must be a JSON object, got {index['info']!r}")
    digest = index.get("sha256")
    if digest is not None and (not isinstance(digest, str) or len(digest) != 64
                               or any(c not in "0123456789abcdef" for c in digest)):
        raise ValueError(f"{where}: codebooks.sha256 must be 64 lowercase hex digits, got {digest!r}")
    path = os.path.join(directory, file_name)
    tensors, meta = load_tensors(path)
    bound = meta.get("index_sha256")
    n_layers, heads = model["num_hidden_layers"], model["num_key_value_heads"]

    seeds = tensors.pop("rotation_seeds", None)
    expected = torch.tensor([seed + i for i in range(n_layers)], dtype=torch.int64)
    if seeds is None:
        raise ValueError(f"{path} is missing the tensor 'rotation_seeds'")
    if seeds.dtype != torch.int64 or seeds.shape != expected.shape or not torch.equal(seeds, expected):
        raise ValueError(
            f"{path}: rotation_seeds {seeds.tolist()} ({seeds.dtype}) do not match seed={seed} + layer index "
            f"for {n_layers} layers of {where}: the files come from different calibrations"
        )
    entries, codebooks = {}, {}
    raw_entries = index.get("entries")
    if not isinstance(raw_entries, list):
        raise ValueError(f"{where}: codebooks.entries must be a list, got {type(raw_entries).__name__}")
    for n, e in enumerate(raw_entries):
        field = f"codebooks.entries[{n}]"
        if not isinstance(e, dict):
            raise ValueError(f"{where}: {field} must be an object, got {e!r}")
        layer, kind, bits, choice = e.get("layer"), e.get("kind"), e.get("bits"), e.get("choice")
        if not set(_ENTRY_KEYS[:4]) <= set(e) <= set(_ENTRY_KEYS):
            raise ValueError(f"{where}: {field} holds the fields {list(_ENTRY_KEYS[:4])} and optionally "
                             f"{_ENTRY_KEYS[4]!r}, got {e!r}")
        mse = e.get("heldout_rel_mse", {c: None for c in CHOICES})
        if not isinstance(mse, dict) or set(mse) != set(CHOICES) or not all(
                v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in mse.values()):
            raise ValueError(f"{where}: {field}.heldout_rel_mse must map each of {list(CHOICES)} to a number "
                             f"or null, got {mse!r}")
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n_layers:
            raise ValueError(f"{where}: {field}.layer must be an integer in [0, {n_layers}), got {layer!r}")
        if kind not in KINDS:
            raise ValueError(f"{where}: {field}.kind must be one of {KINDS}, got {kind!r}")
        check_bits(bits, f"{where}: {field}.bits (layer {layer} {kind})")
        if choice not in CHOICES:
            raise ValueError(f"{where}: {field}.choice (layer {layer} {kind} {bits}-bit) must be theoretical/shared/per_head, got {choice!r}")
        key = (layer, kind, bits)
        if key in entries:
            raise ValueError(f"{where}: duplicate entry for layer {layer} {kind} {bits}-bit")
        entries[key] = {k: v for k, v in e.items() if k not in ("layer", "kind", "bits")}
        name = tensor_name(*key)
        if choice == "theoretical":
            if name in tensors:
                raise ValueError(f"{path}: tensor {name!r} is present but the entry in {where} says 'theoretical'")
            continue
        t = tensors.pop(name, None)
        if t is None:
            raise ValueError(f"{path} is missing the tensor {name!r} listed in {TURBOQUANT_CONFIG_NAME}")
        want = (heads, 2**bits) if choice == "per_head" else (2**bits,)
        if t.dtype != torch.float32:
            raise ValueError(f"{path}: tensor {name!r} has dtype {t.dtype}, expected torch.float32")
        if tuple(t.shape) != want:
            raise ValueError(
                f"{path}: tensor {name!r} has shape {tuple(t.shape)}, expected {want} "
                f"({bits}-bit, {choice}, {heads} KV heads)"
            )
        if not torch.isfinite(t).all():
            raise ValueError(f"{path}: tensor {name!r} contains NaN or inf")
        if (t.diff(dim=-1) <= 0).any() or t.abs().max() > 1:
            raise ValueError(f"{path}: tensor {name!r} must hold strictly ascending centroids in [-1, 1]")
        codebooks[key] = Codebook.from_centroids(t, bits)
    if tensors:
        raise ValueError(f"{path} holds tensors not listed in {TURBOQUANT_CONFIG_NAME}: {sorted(tensors)}")
    have = entry_bits(entries)
    if "bits" in index and index["bits"] != have:
        raise ValueError(f"{where}: codebooks.bits {index['bits']!r} does not match its entries' bits {have}")
    if (bound is None) != (digest is None):
        raise ValueError(f"{where} and {path} do not belong together: "
                         + (f"{path} carries no index_sha256 but codebooks.sha256 is given" if bound is None
                            else f"codebooks.sha256 is missing, but {path} is bound to its index"))
    if digest is not None and sha256_file(path) != digest:
        raise ValueError(
            f"{path} is not the codebooks file {where} indexes (its SHA-256 differs from codebooks.sha256): it "
            "was changed, or comes from another calibration; recalibrate, or restore both files together"
        )
    check_doc_digest(doc, where)
    if bound is not None and bound != index_digest(model, {k: v for k, v in index.items() if k != "sha256"}):
        raise ValueError(
            f"{where}: the 'codebooks' or 'model' section differs from the one {path} was saved with (edited "
            "after saving?); recalibrate, or restore the saved file"
        )
    return entries, codebooks, dict(index.get("info", {}))


def entry_bits(entries) -> dict[str, list[int]]:
    """The bit widths calibrated per kind."""
    return {k: sorted({b for (_, kk, b) in entries if kk == k}) for k in KINDS}


def check_rotation(seed: int, rotation: str, tq_config) -> None:
    """Raise unless `tq_config` rotates as the calibration did (`seed`, `rotation`): the rotation defines the
    coordinates the centroids were fitted to."""
    if tq_config.seed != seed or tq_config.rotation != rotation:
        raise ValueError(
            f"the codebooks were calibrated with seed={seed}, rotation={rotation!r} but the "
            f"cache uses seed={tq_config.seed}, rotation={tq_config.rotation!r}; they must match (the rotation "
            "defines the coordinates the centroids were fitted to): pass seed / rotation as calibrated, or "
            "recalibrate"
        )


def check_covers(entries, n_layers: int, tq_config) -> None:
    """Raise unless every quantized layer's (kind, bits) under `tq_config` has a calibrated entry."""
    bits = entry_bits(entries)
    for i in range(n_layers):
        kv = tq_config.bits_for_layer(i, n_layers)
        if kv is None:
            continue
        for kind, b in zip(KINDS, kv):
            if (i, kind, b) not in entries:
                raise ValueError(
                    f"layer {i} needs a {b}-bit {kind} codebook but the calibrated {kind} bits are "
                    f"{bits[kind]}; recalibrate with these bits (tq-hf-cache calibrate --key-bits/--value-bits)"
                )


def tensor_name(layer: int, kind: str, bits: int) -> str:
    return f"layers.{layer}.{kind}.{bits}bit.centroids"


def index_digest(model: dict, index: dict) -> str:
    """SHA-256 of the model facts and the codebook index (without its own `sha256`), as canonical JSON."""
    return sha256_bytes(json.dumps({"model": model, "codebooks": index}, sort_keys=True,
                                   separators=(",", ":")).encode("utf-8"))


def load_tensors(path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import safe_open

    if not os.path.isfile(path):
        raise FileNotFoundError(f"calibrated codebooks file {path!r} is missing (listed in {TURBOQUANT_CONFIG_NAME})")
    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format_version") != str(CODEBOOKS_FORMAT_VERSION):
                raise ValueError(
                    f"{path}: format_version {meta.get('format_version')!r} is not supported; expected "
                    f"{str(CODEBOOKS_FORMAT_VERSION)!r}"
                )
            return {k: f.get_tensor(k) for k in f.keys()}, meta
    except ValueError:
        raise
    except Exception as e:  # safetensors raises SafetensorsError (truncated header, bad offsets, ...)
        raise ValueError(f"{path} is corrupt or truncated and cannot be read as safetensors: {e}") from None
