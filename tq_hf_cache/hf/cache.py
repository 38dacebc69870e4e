"""`TurboQuantCache`: a `DynamicCache` whose attention layers store TurboQuant-packed keys and values."""

from __future__ import annotations

from functools import lru_cache, partial

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from .. import _compat
from ..quant.codebook import Codebook, theoretical_codebook
from ..quant.pair_codebook import theoretical_pair_codebook
from ..config import TurboQuantConfig, model_facts
from .crop import crop_layers
from .hybrid_layer import hybrid_classes
from .layer import TurboQuantLayer
from .sliding_layer import TurboQuantSlidingLayer
from ..quant.rope import rope_angles
from ..quant.rotation import make_rotation
from .workspace import Workspace

_NORM_DTYPES = {"float16": torch.float16, "float32": torch.float32}
_QUANTIZED_TYPES = {"full_attention", "sliding_attention", "chunked_attention", "hybrid", "hybrid_sliding"}
_UNTOUCHED_TYPES = {"linear_attention", "conv", "dummy"}


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
        tq_config: a `TurboQuantConfig`, a preset name (`PRESETS`: "k5v3", "k4v4", "k4v2", ...), a dict, or None
            for the default preset (k5v3: 4 bits per coordinate, 5 for keys and 3 for values).
        config: the model's config. As for `DynamicCache`, it lets the cache build one layer per layer type
            (sliding-window layers keep their window) and resolves per-layer policies such as `skip_last`.
        codebooks: optional calibrated codebooks, an object with `get(layer_idx, kind, bits) -> Codebook | None`
            where kind is "key" or "value"; layers without one use the theoretical Lloyd-Max codebook.
        fused_sdpa: under transformers' "sdpa" attention (the default), decode steps read the packed K/V with the
            fused attention, as `attn_implementation="turboquant"` does; False gives SDPA the dequantized keys and
            values instead (the workspace path: the reference to compare against, and slower).
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
        fused_sdpa: bool = True,
        **overrides,
    ):
        self.tq_config = resolve_config(tq_config, **overrides)
        self.fused_sdpa = bool(fused_sdpa)
        _check_codebook_rotation(codebooks, self.tq_config)
        self.codebooks = codebooks
        self.workspace = Workspace()
        self.num_model_layers = None
        self.model_facts = None
        layers = None
        if config is not None:
            try:
                self.model_facts = model_facts(config)
            except (ValueError, RuntimeError):
                # a config without them, or a heterogeneous one (per-layer head dims): all works but save_prefix
                self.model_facts = None
            layer_types, layer_kwargs = _compat.layer_types_and_kwargs(config)
            stores = _compat.kv_sharing_producers(config)
            self.num_model_layers = len(layer_types)
            self.tq_config.check_layers(self.num_model_layers)
            self.tq_config.check_model_facts(self.model_facts)
            if codebooks is not None and hasattr(codebooks, "check_model"):
                codebooks.check_model(config)
            layers = [
                self._make_layer(i, t, kw, private_output=i in stores)
                for i, (t, kw) in enumerate(zip(layer_types, layer_kwargs))
            ]
            for layer in layers:
                if isinstance(layer, TurboQuantLayer) and not self.fused_sdpa:
                    layer.fused_sdpa = False
            if self.tq_config.key_centering:
                centred = [(layer, t) for layer, t in zip(layers, layer_types) if isinstance(layer, TurboQuantLayer)]
                ropes = rope_angles(config, [t for _, t in centred])
                for layer, t in centred:
                    layer.rope = ropes[t]
        elif self.tq_config.key_centering:
            raise ValueError("key_centering=True needs the model's config (TurboQuantCache(..., config=model.config)): "
                             "the cache takes the model's RoPE from it")
        Cache.__init__(
            self,
            layers=layers,
            layer_class_to_replicate=None if layers else DynamicLayer,
            offloading=offloading,
            offload_only_non_sliding=offload_only_non_sliding,
        )
        if not layers:
            # grows a config-less cache one full-attention layer at a time; a bound method here would make the
            # cache a reference cycle that keeps GPU buffers alive until the garbage collector runs
            self.layer_class_to_replicate = _NextLayer(
                self.layers, self.tq_config, self.codebooks, self.workspace, self.fused_sdpa
            )

    @classmethod
    def from_pretrained(cls, dir_or_model_path, config=None, **overrides) -> "TurboQuantCache":
        """A cache from the `turboquant_config.json` (+ `turboquant_codebooks.safetensors` when present) saved in
        a folder, e.g. next to `model.save_pretrained(dir)`. `config` is the model's config: it is checked against
        the stored model facts (as is `dir/config.json` when present) and passed on to the cache. `overrides`
        change config fields; the calibrated codebooks must still cover every bit width the result needs."""
        import os

        from ..calibrate.calibration import CODEBOOKS_NAME, CalibratedCodebooks
        from ..config import read_turboquant_json

        tq = TurboQuantConfig.from_pretrained(dir_or_model_path, config=config)
        codebooks = None
        doc = read_turboquant_json(dir_or_model_path)
        if "codebooks" in doc or os.path.exists(os.path.join(dir_or_model_path, CODEBOOKS_NAME)):
            codebooks = CalibratedCodebooks.from_pretrained(dir_or_model_path, config=config)
        tq = resolve_config(tq, **overrides)
        if codebooks is not None:
            codebooks.check_covers(tq)
        return cls(tq, config=config, codebooks=codebooks)

    def crop(self, max_length: int) -> None:
        """As `DynamicCache.crop`, all or nothing: a layer that would refuse is found before any layer is cut."""
        crop_layers(self.layers, max_length)

    def save_prefix(self, path: str, token_ids, model=None) -> str:
        """Save this cache, holding a prompt prefix, for reuse by later requests that start with the same tokens.

        Args:
            path: a folder; `turboquant_prefix.safetensors` and `turboquant_prefix.json` are written into it, both
                or neither for a new folder (an existing one gets the tensors, then the index; a torn pair is
                refused at load by the tensors' SHA-256 in the index).
            token_ids: the prefix's token ids, (seq,) or (batch, seq), exactly the tokens the cache holds. Their
                SHA-256 is stored so that `load_prefix(..., token_ids=prompt)` can refuse another prompt.
            model: the model that filled the cache. Given, a digest of its weights is stored and `load_prefix`
                then needs the same weights (`model=`): a checkpoint of the same shape is refused. Without it,
                only the model facts (type, layers, KV heads, head dim) bind the prefix to a model.

        The cache must have been built with `config=model.config`. No pickle is used. Example:

            cache = TurboQuantCache(config=model.config)
            model(prefix_ids, cache=cache)
            cache.save_prefix("prefixes/manual", prefix_ids, model=model)
        """
        from ..prefix.file import save_prefix

        return save_prefix(self, path, token_ids, model=model)

    @classmethod
    def load_prefix(
        cls, path: str, config, *, token_ids=None, codebooks=None, device=None, model=None
    ) -> "TurboQuantCache":
        """A cache holding a prefix saved by `save_prefix`, ready to continue generation.

        Args:
            path: the folder `save_prefix` wrote.
            config: the model's config; its facts (type, layers, KV heads, head dim) must equal the saved ones.
            token_ids: optional, the new prompt: refused unless it starts with the saved prefix's exact tokens.
            codebooks: the calibrated codebooks the prefix was saved with, if any (their identity is checked).
            device: where the tensors go (default: as saved, i.e. CPU).
            model: the model to continue with; needed when the prefix was saved with `model=` (its weights must
                be the saved ones), refused when it was not (there is nothing to check it against).

        Every refusal is a ValueError naming the file and the field or tensor (FileNotFoundError for a missing
        file); nothing half built is returned. Continuing from the loaded cache gives the logits of the cache that
        was saved. Example:

            cache = TurboQuantCache.load_prefix("prefixes/manual", model.config, token_ids=prompt_ids, model=model)
            out = model.generate(prompt_ids, cache=cache, max_new_tokens=64)
        """
        from ..prefix.file import load_prefix

        return load_prefix(cls, path, config, token_ids=token_ids, codebooks=codebooks, device=device, model=model)

    def _make_layer(self, idx: int, layer_type: str, kwargs: dict, private_output: bool = False):
        return make_layer(
            self.tq_config, self.codebooks, self.workspace, self.num_model_layers, idx, layer_type, kwargs,
            private_output,
        )

    def _tq_layer(self, cls, idx: int, bits: tuple[int, int], **extra):
        return _tq_layer(self.tq_config, self.codebooks, self.workspace, cls, idx, bits, **extra)

    @property
    def quantized_tokens(self) -> int:
        """Tokens the most quantized layer holds packed; 0 while everything fits the exact window (`residual_length`),
        where the cache gives DynamicCache's results."""
        return max((layer.quantized_length for layer in self.layers if isinstance(layer, TurboQuantLayer)), default=0)

    def nbytes(self) -> dict[str, int]:
        """Device bytes the cache holds between steps, by kind. `full_precision` counts unquantized layers."""
        out = {"packed": 0, "residual": 0, "sinks": 0, "full_precision": 0, "workspace": self.workspace.nbytes()}
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


def make_layer(
    tq_config, codebooks, workspace, num_model_layers, idx: int, layer_type: str, kwargs: dict,
    private_output: bool = False,
):
    """The cache layer for one decoder layer, by the layer type transformers assigns it."""
    bits = tq_config.bits_for_layer(idx, num_model_layers, layer_type)
    extra = {"private_output": True} if private_output else {}
    if (layer_type in _UNTOUCHED_TYPES or bits is None) and idx in tq_config.key_split:
        raise ValueError(f"key_split names layer {idx}, which the config keeps in full precision (layer type "
                         f"{layer_type!r}); split only quantized layers")
    if layer_type in _UNTOUCHED_TYPES:  # recurrent / conv state only, or KV-sharing consumers: no KV here
        return _compat.transformers_layer(layer_type, kwargs, idx)
    if bits is None:
        return _compat.transformers_layer(layer_type, kwargs, idx)
    if layer_type == "full_attention":
        return _tq_layer(tq_config, codebooks, workspace, TurboQuantLayer, idx, bits, **extra)
    if layer_type == "hybrid":
        return _tq_layer(tq_config, codebooks, workspace, hybrid_classes()[0], idx, bits, **extra, **kwargs)
    if layer_type in ("sliding_attention", "chunked_attention", "hybrid_sliding"):
        if int(kwargs["sliding_window"]) - 1 <= tq_config.residual_length:
            # the whole window fits in the residual: nothing would ever be quantized
            return _compat.transformers_layer(layer_type, kwargs, idx)
        cls = TurboQuantSlidingLayer if layer_type != "hybrid_sliding" else hybrid_classes()[1]
        return _tq_layer(tq_config, codebooks, workspace, cls, idx, bits, **extra, **kwargs)
    raise ValueError(
        f"layer {idx} has layer type {layer_type!r}, which TurboQuantCache cannot quantize (it quantizes "
        f"{sorted(_QUANTIZED_TYPES)}). Keep such layers in full precision with "
        f"skip_layer_types=[{layer_type!r}] or skip_layers=[{idx}, ...]."
    )


def _tq_layer(tq_config, codebooks, workspace, cls, idx: int, bits: tuple[int, int], **extra):
    cfg = tq_config
    return cls(
        key_bits=bits[0],
        value_bits=bits[1],
        residual_length=cfg.residual_length,
        sink_tokens=cfg.sink_tokens,
        rotation_for=partial(_rotation, seed=cfg.seed + idx, kind=cfg.rotation),
        # no reference back to the cache: layers must not form a cycle that keeps GPU buffers alive until gc
        codebook_for=partial(_codebook, codebooks, idx, codes=cfg.codes, norm_correction=cfg.norm_correction),
        workspace=workspace,
        norm_dtype=_NORM_DTYPES[cfg.norm_dtype],
        layer_idx=idx,
        codebook_check=partial(_check_codebooks, codebooks) if codebooks is not None else None,
        key_split=cfg.key_split.get(idx),
        **extra,
    )


def _check_codebook_rotation(codebooks, tq_config) -> None:
    """Calibrated codebooks hold centroids of coordinates under one rotation: refuse a config of another seed or
    rotation kind (`check_rotation` of `CalibratedCodebooks`; other codebook objects are taken as they are). They are
    scalar codebooks: a config of pair codes is refused with them."""
    if codebooks is not None and tq_config.codes != "scalar":
        raise ValueError(f"calibrated codebooks are scalar codebooks, but the config has codes={tq_config.codes!r}: "
                         "pass no codebooks, or use codes='scalar'")
    if codebooks is not None and hasattr(codebooks, "check_rotation"):
        codebooks.check_rotation(tq_config)


def _check_codebooks(codebooks, layer_idx: int, heads: int, head_dim: int) -> None:
    """Calibrated codebooks fit one model: refuse K/V of another shape at a layer's first update."""
    if hasattr(codebooks, "check_states"):
        codebooks.check_states(layer_idx, heads, head_dim)


class _NextLayer:
    """`layer_class_to_replicate` of a config-less cache: builds layer len(layers) as a full-attention layer."""

    def __init__(self, layers: list, tq_config, codebooks, workspace, fused_sdpa: bool = True):
        self.layers, self.tq_config, self.codebooks, self.workspace = layers, tq_config, codebooks, workspace
        self.fused_sdpa = fused_sdpa

    def __call__(self):
        layer = make_layer(
            self.tq_config, self.codebooks, self.workspace, None, len(self.layers), "full_attention", {}
        )
        if not getattr(self, "fused_sdpa", True):
            layer.fused_sdpa = False
        return layer


def _codebook(codebooks, idx: int, kind: str, bits: int, dim: int, codes: str = "scalar",
              norm_correction: bool = False) -> Codebook:
    """The calibrated codebook for (layer, kind, bits) when there is one, else the theoretical one of `codes`
    ("scalar" or "pair"), norm-correcting where asked."""
    cb = codebooks.get(idx, kind, bits) if codebooks is not None and codes == "scalar" else None
    if cb is None:
        cb = theoretical_pair_codebook(bits, dim) if codes == "pair" else theoretical_codebook(bits, dim)
    return cb.with_norm_correction(norm_correction)


@lru_cache(maxsize=None)
def _rotation(dim: int, seed: int, kind: str):
    return make_rotation(dim, seed, kind)
