"""Bit packing of codebook indices into uint8, LSB first, with no padding beyond a whole byte per vector.

Index j of a vector occupies bits [j*b, j*b + b) of the vector's little-endian bit string, so a 3-bit
vector of 128 coordinates costs exactly 48 bytes. The Triton kernels read and write this same layout.
"""

from __future__ import annotations

import torch

from .codebook import check_bits


def packed_bytes(dim: int, bits: int) -> int:
    """Bytes one packed vector of `dim` indices takes at `bits` bits each."""
    check_bits(bits)
    return (dim * bits + 7) // 8


def pack_indices(idx: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer indices (..., dim), each in [0, 2**bits), into uint8 (..., packed_bytes(dim, bits))."""
    check_bits(bits)
    dim = idx.shape[-1]
    idx = idx.to(torch.int32)
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= 2**bits):
        raise ValueError(f"indices must lie in [0, {2**bits}) for {bits} bits, got [{int(idx.min())}, {int(idx.max())}]")
    if bits == 8:
        return idx.to(torch.uint8)
    lead = idx.shape[:-1]
    nbytes = packed_bytes(dim, bits)
    if 8 % bits == 0:  # whole indices per byte: a cheap reshape-and-shift
        per = 8 // bits
        pad = nbytes * per - dim
        if pad:
            idx = torch.nn.functional.pad(idx, (0, pad))
        shifts = torch.arange(per, device=idx.device, dtype=torch.int32) * bits
        return (idx.reshape(*lead, nbytes, per) << shifts).sum(-1).to(torch.uint8)
    shifts = torch.arange(bits, device=idx.device, dtype=torch.int32)
    bitstream = ((idx.unsqueeze(-1) >> shifts) & 1).reshape(*lead, dim * bits)
    pad = nbytes * 8 - dim * bits
    if pad:
        bitstream = torch.nn.functional.pad(bitstream, (0, pad))
    weights = 1 << torch.arange(8, device=idx.device, dtype=torch.int32)
    return (bitstream.reshape(*lead, nbytes, 8) * weights).sum(-1).to(torch.uint8)


def unpack_indices(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of `pack_indices`: uint8 (..., packed_bytes(dim, bits)) -> int64 indices (..., dim)."""
    check_bits(bits)
    nbytes = packed_bytes(dim, bits)
    if packed.dtype != torch.uint8 or packed.shape[-1] != nbytes:
        raise ValueError(
            f"expected uint8 packed data with last dim {nbytes} for dim={dim}, bits={bits}; "
            f"got {packed.dtype} with shape {tuple(packed.shape)}"
        )
    lead = packed.shape[:-1]
    p = packed.to(torch.int32)
    if bits == 8:
        return p.long()
    if 8 % bits == 0:
        per = 8 // bits
        shifts = torch.arange(per, device=p.device, dtype=torch.int32) * bits
        vals = (p.unsqueeze(-1) >> shifts) & (2**bits - 1)
        return vals.reshape(*lead, nbytes * per)[..., :dim].long()
    bitstream = ((p.unsqueeze(-1) >> torch.arange(8, device=p.device, dtype=torch.int32)) & 1).reshape(*lead, nbytes * 8)
    bitstream = bitstream[..., : dim * bits].reshape(*lead, dim, bits)
    weights = 1 << torch.arange(bits, device=p.device, dtype=torch.int32)
    return (bitstream * weights).sum(-1).long()
