"""The caches the quality evaluation compares, how to build them, and how many bytes they hold.

A `CacheSpec` names one cache: the full-precision `DynamicCache` ("fp"), a TurboQuant preset ("k4v4", ...)
or transformers' `QuantizedCache` with the optimum-quanto or HQQ backend ("quanto-int4", "hqq-int2", ...).
Backends that are not installed, or cannot run here, are reported as unavailable with the reason instead of
being silently dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ...config import PRESETS
from ...quant.packing import packed_bytes

# QuantizedCache defaults, spelled out so the byte formula and the cache agree
QUANTIZED_CACHE_GROUP = 64
QUANTIZED_CACHE_RESIDUAL = 128


@dataclass(frozen=True)
class CacheSpec:
    """One cache of the comparison. family: "fp", "turboquant", "quanto" or "hqq"."""

    name: str
    family: str
    key_bits: int = 16
    value_bits: int = 16
    overrides: dict = field(default_factory=dict, hash=False, compare=False)

    def make(self, model_config):
        """A fresh, empty cache for a model with `model_config`."""
        if self.family == "fp":
            from transformers import DynamicCache

            return DynamicCache(config=model_config)
        if self.family == "turboquant":
            from ...hf.cache import TurboQuantCache

            if "config_dir" in self.overrides:
                return TurboQuantCache.from_pretrained(self.overrides["config_dir"], config=model_config)
            return TurboQuantCache(self.overrides.get("preset", self.name), config=model_config,
                                   **{k: v for k, v in self.overrides.items() if k != "preset"})
        if self.family in ("quanto", "hqq"):
            from transformers import QuantizedCache

            axis = self.overrides.get("axis")  # None: transformers' default (0)
            return QuantizedCache(
                backend=self.family,
                config=model_config,
                nbits=self.key_bits,
                axis_key=axis,
                axis_value=axis,
                q_group_size=QUANTIZED_CACHE_GROUP,
                residual_length=QUANTIZED_CACHE_RESIDUAL,
            )
        raise ValueError(f"unknown cache family {self.family!r}")

    @property
    def residual_length(self) -> int:
        if self.family == "turboquant":
            return int(self.overrides.get("residual_length", 128))
        if self.family in ("quanto", "hqq"):
            return QUANTIZED_CACHE_RESIDUAL
        return 0

    def formula_bytes_per_token_layer(self, kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> float:
        """Asymptotic bytes one token costs in one full-attention layer (keys + values, all KV heads), for a
        model whose activations are `dtype_bytes` wide, ignoring the full-precision residual window.

        fp: 2 * H * D * dtype_bytes.
        turboquant: H * (ceil(D*kb/8) + norm + ceil(D*vb/8) + norm), norm = 2 bytes (float16) or 4 (float32);
        split keys cost sum over parts of (ceil(n*b/8) + norm).
        quanto / hqq (QuantizedCache, axis 0, group 64): H * 2 * (D*b/8 + ceil(D/64) * 2 * dtype_bytes), one
        scale and one zero-point per group of 64 in the model dtype.
        """
        h, d = kv_heads, head_dim
        if self.family == "fp":
            return 2 * h * d * dtype_bytes
        if self.family == "turboquant":
            norm = 4 if self.overrides.get("norm_dtype") == "float32" else 2
            per_layer = self.overrides.get("layer_bits") or {}
            split = self.overrides.get("key_split_parts") or {}  # {layer: [[channels, bits], ...]}
            layers = sorted(set(per_layer) | set(split))
            if not layers:
                return h * (packed_bytes(d, self.key_bits) + norm + packed_bytes(d, self.value_bits) + norm)
            total = 0  # a per-layer allocation or split keys: the mean over the layers they name
            for i in layers:
                kb, vb = per_layer.get(i, (self.key_bits, self.value_bits))
                keys = sum(packed_bytes(n, b) + norm for n, b in split[i]) if i in split else packed_bytes(d, kb) + norm
                total += keys + packed_bytes(d, vb) + norm
            return h * total / len(layers)
        if self.family in ("quanto", "hqq"):
            groups = math.ceil(d / QUANTIZED_CACHE_GROUP)
            return h * 2 * (d * self.key_bits / 8 + groups * 2 * dtype_bytes)
        raise ValueError(self.family)

    def to_dict(self) -> dict:
        return {"name": self.name, "family": self.family, "key_bits": self.key_bits, "value_bits": self.value_bits,
                "residual_length": self.residual_length, "overrides": dict(self.overrides)}


def turboquant_spec(preset: str, **overrides) -> CacheSpec:
    k, v = PRESETS[preset]
    name = preset if not overrides else preset + "-" + "-".join(f"{a}{b}" for a, b in sorted(overrides.items()))
    return CacheSpec(name, "turboquant", k, v, {"preset": preset, **overrides})


def folder_spec(path: str) -> CacheSpec:
    """The cache a folder's turboquant_config.json describes (e.g. a `tq-hf-cache allocate` result), named by the
    folder; its bytes formula averages the folder's per-layer bits."""
    import os

    from ...config import TurboQuantConfig

    cfg = TurboQuantConfig.from_pretrained(path)
    over = {"config_dir": path, "residual_length": cfg.residual_length, "norm_dtype": cfg.norm_dtype}
    if cfg.layer_bits:
        over["layer_bits"] = {int(i): list(v) for i, v in cfg.layer_bits.items()}
    if cfg.key_centering:
        over["key_centering"] = True
    if cfg.key_split:
        over["key_split_parts"] = {i: [[n, b] for n, b in zip(v["sizes"], v["bits"])] for i, v in cfg.key_split.items()}
    return CacheSpec(os.path.basename(os.path.normpath(path)), "turboquant", cfg.key_bits, cfg.value_bits, over)


def all_specs() -> dict[str, CacheSpec]:
    """Every cache the CLI knows, by name."""
    specs = {"fp": CacheSpec("fp", "fp")}
    for p in PRESETS:
        specs[p] = turboquant_spec(p)
    specs["k4v4-r0"] = CacheSpec("k4v4-r0", "turboquant", 4, 4, {"preset": "k4v4", "residual_length": 0})
    # rotation / seed sensitivity (eval_findings.md in benchmarks/results/archive/ at commit a573dec)
    for p in ("k4v4", "k3v3"):
        specs[f"{p}-orthogonal"] = CacheSpec(f"{p}-orthogonal", "turboquant", *PRESETS[p], {"preset": p, "rotation": "orthogonal"})
    specs["k4v4-seed1"] = CacheSpec("k4v4-seed1", "turboquant", 4, 4, {"preset": "k4v4", "seed": 1})
    for b in (2, 4):
        for backend in ("quanto", "hqq"):
            specs[f"{backend}-int{b}"] = CacheSpec(f"{backend}-int{b}", backend, b, b)
    for b in (2, 4):
        # HQQ's default axis 0 groups 64 elements strided across tokens and channels of the flattened states;
        # axis 1 groups the 64 coordinates of one head vector (the layout quanto's axis 0 has)
        specs[f"hqq-int{b}-axis1"] = CacheSpec(f"hqq-int{b}-axis1", "hqq", b, b, {"axis": 1})
    return specs


DEFAULT_CACHES = ["fp", *PRESETS, "quanto-int4", "quanto-int2", "hqq-int4", "hqq-int2"]


def backend_status(family: str) -> tuple[bool, str]:
    """(available, reason): whether QuantizedCache with this backend builds and round-trips a tensor here."""
    if family in ("fp", "turboquant"):
        return True, ""
    from transformers import LlamaConfig, QuantizedCache

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=1, num_key_value_heads=1, head_dim=64, num_hidden_layers=1,
                      intermediate_size=64, vocab_size=8)
    try:
        cache = QuantizedCache(backend=family, config=cfg, nbits=4, q_group_size=64, residual_length=1)
        x = torch.randn(1, 1, 4, 64)
        cache.update(x, x.clone(), 0)
        k, _ = cache.update(x[:, :, :1], x[:, :, :1].clone(), 0)
        if k.shape[2] != 5 or not torch.isfinite(k).all():
            return False, f"{family} round trip returned shape {tuple(k.shape)}"
    except Exception as e:  # ImportError when not installed, RuntimeError when no CPU kernel, ...
        return False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    return True, ""


# --- bytes actually held ---------------------------------------------------------------------------------

def _tensor_bytes(obj, seen: set) -> int:
    """Bytes of the storages behind `obj` (tensors, tensor subclasses, tuples, lists, dicts), each storage once."""
    if isinstance(obj, torch.Tensor):
        flatten = getattr(type(obj), "__tensor_flatten__", None)
        if flatten is not None and type(obj) not in (torch.Tensor, torch.nn.Parameter):
            names, _ = obj.__tensor_flatten__()
            return sum(_tensor_bytes(getattr(obj, n), seen) for n in names)
        if obj.numel() == 0:
            return 0
        st = obj.untyped_storage()
        key = (st.data_ptr(), obj.device)
        if key in seen:
            return 0
        seen.add(key)
        return st.nbytes()
    if isinstance(obj, (tuple, list)):
        return sum(_tensor_bytes(o, seen) for o in obj)
    if isinstance(obj, dict):
        return sum(_tensor_bytes(o, seen) for o in obj.values())
    return 0


def layer_bytes(layer) -> int:
    """Bytes one cache layer holds between steps (allocated capacity, residual window included)."""
    nbytes = getattr(layer, "nbytes", None)
    if callable(nbytes):  # TurboQuantLayer: packed buffers (capacity) + residual window
        return int(sum(nbytes().values()))
    seen: set = set()
    total = 0
    for name, value in vars(layer).items():
        if name in ("keys", "values", "_quantized_keys", "_quantized_values") or isinstance(value, (torch.Tensor, tuple, dict)):
            total += _tensor_bytes(value, seen)
    # DynamicLayer stores keys/values as plain attributes; QuantizedLayer adds _quantized_keys/_quantized_values
    return total


def cache_bytes(cache) -> dict:
    """{"per_layer": [...], "total": int, "workspace": int}: what the cache holds, measured on its tensors."""
    per_layer = [layer_bytes(layer) for layer in cache.layers]
    ws = getattr(cache, "workspace", None)
    return {"per_layer": per_layer, "total": int(sum(per_layer)),
            "workspace": int(ws.nbytes()) if ws is not None else 0}


def measure_bytes_synthetic(spec: CacheSpec, model_config, tokens: int, dtype=torch.float16, seed: int = 0) -> dict:
    """Fill a fresh cache with `tokens` random KV states of the model's shapes in `dtype` (one prefill, then one
    decode token, as in generation) and measure what it holds. No model forward: a deployment-dtype count."""
    from ..._compat import layer_types_and_kwargs

    text_cfg = model_config.get_text_config(decoder=True) if hasattr(model_config, "get_text_config") else model_config
    h = text_cfg.num_key_value_heads
    d = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // text_cfg.num_attention_heads
    n_layers = len(layer_types_and_kwargs(model_config)[0])
    g = torch.Generator().manual_seed(seed)
    cache = spec.make(model_config)
    with torch.inference_mode():
        for i in range(n_layers):
            k = torch.randn(1, h, tokens - 1, d, generator=g).to(dtype)
            cache.update(k, k.clone(), i)
        for i in range(n_layers):
            k = torch.randn(1, h, 1, d, generator=g).to(dtype)
            cache.update(k, k.clone(), i)
    b = cache_bytes(cache)
    b["tokens"] = tokens
    b["dtype"] = str(dtype).replace("torch.", "")
    return b
