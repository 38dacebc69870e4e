"""Calibrated Lloyd-Max codebooks: fit the centroids to a model's real rotated K/V coordinates.

The theoretical codebook assumes each rotated coordinate of a unit vector follows the law of a uniformly random
unit vector. Real keys and values are not uniform on the sphere, so per-layer (and per-KV-head) centroids fitted
on calibration text lower the reconstruction error.

How it works:

* A recording cache (a `DynamicCache` subclass) sees every layer's key/value states exactly as the
  TurboQuantCache would, rotates the unit vectors with the SAME rotation (seed + layer_idx, config.rotation) and
  streams the coordinates into fixed-size histograms on a fine grid over [-1, 1] (count, sum and sum of squares
  per bin, per layer / kind / KV head). Memory is O(layers * heads * bins), independent of the token count.
* Tokens are split into a fit part and a held-out part (alternating blocks of `HOLDOUT_BLOCK` positions).
* For each layer, kind and needed bit width, weighted 1-D k-means (Lloyd-Max) starts from the theoretical
  codebook (scaled to the data's RMS, which is 1/sqrt(dim) for unit vectors, so in practice unscaled), once with one codebook for all heads ("shared") and once per KV head ("per_head").
* Choice rule (held-out relative MSE, measured on the held-out histograms): take "per_head" when it beats
  "shared" by more than `PER_HEAD_MIN_GAIN` (2 %), else "shared"; then keep the calibrated codebook only if it
  beats the theoretical one on held-out data, else record "theoretical" (the cache then uses the theoretical
  codebook for that layer). The chosen variant is refit on fit + held-out data.

The objective is the relative (unit-vector) MSE ||u - u_hat||^2, the quantity the codebook controls: the
cache stores ||x|| separately, so ||x - x_hat||^2 / ||x||^2 = ||u - u_hat||^2.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from transformers import DynamicCache

from .codebook import Codebook, check_bits, theoretical_codebook
from .config import (
    TURBOQUANT_CONFIG_NAME,
    TurboQuantConfig,
    check_doc_digest,
    check_model_facts,
    fact_mismatch,
    model_facts,
    read_turboquant_json,
)
from ._compat import cache_kwargs
from ._io import safetensors_bytes, sha256_bytes, sha256_file, write_bytes
from .rotation import make_rotation

CODEBOOKS_NAME = "turboquant_codebooks.safetensors"
CODEBOOKS_FORMAT_VERSION = 1
KINDS = ("key", "value")
CHOICES = ("theoretical", "shared", "per_head")
_INDEX_KEYS = ("file", "format_version", "bits", "entries", "info", "sha256")
_ENTRY_KEYS = ("layer", "kind", "bits", "choice", "heldout_rel_mse")
DEFAULT_BINS = 8192
HOLDOUT_BLOCK = 32
PER_HEAD_MIN_GAIN = 0.02
LLOYD_ITERS = 300
# every other block of HOLDOUT_BLOCK positions is held out: a fit needs both halves
MIN_CALIBRATION_TOKENS = 2 * HOLDOUT_BLOCK
_TINY = 1e-30


# ---- streaming statistics ------------------------------------------------------------------------------------


class _LayerStats:
    """count / sum / sum-of-squares histograms, shape (2 splits, 2 kinds, heads, bins), float64."""

    def __init__(self, heads: int, bins: int):
        self.heads, self.bins = heads, bins
        self.hist = torch.zeros(3, 2, 2, heads, bins, dtype=torch.float64)

    def add(self, kind_idx: int, y: torch.Tensor) -> None:
        # y: (B, H, T, D) rotated unit coordinates in [-1, 1]
        b, h, t, d = y.shape
        if h != self.heads:
            raise ValueError(f"expected {self.heads} KV heads, got {h}")
        y = y.double().clamp(-1.0, 1.0)
        bins = ((y + 1.0) * (self.bins / 2.0)).long().clamp_(0, self.bins - 1)
        split = ((torch.arange(t) // HOLDOUT_BLOCK) % 2).view(1, 1, t, 1).expand(b, h, t, d)
        head = torch.arange(h).view(1, h, 1, 1).expand(b, h, t, d)
        flat = ((split * h + head) * self.bins + bins).reshape(-1)
        n = 2 * h * self.bins
        yf = y.reshape(-1)
        cnt = torch.bincount(flat, minlength=n).double()
        s1 = torch.bincount(flat, weights=yf, minlength=n)
        s2 = torch.bincount(flat, weights=yf * yf, minlength=n)
        for i, s in enumerate((cnt, s1, s2)):
            self.hist[i, :, kind_idx] += s.view(2, h, self.bins)


class RecordingCache(DynamicCache):
    """A DynamicCache that feeds each layer's K/V (as the TurboQuantCache would store them) to a callback."""

    def __init__(self, on_update, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._on_update = on_update

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self._on_update(layer_idx, key_states, value_states)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


# ---- batched weighted Lloyd-Max ------------------------------------------------------------------------------


def _lloyd_batched(grid: torch.Tensor, w: torch.Tensor, init: torch.Tensor, iters: int = LLOYD_ITERS) -> torch.Tensor:
    """Weighted 1-D k-means for N histograms at once. grid, w: (N, G) (grid ascending per row); init (N, k)."""
    n, g = grid.shape
    wc = torch.cat([w.new_zeros(n, 1), torch.cumsum(w, 1)], 1)
    xc = torch.cat([w.new_zeros(n, 1), torch.cumsum(w * grid, 1)], 1)
    c = torch.sort(init.double(), dim=1)[0].clone()
    lo = torch.zeros(n, 1, dtype=torch.long)
    hi = torch.full((n, 1), g, dtype=torch.long)
    for _ in range(iters):
        b = (c[:, 1:] + c[:, :-1]) / 2
        cut = torch.cat([lo, torch.searchsorted(grid, b.contiguous()), hi], 1)
        mass = wc.gather(1, cut[:, 1:]) - wc.gather(1, cut[:, :-1])
        first = xc.gather(1, cut[:, 1:]) - xc.gather(1, cut[:, :-1])
        new = torch.where(mass > 0, first / mass.clamp_min(_TINY), c)
        moved = (new - c).abs().max().item()
        c = new
        if moved < 1e-10:
            break
    return c


def _grid(cnt: torch.Tensor, s1: torch.Tensor, bins: int) -> torch.Tensor:
    """Bin means where a bin is non-empty, bin centres elsewhere (ascending: a mean lies inside its bin)."""
    centres = (torch.arange(bins, dtype=torch.float64) + 0.5) * (2.0 / bins) - 1.0
    return torch.where(cnt > 0, s1 / cnt.clamp_min(1), centres.expand_as(cnt))


def _hist_sse(cnt, s1, s2, centroids: torch.Tensor) -> torch.Tensor:
    """Sum of squared errors of the histogram under nearest-centroid coding, per row. centroids (N, k)."""
    bins = cnt.shape[-1]
    grid = _grid(cnt, s1, bins)
    bounds = ((centroids[:, 1:] + centroids[:, :-1]) / 2).contiguous()
    idx = torch.searchsorted(bounds, grid.contiguous())
    c = centroids.gather(1, idx)
    return (s2 - 2 * c * s1 + cnt * c * c).sum(1)


# ---- the result ----------------------------------------------------------------------------------------------


@dataclass
class CalibratedCodebooks:
    """Codebooks per (layer, kind, bits); `get` is what `TurboQuantCache(codebooks=...)` calls.

    `entries[(layer, kind, bits)]` is a dict: choice ("shared", "per_head" or "theoretical") and the held-out
    relative MSE of each candidate; `codebooks` holds a Codebook for every entry whose choice is not theoretical.
    """

    config: TurboQuantConfig
    model: dict[str, Any]
    codebooks: dict[tuple[int, str, int], Codebook] = field(default_factory=dict)
    entries: dict[tuple[int, str, int], dict[str, Any]] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    def get(self, layer_idx: int, kind: str, bits: int) -> Codebook | None:
        return self.codebooks.get((int(layer_idx), kind, int(bits)))

    def check_states(self, layer_idx: int, heads: int, head_dim: int) -> None:
        """Refuse a layer's K/V that are not of the model these codebooks were calibrated on."""
        m = self.model
        if not 0 <= int(layer_idx) < m["num_hidden_layers"]:
            raise ValueError(
                f"calibrated codebooks for a {m['num_hidden_layers']}-layer model ({m['model_type']}) got K/V for "
                f"layer {layer_idx}; recalibrate for this model"
            )
        if (heads, head_dim) != (m["num_key_value_heads"], m["head_dim"]):
            raise ValueError(
                f"calibrated codebooks were fitted to {m['num_key_value_heads']} KV heads of head dim {m['head_dim']} "
                f"({m['model_type']}), but layer {layer_idx} has {heads} KV heads of head dim {head_dim}; recalibrate "
                "for this model"
            )

    def check_model(self, model_config) -> None:
        """Refuse a model config whose facts (type, layers, KV heads, head dim) differ from the calibrated ones."""
        diff = fact_mismatch(self.model, model_facts(model_config))
        if diff:
            k, want, got = diff
            raise ValueError(
                f"the codebooks were calibrated for {k}={want!r}, but the model config has {k}={got!r}; "
                "recalibrate for this model"
            )

    @property
    def bits(self) -> dict[str, list[int]]:
        return {k: sorted({b for (_, kk, b) in self.entries if kk == k}) for k in KINDS}

    def summary(self) -> dict[str, Any]:
        """Mean held-out relative MSE per kind and bit width, and how many layers chose each variant."""
        out: dict[str, Any] = {}
        for kind in KINDS:
            for b in self.bits[kind]:
                es = [e for (l, k, bb), e in sorted(self.entries.items()) if k == kind and bb == b]
                row = {c: _mean(e["heldout_rel_mse"][c] for e in es) for c in ("theoretical", "shared", "per_head")}
                row["chosen"] = _mean(e["heldout_rel_mse"][e["choice"]] for e in es)
                row["choices"] = {c: sum(e["choice"] == c for e in es) for c in ("theoretical", "shared", "per_head")}
                out[f"{kind}_{b}bit"] = row
        return out

    # ---- persistence ----

    def save_pretrained(self, save_directory, extra: dict[str, Any] | None = None) -> None:
        """Write `turboquant_codebooks.safetensors`, then `turboquant_config.json` (config, model facts, codebook
        index). The two are bound: the index holds the tensors file's SHA-256, the tensors file the SHA-256 of the
        index and model facts (`_index_digest`), so a file of another calibration, or an edited one, is refused."""
        tensors = {}
        for (layer, kind, bits), cb in sorted(self.codebooks.items()):
            tensors[_tensor_name(layer, kind, bits)] = cb.centroids.detach().float().cpu().contiguous()
        n_layers = self.model["num_hidden_layers"]
        tensors["rotation_seeds"] = torch.tensor([self.config.seed + i for i in range(n_layers)], dtype=torch.int64)
        index = {
            "file": CODEBOOKS_NAME,
            "format_version": CODEBOOKS_FORMAT_VERSION,
            "bits": self.bits,
            "entries": [
                {"layer": l, "kind": k, "bits": b, **e} for (l, k, b), e in sorted(self.entries.items())
            ],
            "info": self.info,
        }
        model = model_facts(self.model)
        index = json.loads(json.dumps(index))  # the index as it will read back (tuples as lists, keys as strings)
        data = safetensors_bytes(tensors, metadata={"format_version": str(CODEBOOKS_FORMAT_VERSION),
                                                    "index_sha256": _index_digest(model, index)})
        index["sha256"] = sha256_bytes(data)
        os.makedirs(save_directory, exist_ok=True)
        write_bytes(os.path.join(save_directory, CODEBOOKS_NAME), data)
        self.config.save_pretrained(save_directory, model_config=model, extra={**(extra or {}), "codebooks": index})

    @classmethod
    def from_pretrained(cls, directory, config=None) -> "CalibratedCodebooks":
        """Load and validate; `config` (a transformers config) is checked against the stored model facts.

        Files with digests (see `save_pretrained`) must match them; files of format version 1 written before the
        digests existed carry neither and are read unbound."""
        doc = read_turboquant_json(directory)
        check_model_facts(doc, directory, config)
        where = os.path.join(directory, TURBOQUANT_CONFIG_NAME)
        model = doc.get("model")
        if model is None:
            raise ValueError(f"{where} has no 'model' section: codebooks need the model facts it was calibrated on")
        index = doc.get("codebooks")
        if index is None:
            raise ValueError(f"{where} has no 'codebooks' section: this folder holds a config without calibrated codebooks")
        if not isinstance(index, dict):
            raise ValueError(f"{where}: the 'codebooks' section must be a JSON object, got {index!r}")
        tq = TurboQuantConfig.from_file_doc(doc, directory, check_digest=False)
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
        tensors, meta = _load_tensors(path)
        bound = meta.get("index_sha256")
        n_layers, heads = model["num_hidden_layers"], model["num_key_value_heads"]

        seeds = tensors.pop("rotation_seeds", None)
        expected = torch.tensor([tq.seed + i for i in range(n_layers)], dtype=torch.int64)
        if seeds is None:
            raise ValueError(f"{path} is missing the tensor 'rotation_seeds'")
        if seeds.dtype != torch.int64 or seeds.shape != expected.shape or not torch.equal(seeds, expected):
            raise ValueError(
                f"{path}: rotation_seeds {seeds.tolist()} ({seeds.dtype}) do not match seed={tq.seed} + layer index "
                f"for {n_layers} layers of {where}: the files come from different calibrations"
            )
        out = cls(tq, dict(model), info=dict(index.get("info", {})))
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
            if key in out.entries:
                raise ValueError(f"{where}: duplicate entry for layer {layer} {kind} {bits}-bit")
            out.entries[key] = {k: v for k, v in e.items() if k not in ("layer", "kind", "bits")}
            name = _tensor_name(*key)
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
            out.codebooks[key] = Codebook.from_centroids(t, bits)
        if tensors:
            raise ValueError(f"{path} holds tensors not listed in {TURBOQUANT_CONFIG_NAME}: {sorted(tensors)}")
        if "bits" in index and index["bits"] != out.bits:
            raise ValueError(f"{where}: codebooks.bits {index['bits']!r} does not match its entries' bits {out.bits}")
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
        if bound is not None and bound != _index_digest(model, {k: v for k, v in index.items() if k != "sha256"}):
            raise ValueError(
                f"{where}: the 'codebooks' or 'model' section differs from the one {path} was saved with (edited "
                "after saving?); recalibrate, or restore the saved file"
            )
        return out

    def check_rotation(self, tq_config: TurboQuantConfig) -> None:
        """Raise unless `tq_config` rotates as the calibration did: the rotation defines the coordinates the
        centroids were fitted to."""
        if tq_config.seed != self.config.seed or tq_config.rotation != self.config.rotation:
            raise ValueError(
                f"the codebooks were calibrated with seed={self.config.seed}, rotation={self.config.rotation!r} but the "
                f"cache uses seed={tq_config.seed}, rotation={tq_config.rotation!r}; they must match (the rotation "
                "defines the coordinates the centroids were fitted to): pass seed / rotation as calibrated, or "
                "recalibrate"
            )

    def check_covers(self, tq_config: TurboQuantConfig) -> None:
        """Raise unless every quantized layer's (kind, bits) under `tq_config` has a calibrated entry."""
        n = self.model["num_hidden_layers"]
        self.check_rotation(tq_config)
        for i in range(n):
            kv = tq_config.bits_for_layer(i, n)
            if kv is None:
                continue
            for kind, b in zip(KINDS, kv):
                if (i, kind, b) not in self.entries:
                    raise ValueError(
                        f"layer {i} needs a {b}-bit {kind} codebook but the calibrated {kind} bits are "
                        f"{self.bits[kind]}; recalibrate with these bits (tq-hf-cache calibrate --key-bits/--value-bits)"
                    )


def _tensor_name(layer: int, kind: str, bits: int) -> str:
    return f"layers.{layer}.{kind}.{bits}bit.centroids"


def _index_digest(model: dict, index: dict) -> str:
    """SHA-256 of the model facts and the codebook index (without its own `sha256`), as canonical JSON."""
    return sha256_bytes(json.dumps({"model": model, "codebooks": index}, sort_keys=True,
                                   separators=(",", ":")).encode("utf-8"))


def _load_tensors(path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
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


# ---- calibration ---------------------------------------------------------------------------------------------


def _token_batches(data, tokenizer, seq_len: int, batch_size: int, max_tokens: int | None):
    """Token id batches (B, T) without padding from text(s) or token tensors."""
    if isinstance(data, str):
        data = [data]
    if isinstance(data, torch.Tensor):
        data = [data]
    ids: list[int] = []
    ready: list[torch.Tensor] = []
    for item in data:
        if isinstance(item, str):
            if tokenizer is None:
                raise ValueError("calibrating on text needs a tokenizer: calibrate(model, texts, config, tokenizer=tok)")
            ids.extend(tokenizer(item, add_special_tokens=False)["input_ids"])
            if tokenizer.eos_token_id is not None:
                ids.append(tokenizer.eos_token_id)
        elif isinstance(item, torch.Tensor):
            t = item.long()
            if t.dim() == 1:
                ids.extend(t.tolist())
            elif t.dim() == 2:
                ready.append(t)
            else:
                raise ValueError(f"token batches must be 1-D or (batch, seq) tensors, got shape {tuple(t.shape)}")
        else:
            raise TypeError(f"calibration data must be strings or token tensors, got {type(item).__name__}")
    if ids:
        flat = torch.tensor(ids, dtype=torch.long)
        chunks = [flat[i : i + seq_len] for i in range(0, len(flat), seq_len)]
        full = [c for c in chunks if len(c) == seq_len]
        for i in range(0, len(full), batch_size):
            ready.append(torch.stack(full[i : i + batch_size]))
        if chunks and len(chunks[-1]) < seq_len:
            ready.append(chunks[-1].unsqueeze(0))
    used, out = 0, []
    for t in ready:
        if max_tokens is not None:
            room = max_tokens - used
            if room <= 0:
                break
            if t.numel() > room:
                t = t[: max(1, room // t.shape[1])] if room >= t.shape[1] else t[:1, :room]
        used += t.numel()
        out.append(t)
    if not out:
        raise ValueError("no calibration tokens: pass non-empty text or token tensors")
    return out


def _needed_bits(config: TurboQuantConfig, n_layers: int, extra_bits: Iterable[int]) -> dict[int, dict[str, set[int]]]:
    need: dict[int, dict[str, set[int]]] = {}
    extra = {check_bits(b, "extra bits") for b in extra_bits}
    for i in range(n_layers):
        kv = config.bits_for_layer(i, n_layers)
        if kv is None:
            continue
        need[i] = {"key": {kv[0], *extra}, "value": {kv[1], *extra}}
    return need


@torch.no_grad()
def calibrate(
    model,
    texts_or_token_batches,
    config: TurboQuantConfig | None = None,
    *,
    tokenizer=None,
    seq_len: int = 512,
    batch_size: int = 1,
    max_tokens: int | None = None,
    bins: int = DEFAULT_BINS,
    extra_bits: Iterable[int] = (),
    per_head: bool | None = None,
    progress: bool = True,
) -> CalibratedCodebooks:
    """Fit per-layer (and, when it helps on held-out tokens, per-KV-head) Lloyd-Max codebooks.

    Args:
        model: a transformers causal LM (its attention layers must write to the cache it is given).
        texts_or_token_batches: a string, a list of strings (needs `tokenizer`), or token id tensors (T,) / (B, T).
        config: the TurboQuantConfig the cache will use (bits, layer_bits, skips, seed, rotation).
        seq_len: tokens per sequence of a forward pass (no padding is ever used).
        batch_size: sequences per forward pass.
        max_tokens: stop after this many tokens.
        bins: histogram bins over [-1, 1] per layer / kind / head.
        extra_bits: fit these bit widths too (for every quantized layer and both kinds), e.g. to compare widths.
        per_head: force (True) or forbid (False) per-head codebooks; None applies the held-out rule.
    """
    from tqdm.auto import tqdm

    config = config or TurboQuantConfig()
    if isinstance(bins, bool) or not isinstance(bins, int) or not 256 <= bins <= 1 << 20:
        raise ValueError(f"bins must be an integer in [256, {1 << 20}], got {bins!r}")
    facts = model_facts(model.config)
    n_layers, heads, dim = facts["num_hidden_layers"], facts["num_key_value_heads"], facts["head_dim"]
    need = _needed_bits(config, n_layers, extra_bits)
    if not need:
        raise ValueError("the config keeps every layer in full precision: there is nothing to calibrate")
    stats = {i: _LayerStats(heads, bins) for i in need}
    rotations = {i: make_rotation(dim, config.seed + i, config.rotation) for i in need}

    def on_update(layer_idx, k, v):
        if layer_idx not in stats:
            return
        rot = rotations[layer_idx]
        for kind_idx, x in enumerate((k, v)):
            xf = x.detach().float().cpu()
            unit = xf / xf.norm(dim=-1, keepdim=True).clamp_min(_TINY)
            stats[layer_idx].add(kind_idx, rot.forward(unit))

    batches = _token_batches(texts_or_token_batches, tokenizer, seq_len, batch_size, max_tokens)
    total = sum(t.numel() for t in batches)
    longest = max(t.shape[1] for t in batches)
    if total < MIN_CALIBRATION_TOKENS or longest <= HOLDOUT_BLOCK:
        raise ValueError(
            f"calibration needs at least {MIN_CALIBRATION_TOKENS} tokens in sequences longer than {HOLDOUT_BLOCK} tokens "
            f"(every other block of {HOLDOUT_BLOCK} positions is held out to check the fit), got {total} tokens with "
            f"the longest sequence {longest} tokens; pass more text (or a larger seq_len / max_tokens). The "
            "theoretical codebooks need no calibration."
        )
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with tqdm(total=total, unit="tok", desc="calibrating", disable=not progress) as bar:
            for ids in batches:
                model(input_ids=ids.to(device), **cache_kwargs(model, RecordingCache(on_update)), use_cache=True)
                bar.update(ids.numel())
    finally:
        model.train(was_training)

    out = CalibratedCodebooks(
        config,
        facts,
        info={"num_tokens": total, "bins": bins, "holdout_block": HOLDOUT_BLOCK, "per_head_min_gain": PER_HEAD_MIN_GAIN},
    )
    layers = sorted(need)
    for kind_idx, kind in enumerate(KINDS):
        for b in sorted({bb for i in layers for bb in need[i][kind]}):
            ls = [i for i in layers if b in need[i][kind]]
            _fit(out, stats, ls, kind_idx, kind, b, dim, heads, bins, per_head)
    return out


def _fit(out, stats, layers, kind_idx, kind, bits, dim, heads, bins, per_head_mode):
    """Fit and choose codebooks for the given layers at one (kind, bits); fills out.codebooks / out.entries."""
    hist = torch.stack([stats[i].hist[:, :, kind_idx] for i in layers], 0)  # (L, 3, 2 splits, H, bins)
    L = len(layers)
    fit, held = hist[:, :, 0], hist[:, :, 1]  # (L, 3, H, bins)
    theo = theoretical_codebook(bits, dim).centroids.double()
    k = 2**bits

    def centroids(h, shared: bool):
        # h: (L, 3, H, bins) -> (L, k) shared or (L, H, k) per head
        if shared:
            cnt, s1 = h[:, 0].sum(1), h[:, 1].sum(1)
        else:
            cnt, s1 = h[:, 0].reshape(L * heads, bins), h[:, 1].reshape(L * heads, bins)
        # start from the theoretical codebook scaled to the data's RMS (~1 for unit vectors: mean y^2 = 1/dim)
        s2 = h[:, 2].sum(1) if shared else h[:, 2].reshape(L * heads, bins)
        rms = (s2.sum(1) / cnt.sum(1).clamp_min(1) * dim).sqrt()
        scale = torch.where(rms > 0, rms, torch.ones_like(rms)).unsqueeze(1)
        c = _lloyd_batched(_grid(cnt, s1, bins), cnt, theo.expand(cnt.shape[0], k) * scale)
        return c if shared else c.view(L, heads, k)

    def heldout_rel_mse(c_per_row):  # c_per_row (L, H, k)
        cnt, s1, s2 = (held[:, j].reshape(L * heads, bins) for j in range(3))
        sse = _hist_sse(cnt, s1, s2, c_per_row.reshape(L * heads, k)).view(L, heads).sum(1)
        vectors = cnt.view(L, heads, bins).sum((1, 2)) / dim
        return sse / vectors.clamp_min(1)

    cand = {
        "theoretical": theo.expand(L, heads, k),
        "shared": centroids(fit, True).unsqueeze(1).expand(L, heads, k),
        "per_head": centroids(fit, False),
    }
    errs = {name: heldout_rel_mse(c) for name, c in cand.items()}
    has_heldout = held[:, 0].sum((1, 2)) > 0
    full = fit + held
    final_shared = centroids(full, True)
    final_per_head = centroids(full, False) if per_head_mode is not False else None
    for j, layer in enumerate(layers):
        e = {name: float(v[j]) for name, v in errs.items()}
        if per_head_mode is None:
            choice = "per_head" if e["per_head"] < (1 - PER_HEAD_MIN_GAIN) * e["shared"] else "shared"
        else:
            choice = "per_head" if per_head_mode else "shared"
        if per_head_mode is None and bool(has_heldout[j]) and e[choice] >= e["theoretical"]:
            choice = "theoretical"
        out.entries[(layer, kind, bits)] = {
            "choice": choice,
            "heldout_rel_mse": {name: (v if math.isfinite(v) else None) for name, v in e.items()},
        }
        if choice == "shared":
            out.codebooks[(layer, kind, bits)] = Codebook.from_centroids(final_shared[j].float(), bits)
        elif choice == "per_head":
            out.codebooks[(layer, kind, bits)] = Codebook.from_centroids(final_per_head[j].float(), bits)


def load_calibrated(directory, config=None) -> CalibratedCodebooks:
    return CalibratedCodebooks.from_pretrained(directory, config=config)


def describe(directory) -> dict[str, Any]:
    """What a folder stores (for `tq-hf-cache info`), without loading a model."""
    doc = read_turboquant_json(directory)
    tq = TurboQuantConfig.from_dict(doc["tq_config"])  # validated: a bad field is named, not a KeyError later
    check_doc_digest(doc, os.path.join(directory, TURBOQUANT_CONFIG_NAME))
    out = {"format_version": doc["format_version"], "tq_config": tq.to_dict(), "model": doc.get("model")}
    if "codebooks" in doc:
        cb = CalibratedCodebooks.from_pretrained(directory)
        out["codebooks"] = {"bits": cb.bits, "info": cb.info, "summary": cb.summary()}
    return json.loads(json.dumps(out))


@torch.no_grad()
def measure_reconstruction(
    model,
    texts_or_token_batches,
    config: TurboQuantConfig | None = None,
    codebooks=None,
    *,
    bits: Iterable[int] | None = None,
    tokenizer=None,
    seq_len: int = 512,
    max_tokens: int | None = None,
) -> dict[str, float]:
    """Mean relative MSE ||x - x_hat||^2 / ||x||^2 of the model's real K/V vectors through the torch reference
    quantizer, per "key_{b}bit" / "value_{b}bit", over the layers `config` quantizes. `codebooks` (anything with
    `get(layer, kind, bits)`) replaces the theoretical codebook where it returns one; None measures theoretical.
    `bits` defaults to the config's key/value bits. Streams: nothing but running sums is kept."""
    from .reference import dequantize, quantize

    config = config or TurboQuantConfig()
    facts = model_facts(model.config)
    n_layers, dim = facts["num_hidden_layers"], facts["head_dim"]
    widths = {k: sorted(set(bits)) if bits is not None else None for k in KINDS}
    sums: dict[str, list[float]] = {}

    def on_update(layer_idx, k, v):
        kv = config.bits_for_layer(layer_idx, n_layers)
        if kv is None:
            return
        rot = make_rotation(dim, config.seed + layer_idx, config.rotation)
        for kind, x, default_b in (("key", k, kv[0]), ("value", v, kv[1])):
            xf = x.detach().float().cpu()
            for b in widths[kind] or [default_b]:
                cb = codebooks.get(layer_idx, kind, b) if codebooks is not None else None
                cb = cb if cb is not None else theoretical_codebook(b, dim)
                packed, norms = quantize(xf, rot, cb, torch.float32)
                err = (dequantize(packed, norms, rot, cb) - xf).pow(2).sum(-1) / xf.pow(2).sum(-1).clamp_min(_TINY)
                s = sums.setdefault(f"{kind}_{b}bit", [0.0, 0])
                s[0] += float(err.sum())
                s[1] += err.numel()

    for ids in _token_batches(texts_or_token_batches, tokenizer, seq_len, 1, max_tokens):
        model(input_ids=ids.to(next(model.parameters()).device), **cache_kwargs(model, RecordingCache(on_update)),
              use_cache=True)
    return {k: s[0] / s[1] for k, s in sorted(sums.items())}


def _mean(values) -> float | None:
    """The mean of the measured values; a non-finite measurement is stored as None and left out (None if all are)."""
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None
