"""`TurboQuantConfig`: every knob of the cache in one validated, JSON-serializable dataclass."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from .calibrate import codebooks_file
from ._io import parse_json, write_text
from .quant.codebook import check_bits
from .config_file import (  # noqa: F401  (the document's names, where users and modules import them)
    TURBOQUANT_CONFIG_NAME, TURBOQUANT_FORMAT, TURBOQUANT_FORMAT_VERSION, MODEL_FACT_KEYS, model_facts, DOC_DIGEST, doc_digest, check_doc_digest, read_format_json, read_turboquant_json, fact_mismatch, check_model_facts,
)
from .quant.rotation import ROTATION_KINDS

SPEC_KEYS = ("bits", "sizes", "order")  # a layer's key split (`key_split`): its fields
MIN_PART = 3  # channels of a key-split part: `theoretical_codebook` needs 3 or more dimensions


def check_spec(spec, layer: int) -> dict:
    """A layer's split spec {"bits": [b0, b1, ...], "sizes": [n0, n1, ...], "order": [[channels] per KV head]},
    checked: part p takes channels order[n0 + ... + n(p-1) : ... + np] of each head at b_p bits. Raises naming the
    layer and the bad value; the head count and head dim are checked by `make_split`."""
    if not isinstance(spec, dict) or set(spec) != set(SPEC_KEYS):
        raise ValueError(f"key_split[{layer}] must be {{'bits': [...], 'sizes': [...], 'order': [[...], ...]}}, "
                         f"got {spec!r}")
    bits, sizes, order = spec["bits"], spec["sizes"], spec["order"]
    if not isinstance(bits, (list, tuple)) or not isinstance(sizes, (list, tuple)) or not 2 <= len(bits) == len(sizes):
        raise ValueError(f"key_split[{layer}] needs 'bits' and 'sizes' lists of one entry per part, at least 2 parts; "
                         f"got bits={bits!r}, sizes={sizes!r}")
    bits = [check_bits(b, f"key_split[{layer}] bits of part {p}") for p, b in enumerate(bits)]
    for p, n in enumerate(sizes):
        if isinstance(n, bool) or not isinstance(n, int) or n < MIN_PART:
            raise ValueError(f"key_split[{layer}] part {p} holds {n!r} channels; a part must hold an integer >= "
                             f"{MIN_PART} of them (each part is its own TurboQuant vector, whose codebook needs "
                             f"{MIN_PART} or more dimensions) and the parts must sum to the head dim")
    d = sum(sizes)
    if not isinstance(order, (list, tuple)) or not order:
        raise ValueError(f"key_split[{layer}]['order'] must be a non-empty list (one channel order per KV head), "
                         f"got {order!r}")
    for h, row in enumerate(order):
        if not isinstance(row, (list, tuple)) or len(row) != d or sorted(row) != list(range(d)):
            raise ValueError(f"key_split[{layer}] KV head {h}: the order must be a permutation of the channels "
                             f"0..{d - 1} (sizes {list(sizes)} sum to {d}), got {row!r}")
    return {"bits": bits, "sizes": list(sizes), "order": [list(row) for row in order]}



# (key bits, value bits). Keys carry the quantization loss (4-bit values cost nothing measurable, 4-bit keys cost
# most of k4v4's perplexity: eval_findings.md in benchmarks/results/archive/ at commit a573dec), so the default spends the 4 bits per coordinate of
# k4v4 as 5 on keys and 3 on values: the same bytes per token; k4v2 does the same at 3 bits.
PRESETS: dict[str, tuple[int, int]] = {
    "k8v4": (8, 4),
    "k5v3": (5, 3),
    "k4v4": (4, 4),
    "k3v4": (3, 4),
    "k4v2": (4, 2),
    "k4v2-pairs": (4, 2),
    "k3v3": (3, 3),
    "k2v2": (2, 2),
}
# fields a preset sets beyond its bits. k4v2-pairs: k4v2's bytes with 2-D codebooks on pairs of rotated coordinates
# (`pair_codebook`), norm correction and key centring: no calibration (docs/quality.md)
PRESET_OPTIONS: dict[str, dict[str, Any]] = {
    "k4v2-pairs": {"codes": "pair", "norm_correction": True, "key_centering": True},
}
DEFAULT_PRESET = "k5v3"
CODES = ("scalar", "pair")
NORM_DTYPES = ("float16", "float32")
# version 3 files hold every field; version 2 files (before pair codes) may lack codes and norm_correction, version 1
# files (before key centring and split keys) those and key_centering and key_split too; a missing field reads as off
CONFIG_VERSION = 3
READABLE_CONFIG_VERSIONS = (1, 2, 3)
_FIELDS_AFTER_VERSION_2 = ("codes", "norm_correction")
_FIELDS_AFTER_VERSION_1 = ("key_centering", "key_split", *_FIELDS_AFTER_VERSION_2)
# layer i uses rotation seed `seed + i`, stored as int64 beside calibrated codebooks: room for 2**31 layers
MAX_SEED = 2**63 - 2**31
# the residual window holds at most this many tokens per layer (its buffer grows with the sequence)
MAX_RESIDUAL_LENGTH = 2**31 - 1
MAX_SINK_TOKENS = 2**16


@dataclass
class TurboQuantConfig:
    """How a TurboQuantCache quantizes.

    key_bits / value_bits: 1..8 bits per rotated coordinate.
    residual_length: newest tokens per layer kept in full precision (0 allowed).
    sink_tokens: the sequence's first tokens, of which full-attention layers keep exact copies (attention sinks;
        0 turns it off).
    seed: seeds every layer's rotation (layer i uses seed + i).
    rotation: "auto" (Hadamard for power-of-two head dims, else orthogonal), "hadamard" or "orthogonal".
    norm_dtype: dtype of the per-vector norms, "float16" or "float32".
    skip_first / skip_last / skip_layers: layers kept in full precision (a plain DynamicLayer).
    skip_layer_types: layer types kept in full precision, e.g. ["sliding_attention"].
    layer_bits: per-layer {layer_idx: [key_bits, value_bits]} overrides.
    key_centering: quantize each key minus R(t) mu, its layer's pre-RoPE mean rotated to its position (mu per batch
        row and KV head, from the first tokens the layer quantizes), and add it back on every read. Needs the
        model's RoPE (`config=` of a transformers model with rotary embeddings); `TurboQuantCache` only.
    key_split: per-layer {layer_idx: {"bits": [b0, b1, ...], "sizes": [n0, n1, ...], "order": [[channels] per KV
        head]}}: the layer's keys are TurboQuant vectors of parts of their channels, part p the next n_p channels of
        the order at b_p bits (`key_split`; `calibrate_key_split` orders the channels). It replaces the layer's key
        bits.
    codes: "scalar" (a Lloyd-Max codebook per coordinate) or "pair" (a 2-D codebook of 4**bits points on each pair
        of rotated coordinates: lower error at the same bytes; bits 1..4, an even head dim, no calibrated codebooks
        or key split).
    norm_correction: store each vector's norm divided by the length of its decoded unit vector, so that decoded
        vectors keep their length (no bytes; the quantize step does one more lookup).

    Example:
        TurboQuantConfig.from_preset("k4v2-pairs")  # 3 bits a coordinate, no calibration
        TurboQuantConfig(key_bits=4, value_bits=2, codes="pair", norm_correction=True)
    """

    key_bits: int = PRESETS[DEFAULT_PRESET][0]
    value_bits: int = PRESETS[DEFAULT_PRESET][1]
    residual_length: int = 128
    sink_tokens: int = 4
    seed: int = 0
    rotation: str = "auto"
    norm_dtype: str = "float16"
    skip_first: int = 0
    skip_last: int = 0
    skip_layers: list[int] = field(default_factory=list)
    skip_layer_types: list[str] = field(default_factory=list)
    layer_bits: dict[int, list[int]] = field(default_factory=dict)
    key_centering: bool = False
    key_split: dict[int, dict] = field(default_factory=dict)
    codes: str = "scalar"
    norm_correction: bool = False

    def __post_init__(self):
        for name in ("key_centering", "norm_correction"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.codes not in CODES:
            raise ValueError(f"codes must be one of {CODES}, got {self.codes!r}")
        check_bits(self.key_bits, "key_bits")
        check_bits(self.value_bits, "value_bits")
        limits = {"residual_length": MAX_RESIDUAL_LENGTH, "sink_tokens": MAX_SINK_TOKENS,
                  "skip_first": None, "skip_last": None}
        for name, top in limits.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0 or (top is not None and v > top):
                allowed = f"in [0, {top}]" if top is not None else ">= 0"
                raise ValueError(f"{name} must be an integer {allowed}, got {v!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be an integer in [0, 2**63 - 2**31] (layer i uses seed + i), got {self.seed!r}")
        if self.rotation not in ROTATION_KINDS:
            raise ValueError(f"rotation must be one of {ROTATION_KINDS}, got {self.rotation!r}")
        if self.norm_dtype not in NORM_DTYPES:
            raise ValueError(f"norm_dtype must be one of {NORM_DTYPES}, got {self.norm_dtype!r}")
        skip_layers = _sequence(self.skip_layers, "skip_layers", "layer indices, e.g. [0, 5]")
        self.skip_layers = sorted({self._layer_index(i, "skip_layers") for i in skip_layers})
        types = _sequence(self.skip_layer_types, "skip_layer_types", "layer type names, e.g. ['sliding_attention']")
        if not all(isinstance(t, str) and t for t in types):
            raise ValueError(f"skip_layer_types holds layer type names such as 'sliding_attention', got {self.skip_layer_types!r}")
        self.skip_layer_types = sorted(set(types))
        self.layer_bits = self._layer_dict(self.layer_bits, "layer_bits", "{layer_idx: [key_bits, value_bits]}",
                                           _check_layer_bits)
        self.key_split = self._layer_dict(self.key_split, "key_split",
                                          '{layer_idx: {"bits": [...], "sizes": [...], "order": [...]}}', check_spec)
        if self.codes == "pair":
            _check_pair_codes(self)
        if self.rotation == "hadamard":
            for i, spec in self.key_split.items():
                bad = [n for n in spec["sizes"] if n & (n - 1)]
                if bad:
                    raise ValueError(f"key_split[{i}] has parts of {bad} channels, but rotation='hadamard' needs "
                                     "power-of-two part sizes; use rotation='auto' or 'orthogonal', or sizes such as "
                                     "16, 16, 32")

    @property
    def bits_per_coordinate(self) -> float:
        """Code bits a stored coordinate, keys and values alike, at the config's own bits (layer_bits and key_split
        aside): no norms, nothing kept exact (`bytes_per_token`)."""
        return (self.key_bits + self.value_bits) / 2

    def bytes_per_token(self, kv_heads: int, head_dim: int, length: int, layer_idx: int | None = None,
                        num_layers: int | None = None, dtype_bytes: int = 2) -> float:
        """Bytes a full-attention layer (`layer_idx`, else one at the config's own bits) holds per token, averaged
        over a sequence of `length` tokens: codes and norms of the quantized tokens, plus the exact sinks and window
        (`dtype_bytes` a value) spread over the length.

        Example:
            TurboQuantConfig.from_preset("k4v2-pairs").bytes_per_token(8, 128, 32768)  # Llama-3.1-8B: 813 (bf16: 4096)
        """
        return _bytes_per_token(self, kv_heads, head_dim, length, layer_idx, num_layers, dtype_bytes)

    def _layer_dict(self, value, what: str, shape: str, check) -> dict:
        """{layer index: check(v, index)} from a dict keyed by layer indices (ints, or digit strings from JSON)."""
        if not isinstance(value, dict):
            raise TypeError(f"{what} must be a dict {shape}, got {type(value).__name__}")
        out = {}
        for k, v in value.items():
            if isinstance(k, str):
                if not k.isdigit():
                    raise ValueError(f"{what} holds layer indices >= 0 as keys, got {k!r}")
                idx = int(k)
            else:
                idx = self._layer_index(k, what)
            if idx in out:
                raise ValueError(f"{what} names layer {idx} twice (keys {k!r} and an earlier one)")
            out[idx] = check(v, idx)
        return out

    def check_layers(self, num_layers: int) -> None:
        """Refuse per-layer settings that name layers a model of `num_layers` layers does not have."""
        named = {"skip_layers": self.skip_layers, "layer_bits": sorted(self.layer_bits),
                 "key_split": sorted(self.key_split)}
        for what, idx in named.items():
            bad = [i for i in idx if i >= num_layers]
            if bad:
                raise ValueError(f"{what} names layers {bad}, but the model has {num_layers} layers (0..{num_layers - 1})")
        for what in ("skip_first", "skip_last"):
            if getattr(self, what) > num_layers:
                raise ValueError(f"{what}={getattr(self, what)} is more than the model's {num_layers} layers")

    def check_model_facts(self, facts: dict[str, Any] | None) -> None:
        """Refuse per-layer settings that cannot fit a model of these facts (`model_facts`): layers it lacks, and
        key splits whose parts do not hold its head dim or whose channel orders are not one per KV head."""
        if facts is None:
            return
        self.check_layers(facts["num_hidden_layers"])
        d, heads = facts["head_dim"], facts["num_key_value_heads"]
        for i, spec in self.key_split.items():
            if sum(spec["sizes"]) != d:
                raise ValueError(f"key_split[{i}] parts of sizes {spec['sizes']} hold {sum(spec['sizes'])} channels, "
                                 f"but the model's head dim is {d}: the sizes must sum to {d}")
            if len(spec["order"]) != heads:
                raise ValueError(f"key_split[{i}] gives channel orders for {len(spec['order'])} KV heads, but the "
                                 f"model has {heads} KV heads")

    @staticmethod
    def _layer_index(i, what: str) -> int:
        """A layer index >= 0 (raises naming the field otherwise)."""
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise ValueError(f"{what} holds layer indices >= 0, got {i!r}")
        return i

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "TurboQuantConfig":
        """The preset's bits plus `overrides` (any field, the bits too, as `TurboQuantCache(name, **overrides)`)."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; presets are {sorted(PRESETS)}")
        k, v = PRESETS[name]
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown TurboQuantConfig fields {unknown}; known fields are {sorted(known)}")
        return cls(**{"key_bits": k, "value_bits": v, **PRESET_OPTIONS.get(name, {}), **overrides})

    @property
    def preset(self) -> str | None:
        """The preset whose bits and options this config has (other fields aside), or None."""
        plain = {"codes": "scalar", "norm_correction": False, "key_centering": False}
        for name, kv in PRESETS.items():
            options = {**plain, **PRESET_OPTIONS.get(name, {})}
            if kv == (self.key_bits, self.value_bits) and all(getattr(self, f) == v for f, v in options.items()):
                return name
        return None

    def bits_for_layer(
        self, layer_idx: int, num_layers: int | None = None, layer_type: str | None = None
    ) -> tuple[int, int] | None:
        """(key_bits, value_bits) for a layer, or None when the layer stays in full precision."""
        if layer_idx in self.skip_layers or layer_idx < self.skip_first or layer_type in self.skip_layer_types:
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
        d["key_split"] = {str(k): {"bits": list(v["bits"]), "sizes": list(v["sizes"]),
                                   "order": [list(c) for c in v["order"]]} for k, v in self.key_split.items()}
        return d

    def to_json_string(self) -> str:
        return json.dumps({"tq_hf_cache_config_version": CONFIG_VERSION, **self.to_dict()}, indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TurboQuantConfig":
        d = dict(d)
        version = d.pop("tq_hf_cache_config_version", CONFIG_VERSION)
        if isinstance(version, bool) or version not in READABLE_CONFIG_VERSIONS:
            raise ValueError(f"unsupported TurboQuantConfig version {version!r}; this tq_hf_cache reads versions "
                             f"{list(READABLE_CONFIG_VERSIONS)}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown TurboQuantConfig fields {unknown}; known fields are {sorted(known)}")
        return cls(**d)

    @classmethod
    def from_json_string(cls, s: str) -> "TurboQuantConfig":
        d = parse_json(s, "TurboQuantConfig JSON")
        if not isinstance(d, dict):
            raise ValueError(f"TurboQuantConfig JSON must be an object, got {type(d).__name__}")
        return cls.from_dict(d)

    # ---- save / load next to a model checkpoint -------------------------------------------------------------

    def save_pretrained(self, save_directory, model_config=None, extra: dict[str, Any] | None = None) -> str:
        """Write `turboquant_config.json` into `save_directory` (created if needed); returns its path.

        The file holds the format version, this config and, when `model_config` (a transformers config) is given,
        the model facts that calibrated codebooks depend on (model_type, layer count, KV heads, head dim).
        `extra` adds top-level sections (the codebook index written by `CalibratedCodebooks`).
        """
        import os

        doc: dict[str, Any] = {
            "format": TURBOQUANT_FORMAT,
            "format_version": TURBOQUANT_FORMAT_VERSION,
            "tq_config": json.loads(self.to_json_string()),
        }
        if DOC_DIGEST in (extra or {}):
            raise ValueError(f"extra section {DOC_DIGEST!r} is reserved for the file's digest")
        if model_config is not None:
            doc["model"] = model_facts(model_config)
            self.check_model_facts(doc["model"])
        if "codebooks" not in (extra or {}):
            doc.update(_kept_codebooks(self, save_directory, doc.get("model")))
        os.makedirs(save_directory, exist_ok=True)
        for key, value in (extra or {}).items():
            if key in doc:
                raise ValueError(f"extra section {key!r} would overwrite a reserved key of {TURBOQUANT_CONFIG_NAME}")
            doc[key] = value
        doc[DOC_DIGEST] = doc_digest(doc)
        path = os.path.join(save_directory, TURBOQUANT_CONFIG_NAME)
        return write_text(path, json.dumps(doc, indent=2, sort_keys=True) + "\n")

    @classmethod
    def from_pretrained(cls, directory, config=None) -> "TurboQuantConfig":
        """Read `directory/turboquant_config.json`; check the stored model facts against `config` (a
        transformers config) when given and against `directory/config.json` when present."""
        import os

        doc = read_turboquant_json(directory)
        check_model_facts(doc, directory, config)
        cfg = cls.from_file_doc(doc, directory)
        index = doc.get("codebooks")
        name = index.get("file", "turboquant_codebooks.safetensors") if isinstance(index, dict) else None
        if isinstance(name, str) and not os.path.isfile(os.path.join(directory, name)):
            raise FileNotFoundError(f"calibrated codebooks file {os.path.join(directory, name)!r} is missing (listed in "
                                    f"{TURBOQUANT_CONFIG_NAME}): restore it, or save the config without codebooks")
        return cfg

    @classmethod
    def from_file_doc(cls, doc: dict[str, Any], directory, check_digest: bool = True) -> "TurboQuantConfig":
        """The config of a read `turboquant_config.json` (see `read_turboquant_json`), checked against its stored
        model facts. save_pretrained writes every field, so a missing one means the file was cut or edited: it is
        refused rather than read as its default."""
        import os

        where = os.path.join(directory, TURBOQUANT_CONFIG_NAME)
        d = doc["tq_config"]
        try:
            cfg = cls.from_dict(d)
            cfg.check_model_facts(doc.get("model"))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: tq_config: {e}") from None
        version = d.get("tq_hf_cache_config_version")
        optional = {1: _FIELDS_AFTER_VERSION_1, 2: _FIELDS_AFTER_VERSION_2}.get(version, ())
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in d and f.name not in optional]
        if version is None:
            missing.insert(0, "tq_hf_cache_config_version")
        if missing:
            raise ValueError(f"{where}: tq_config lacks the fields {missing} (save_pretrained writes every field)")
        if check_digest:
            try:
                check_doc_digest(doc, where)
            except ValueError:
                if "codebooks" in doc:  # name a bad codebook field, when there is one, before the digest
                    codebooks_file.read(directory, doc, cfg.seed)
                raise
        return cfg


def _kept_codebooks(cfg: "TurboQuantConfig", directory, model: dict | None) -> dict[str, Any]:
    """The calibrated-codebook sections of a folder's existing config file, kept when this config can use
    them (so saving a config never orphans the codebooks file); raises when it cannot."""
    import os

    if not os.path.isfile(os.path.join(directory, TURBOQUANT_CONFIG_NAME)):
        return {}
    try:
        old = read_turboquant_json(directory)
    except ValueError as e:
        raise ValueError(f"not overwriting {TURBOQUANT_CONFIG_NAME} in {directory!r}, which cannot be read: {e}") from None
    if "codebooks" not in old:
        return {}
    where = os.path.join(directory, TURBOQUANT_CONFIG_NAME)
    try:
        check_model_facts(old, directory)
        calibrated = TurboQuantConfig.from_file_doc(old, directory, check_digest=False)
        entries, _, _ = codebooks_file.read(directory, old, calibrated.seed)
        if model is not None and model != old.get("model"):
            raise ValueError(f"the codebooks were calibrated for {old.get('model')}, this model is {model}")
        codebooks_file.check_rotation(calibrated.seed, calibrated.rotation, cfg)
        codebooks_file.check_covers(entries, old["model"]["num_hidden_layers"], cfg)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"{where} indexes calibrated codebooks that this config cannot use ({e}); saving it here would orphan "
            "them. Save into another folder, or recalibrate with this config."
        ) from None
    return {"model": old["model"], "codebooks": old["codebooks"]}


def _check_pair_codes(cfg: "TurboQuantConfig") -> None:
    """Pair codes take 1..4 bits a coordinate (4**bits points a pair) and no key split."""
    from .quant.pair_codebook import check_pair_bits

    check_pair_bits(cfg.key_bits, "key_bits (codes='pair')")
    check_pair_bits(cfg.value_bits, "value_bits (codes='pair')")
    for i, (kb, vb) in cfg.layer_bits.items():
        check_pair_bits(kb, f"layer_bits[{i}] key bits (codes='pair')")
        check_pair_bits(vb, f"layer_bits[{i}] value bits (codes='pair')")
    if cfg.key_split:
        raise ValueError(f"key_split (layers {sorted(cfg.key_split)}) takes scalar codes; codes='pair' splits no "
                         "keys: drop key_split or use codes='scalar'")


def _bytes_per_token(cfg: "TurboQuantConfig", kv_heads: int, head_dim: int, length: int, layer_idx, num_layers,
                     dtype_bytes: int) -> float:
    """`TurboQuantConfig.bytes_per_token`."""
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"length must be an integer >= 1, got {length!r}")
    bits = (cfg.key_bits, cfg.value_bits) if layer_idx is None else cfg.bits_for_layer(layer_idx, num_layers)
    exact_token = 2 * kv_heads * head_dim * dtype_bytes
    if bits is None:
        return float(exact_token)
    norm = 2 if cfg.norm_dtype == "float16" else 4
    spec = cfg.key_split.get(layer_idx) if layer_idx is not None else None
    if spec is not None:
        keys = sum((n * b + 7) // 8 + norm for n, b in zip(spec["sizes"], spec["bits"]))
    else:
        keys = (head_dim * bits[0] + 7) // 8 + norm
    code_token = kv_heads * (keys + (head_dim * bits[1] + 7) // 8 + norm)
    exact = min(length, cfg.residual_length + cfg.sink_tokens)
    return (exact * exact_token + (length - exact) * code_token) / length


def _check_layer_bits(v, idx: int) -> list[int]:
    if not isinstance(v, (list, tuple)) or len(v) != 2:
        raise ValueError(f"layer_bits[{idx}] must be [key_bits, value_bits], got {v!r}")
    return [check_bits(v[0], f"layer_bits[{idx}] key bits"), check_bits(v[1], f"layer_bits[{idx}] value bits")]


def _sequence(value, what: str, example: str) -> list:
    """A list from a list, tuple or set; a string or a scalar is refused (a string would be split into letters)."""
    if isinstance(value, str) or not isinstance(value, (list, tuple, set, frozenset)):
        hint = f"; did you mean [{value!r}]?" if isinstance(value, (str, int)) and not isinstance(value, bool) else ""
        raise TypeError(f"{what} must be a list of {example}, got {value!r}{hint}")
    return list(value)
