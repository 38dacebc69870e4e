"""`TurboQuantConfig`: every knob of the cache in one validated, JSON-serializable dataclass."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from .codebook import check_bits
from .rotation import ROTATION_KINDS

PRESETS: dict[str, tuple[int, int]] = {
    "k8v4": (8, 4),
    "k4v4": (4, 4),
    "k3v4": (3, 4),
    "k3v3": (3, 3),
    "k2v2": (2, 2),
}
DEFAULT_PRESET = "k4v4"
NORM_DTYPES = ("float16", "float32")
CONFIG_VERSION = 1


@dataclass
class TurboQuantConfig:
    """How a TurboQuantCache quantizes.

    key_bits / value_bits: 1..8 bits per rotated coordinate.
    residual_length: newest tokens per layer kept in full precision (0 allowed).
    seed: seeds every layer's rotation (layer i uses seed + i).
    rotation: "auto" (Hadamard for power-of-two head dims, else orthogonal), "hadamard" or "orthogonal".
    norm_dtype: dtype of the per-vector norms, "float16" or "float32".
    skip_first / skip_last / skip_layers: layers kept in full precision (a plain DynamicLayer).
    layer_bits: per-layer {layer_idx: [key_bits, value_bits]} overrides.
    """

    key_bits: int = PRESETS[DEFAULT_PRESET][0]
    value_bits: int = PRESETS[DEFAULT_PRESET][1]
    residual_length: int = 128
    seed: int = 0
    rotation: str = "auto"
    norm_dtype: str = "float16"
    skip_first: int = 0
    skip_last: int = 0
    skip_layers: list[int] = field(default_factory=list)
    layer_bits: dict[int, list[int]] = field(default_factory=dict)

    def __post_init__(self):
        check_bits(self.key_bits, "key_bits")
        check_bits(self.value_bits, "value_bits")
        for name in ("residual_length", "skip_first", "skip_last"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if self.rotation not in ROTATION_KINDS:
            raise ValueError(f"rotation must be one of {ROTATION_KINDS}, got {self.rotation!r}")
        if self.norm_dtype not in NORM_DTYPES:
            raise ValueError(f"norm_dtype must be one of {NORM_DTYPES}, got {self.norm_dtype!r}")
        self.skip_layers = sorted({self._layer_index(i, "skip_layers") for i in self.skip_layers})
        bits = {}
        for k, v in dict(self.layer_bits).items():
            idx = self._layer_index(int(k) if isinstance(k, str) and k.lstrip("-").isdigit() else k, "layer_bits")
            if not isinstance(v, (list, tuple)) or len(v) != 2:
                raise ValueError(f"layer_bits[{idx}] must be [key_bits, value_bits], got {v!r}")
            bits[idx] = [check_bits(v[0], f"layer_bits[{idx}] key bits"), check_bits(v[1], f"layer_bits[{idx}] value bits")]
        self.layer_bits = bits

    @staticmethod
    def _layer_index(i, what: str) -> int:
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise ValueError(f"{what} holds layer indices >= 0, got {i!r}")
        return i

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "TurboQuantConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; presets are {sorted(PRESETS)}")
        k, v = PRESETS[name]
        return cls(key_bits=k, value_bits=v, **overrides)

    @property
    def preset(self) -> str | None:
        for name, kv in PRESETS.items():
            if kv == (self.key_bits, self.value_bits):
                return name
        return None

    def bits_for_layer(self, layer_idx: int, num_layers: int | None = None) -> tuple[int, int] | None:
        """(key_bits, value_bits) for a layer, or None when the layer stays in full precision."""
        if layer_idx in self.skip_layers or layer_idx < self.skip_first:
            return None
        if self.skip_last:
            if num_layers is None:
                raise ValueError("skip_last needs the model's layer count: pass config=model.config to the cache")
            if layer_idx >= num_layers - self.skip_last:
                return None
        kv = self.layer_bits.get(layer_idx)
        return tuple(kv) if kv is not None else (self.key_bits, self.value_bits)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layer_bits"] = {str(k): list(v) for k, v in self.layer_bits.items()}
        return d

    def to_json_string(self) -> str:
        return json.dumps({"tq_hf_cache_config_version": CONFIG_VERSION, **self.to_dict()}, indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TurboQuantConfig":
        d = dict(d)
        version = d.pop("tq_hf_cache_config_version", CONFIG_VERSION)
        if version != CONFIG_VERSION:
            raise ValueError(f"unsupported TurboQuantConfig version {version!r}; this tq_hf_cache reads version {CONFIG_VERSION}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown TurboQuantConfig fields {unknown}; known fields are {sorted(known)}")
        return cls(**d)

    @classmethod
    def from_json_string(cls, s: str) -> "TurboQuantConfig":
        try:
            d = json.loads(s)
        except json.JSONDecodeError as e:
            raise ValueError(f"TurboQuantConfig JSON is corrupt: {e}") from None
        if not isinstance(d, dict):
            raise ValueError(f"TurboQuantConfig JSON must be an object, got {type(d).__name__}")
        return cls.from_dict(d)
