"""`TurboQuantCache`: a `DynamicCache` whose attention layers store TurboQuant-packed keys and values."""

from __future__ import annotations

from functools import lru_cache

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from . import _compat
from .codebook import Codebook, theoretical_codebook
from .config import TurboQuantConfig
from .layer import TurboQuantLayer, TurboQuantSlidingLayer
from .rotation import make_rotation
from .workspace import Workspace

_NORM_DTYPES = {"float16": torch.float16, "float32": torch.float32}


def resolve_config(tq_config=None, **overrides) -> TurboQuantConfig:
    """A TurboQuantConfig from a config, a preset name, a dict or None (the default preset), plus overrides."""
    if tq_config is None:
        base = TurboQuantConfig()
    elif isinstance(tq_config, TurboQuantConfig):
        base = tq_config
    elif isinstance(tq_config, str):
        base = TurboQuantConfig.from_preset(tq_config)
    elif isinstance(tq_config, dict):
        base = TurboQuantConfig.from_dict(tq_config)
    else:
        raise TypeError(
            f"tq_config must be a TurboQuantConfig, a preset name, a dict or None, got {type(tq_config).__name__}"
        )
    if not overrides:
        return base
    return TurboQuantConfig.from_dict({**base.to_dict(), **overrides})


class TurboQuantCache(DynamicCache):
    """Drop-in for `DynamicCache` that keeps the KV history as rotated, Lloyd-Max-quantized, bit-packed codes.

    Args:
        tq_config: a `TurboQuantConfig`, a preset name ("k8v4", "k4v4", "k3v4", "k3v3", "k2v2"), a dict, or None
            for the default preset (k4v4).
        config: the model's config. As for `DynamicCache`, it lets the cache build one layer per layer type
            (sliding-window layers keep their window) and resolves per-layer policies such as `skip_last`.
        codebooks: optional calibrated codebooks, an object with `get(layer_idx, kind, bits) -> Codebook | None`
            where kind is "key" or "value"; layers without one use the theoretical Lloyd-Max codebook.
        **overrides: any `TurboQuantConfig` field, e.g. `residual_length=64`.

    `update` returns full-precision views of a workspace shared by all layers: they are valid until the next
    layer's update, which is how every transformers attention function uses them.
    """

    def __init__(
        self,
        tq_config: TurboQuantConfig | str | dict | None = None,
        config=None,
        *,
        codebooks=None,
        offloading: bool = False,
        offload_only_non_sliding: bool = False,
        **overrides,
    ):
        self.tq_config = resolve_config(tq_config, **overrides)
        self.codebooks = codebooks
        self.workspace = Workspace()
        self.num_model_layers = None
        layers = None
        if config is not None:
            layer_types, layer_kwargs = _compat.layer_types_and_kwargs(config)
            self.num_model_layers = len(layer_types)
            layers = [self._make_layer(i, t, kw) for i, (t, kw) in enumerate(zip(layer_types, layer_kwargs))]
        Cache.__init__(
            self,
            layers=layers,
            layer_class_to_replicate=None if layers else self._next_full_layer,
            offloading=offloading,
            offload_only_non_sliding=offload_only_non_sliding,
        )

    @classmethod
    def from_pretrained(cls, dir_or_model_path, config=None, **overrides) -> "TurboQuantCache":
        """A cache from the `turboquant_config.json` (+ `turboquant_codebooks.safetensors` when present) saved in
        a folder, e.g. next to `model.save_pretrained(dir)`. `config` is the model's config: it is checked against
        the stored model facts (as is `dir/config.json` when present) and passed on to the cache. `overrides`
        change config fields; the calibrated codebooks must still cover every bit width the result needs."""
        import os

        from .calibration import CODEBOOKS_NAME, CalibratedCodebooks
        from .config import read_turboquant_json

        tq = TurboQuantConfig.from_pretrained(dir_or_model_path, config=config)
        codebooks = None
        doc = read_turboquant_json(dir_or_model_path)
        if "codebooks" in doc or os.path.exists(os.path.join(dir_or_model_path, CODEBOOKS_NAME)):
            codebooks = CalibratedCodebooks.from_pretrained(dir_or_model_path, config=config)
        tq = resolve_config(tq, **overrides)
        if codebooks is not None:
            codebooks.check_covers(tq)
        return cls(tq, config=config, codebooks=codebooks)

    def _next_full_layer(self):
        """Called by `Cache.update` to grow a config-less cache: layers are created in index order."""
        return self._make_layer(len(self.layers), "full_attention", {})

    def _make_layer(self, idx: int, layer_type: str, kwargs: dict):
        bits = self.tq_config.bits_for_layer(idx, self.num_model_layers)
        if layer_type == "full_attention":
            return DynamicLayer() if bits is None else self._tq_layer(TurboQuantLayer, idx, bits)
        if layer_type in ("sliding_attention", "chunked_attention"):
            window = int(kwargs["sliding_window"])
            if bits is None or window - 1 <= self.tq_config.residual_length:
                # the whole window fits in the residual: nothing would ever be quantized
                return DynamicSlidingWindowLayer(sliding_window=window)
            return self._tq_layer(TurboQuantSlidingLayer, idx, bits, sliding_window=window)
        return _compat.transformers_layer(layer_type, kwargs, idx)

    def _tq_layer(self, cls, idx: int, bits: tuple[int, int], **extra):
        cfg = self.tq_config
        return cls(
            key_bits=bits[0],
            value_bits=bits[1],
            residual_length=cfg.residual_length,
            rotation_for=lambda dim: _rotation(dim, cfg.seed + idx, cfg.rotation),
            codebook_for=lambda kind, b, dim: self._codebook(idx, kind, b, dim),
            workspace=self.workspace,
            norm_dtype=_NORM_DTYPES[cfg.norm_dtype],
            layer_idx=idx,
            **extra,
        )

    def _codebook(self, idx: int, kind: str, bits: int, dim: int) -> Codebook:
        if self.codebooks is not None:
            cb = self.codebooks.get(idx, kind, bits)
            if cb is not None:
                return cb
        return theoretical_codebook(bits, dim)

    @property
    def quantized_layers(self) -> list[TurboQuantLayer]:
        return [layer for layer in self.layers if isinstance(layer, TurboQuantLayer)]

    def nbytes(self) -> dict[str, int]:
        """Device bytes the cache holds between steps, by kind. `full_precision` counts unquantized layers."""
        out = {"packed": 0, "residual": 0, "full_precision": 0, "workspace": self.workspace.nbytes()}
        for layer in self.layers:
            if isinstance(layer, TurboQuantLayer):
                for k, v in layer.nbytes().items():
                    out[k] += v
            elif getattr(layer, "is_initialized", False) or getattr(layer, "keys", None) is not None:
                for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                    if isinstance(t, torch.Tensor):
                        out["full_precision"] += t.numel() * t.element_size()
        out["total"] = sum(out.values())
        return out

    def reset(self):
        super().reset()
        self.workspace.clear()

    def __repr__(self) -> str:
        return f"TurboQuantCache(k{self.tq_config.key_bits}v{self.tq_config.value_bits}, layers={self.layers})"


@lru_cache(maxsize=None)
def _rotation(dim: int, seed: int, kind: str):
    return make_rotation(dim, seed, kind)
