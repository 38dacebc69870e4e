"""Quality evaluation of KV caches on a real model: chunked-prefill perplexity, needle retrieval, greedy
agreement with the full-precision cache, and KV bytes per token. See docs/quality.md and `tq-hf-cache eval`."""

from .caches import DEFAULT_CACHES, CacheSpec, all_specs, backend_status, cache_bytes, measure_bytes_synthetic
from .runner import TASKS, EvalSettings, run_eval

__all__ = [
    "DEFAULT_CACHES",
    "TASKS",
    "CacheSpec",
    "EvalSettings",
    "all_specs",
    "backend_status",
    "cache_bytes",
    "measure_bytes_synthetic",
    "run_eval",
]
