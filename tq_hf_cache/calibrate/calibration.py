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

from ..quant.codebook import Codebook, check_bits, theoretical_codebook
from . import codebooks_file
from .codebooks_file import CODEBOOKS_FORMAT_VERSION, CODEBOOKS_NAME, KINDS  # noqa: F401  (imported from here too)
from ..config import TURBOQUANT_CONFIG_NAME, TurboQuantConfig, check_doc_digest, check_model_facts, fact_mismatch, model_facts, read_turboquant_json
from .._compat import cache_kwargs
from .._io import safetensors_bytes, sha256_bytes, write_bytes
from ..quant.rotation import make_rotation

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
        return codebooks_file.entry_bits(self.entries)

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
            tensors[codebooks_file.tensor_name(layer, kind, bits)] = cb.centroids.detach().float().cpu().contiguous()
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
                                                    "index_sha256": codebooks_file.index_digest(model, index)})
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
        model, _ = codebooks_file.sections(doc, directory)
        tq = TurboQuantConfig.from_file_doc(doc, directory, check_digest=False)
        entries, codebooks, info = codebooks_file.read(directory, doc, tq.seed)
        return cls(tq, dict(model), codebooks, entries, info)

    def check_rotation(self, tq_config: TurboQuantConfig) -> None:
        """Raise unless `tq_config` rotates as the calibration did."""
        codebooks_file.check_rotation(self.config.seed, self.config.rotation, tq_config)

    def check_covers(self, tq_config: TurboQuantConfig) -> None:
        """Raise unless `tq_config` rotates as calibrated and every quantized layer's (kind, bits) under it has a
        calibrated entry."""
        self.check_rotation(tq_config)
        codebooks_file.check_covers(self.entries, self.model["num_hidden_layers"], tq_config)


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
    from ..quant.reference import dequantize, quantize

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
