"""tq_hf_cache: TurboQuant KV-cache compression as a drop-in transformers `DynamicCache`."""

from . import _moved

_moved.install()  # old module paths (`_moved.MOVED`) stay importable

from .hf import attention  # noqa: F401  (registers attn_implementation="turboquant")
from ._compat import cache_kwargs
from .hf.cache import TurboQuantCache
from .quant.codebook import Codebook, theoretical_codebook
from .config import DEFAULT_PRESET, PRESETS, TurboQuantConfig
from .hf.layer import TurboQuantLayer
from .prefix.store import PrefixStore
from .hf.sliding_layer import TurboQuantSlidingLayer
from .quant.rotation import Rotation, make_rotation
from .hf.static_cache import TurboQuantStaticCache, TurboQuantStaticLayer

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_PRESET",
    "PRESETS",
    "PrefixStore",
    "Codebook",
    "Rotation",
    "TurboQuantCache",
    "TurboQuantConfig",
    "TurboQuantLayer",
    "TurboQuantSlidingLayer",
    "TurboQuantStaticCache",
    "TurboQuantStaticLayer",
    "cache_kwargs",
    "make_rotation",
    "theoretical_codebook",
]
