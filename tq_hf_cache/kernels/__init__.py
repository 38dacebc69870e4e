"""Triton kernels and their launchers. The cache reaches them only through `tq_hf_cache.ops`."""

from __future__ import annotations


def available() -> bool:
    """True when Triton kernels can run here (CUDA, or CPU under TRITON_INTERPRET=1)."""
    return False
