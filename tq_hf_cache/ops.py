"""Dispatch between the Triton kernels (CUDA) and the torch reference (everything else).

The cache calls only these functions; they write into caller-owned buffers so that no per-call
allocation of the packed or dequantized data is needed.
"""

from __future__ import annotations

import warnings

import torch

from . import kernels, reference
from .codebook import Codebook
from .rotation import Rotation

_WARNED: set = set()


def use_kernels(t: torch.Tensor) -> bool:
    return t.is_cuda and kernels.available()


def _kernel_ok(t: torch.Tensor, dim: int, bits: int) -> bool:
    """Whether to take the Triton path; a CUDA tensor that cannot warns once per reason (it is much slower)."""
    if not t.is_cuda:
        return False
    if not kernels.available():
        reason = "triton is not importable"
    elif not kernels.supports(dim, bits):
        reason = f"head dim {dim} with {bits} bits is not supported by the kernels (head dims {kernels.SUPPORTED_DIMS})"
    else:
        return True
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"tq_hf_cache falls back to the torch reference on CUDA: {reason}", RuntimeWarning, stacklevel=3)
    return False


def quantize_into(
    x: torch.Tensor,
    rotation: Rotation,
    codebook: Codebook,
    packed_out: torch.Tensor,
    norms_out: torch.Tensor,
) -> None:
    """Quantize x (B, H, T, D) into packed_out (B, H, T, nbytes) uint8 and norms_out (B, H, T)."""
    if _kernel_ok(x, rotation.dim, codebook.bits):
        kernels.quantize_into(x, rotation, codebook, packed_out, norms_out)
        return
    packed, norms = reference.quantize(x, rotation, codebook, norms_out.dtype)
    packed_out.copy_(packed)
    norms_out.copy_(norms)


def dequantize_into(
    packed: torch.Tensor,
    norms: torch.Tensor,
    rotation: Rotation,
    codebook: Codebook,
    out: torch.Tensor,
) -> None:
    """Dequantize packed (B, H, T, nbytes) + norms (B, H, T) into out (B, H, T, D), in out's dtype."""
    if _kernel_ok(out, rotation.dim, codebook.bits):
        kernels.dequantize_into(packed, norms, rotation, codebook, out)
        return
    out.copy_(reference.dequantize(packed, norms, rotation, codebook, out.dtype))


def quantize_kv_into(
    k: torch.Tensor,
    v: torch.Tensor,
    rotation: Rotation,
    k_codebook: Codebook,
    v_codebook: Codebook,
    k_packed: torch.Tensor,
    k_norms: torch.Tensor,
    v_packed: torch.Tensor,
    v_norms: torch.Tensor,
) -> None:
    """`quantize_into` for a layer's keys and values; one kernel launch for both on CUDA (decode steps)."""
    if (
        _kernel_ok(k, rotation.dim, k_codebook.bits)
        and kernels.supports(rotation.dim, v_codebook.bits)
        and k.shape == v.shape
        and k.dtype == v.dtype
        and k_norms.dtype == v_norms.dtype
    ):
        kernels.quantize_kv_into(k, v, rotation, k_codebook, v_codebook, k_packed, k_norms, v_packed, v_norms)
        return
    quantize_into(k, rotation, k_codebook, k_packed, k_norms)
    quantize_into(v, rotation, v_codebook, v_packed, v_norms)
