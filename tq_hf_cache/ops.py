"""Dispatch between the Triton kernels (CUDA) and the torch reference (everything else).

The cache calls only these functions; they write into caller-owned buffers so that no per-call
allocation of the packed or dequantized data is needed.
"""

from __future__ import annotations

import torch

from . import kernels, reference
from .codebook import Codebook
from .rotation import Rotation


def use_kernels(t: torch.Tensor) -> bool:
    return t.is_cuda and kernels.available()


def quantize_into(
    x: torch.Tensor,
    rotation: Rotation,
    codebook: Codebook,
    packed_out: torch.Tensor,
    norms_out: torch.Tensor,
) -> None:
    """Quantize x (B, H, T, D) into packed_out (B, H, T, nbytes) uint8 and norms_out (B, H, T)."""
    if use_kernels(x) and kernels.supports(rotation.dim, codebook.bits):
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
    if use_kernels(out) and kernels.supports(rotation.dim, codebook.bits):
        kernels.dequantize_into(packed, norms, rotation, codebook, out)
        return
    out.copy_(reference.dequantize(packed, norms, rotation, codebook, out.dtype))
