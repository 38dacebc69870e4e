"""tq_hf_cache: TurboQuant KV-cache compression as a drop-in transformers `DynamicCache`."""

from . import attention  # noqa: F401  (registers attn_implementation="turboquant")
from ._compat import cache_kwargs
from .cache import TurboQuantCache
from .codebook import Codebook, theoretical_codebook
from .config import DEFAULT_PRESET, PRESETS, TurboQuantConfig
from .layer import TurboQuantLayer
from .prefix_store import PrefixStore
from .sliding_layer import TurboQuantSlidingLayer
from .rotation import Rotation, make_rotation
from .static_cache import TurboQuantStaticCache, TurboQuantStaticLayer

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
