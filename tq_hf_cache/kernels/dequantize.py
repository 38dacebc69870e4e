"""Fused TurboQuant dequantize: packed indices + norms -> norm * Pi^T c[idx], written straight into `out`.

One program takes BLOCK_T tokens of one (batch, head): it reads the packed bytes (BITS bytes per group of
8 indices), unpacks, gathers the centroids (per-head via a head stride), applies the inverse rotation,
scales by the norm and stores in out's own dtype at out's strides: no fp32 copy, no cast kernel.

Inverse rotation (hadamard): out_row = c_row @ Pi = (c_row @ S) / sqrt(D) with S = sqrt(D) * Pi of +-1
entries. The centroids are fp32; they enter a 16-bit tensor-core dot as fp16 terms, scaled by 2**10 so that
the low term stays a normal fp16 number: one term (~2**-12 relative, under a bf16 ulp) for bf16 outputs,
hi + lo (~2**-22) for fp16 and fp32 outputs (one term missed fp16's ulp on the H100 test).
Orthogonal rotations use an fp32 ieee dot against Pi.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant.codebook import Codebook
from ..quant.rotation import Rotation
from . import _common as C
from .quantize import _load_rot

C_SCALE = 1024.0  # power of two: exact to apply and to undo
PROGS_PER_SM = 4  # best of 0 (a program per tile) / 2 / 4 on the H100 (benchmarks/results/dequant_sweep_h100.json)


WIDE_WORDS = (3, 5, 6, 7)  # group widths that may be read in int64 words (`_common.load_groups`)
INT64_WORDS = (6, 7)  # read so by default: 6-7 % of copy bandwidth faster on the H100 (3 and 5 bits: no faster)


def word_unit(packed: torch.Tensor, bits: int) -> int:
    """The unit the dequantize kernel reads `packed`'s rows in: 8 (int64 words) at INT64_WORDS widths, else 4 (int32
    words), where the rows are aligned to it; 0 (bytes) otherwise."""
    if bits in INT64_WORDS and C.rows_aligned(packed, 8):
        return 8
    return 4 if C.rows_aligned(packed) else 0


@triton.jit
def _dequantize_kernel(
    p_ptr, spb, sph, spt,
    n_ptr, snb, snh, snt,
    o_ptr, sob, soh, sot, sod,
    mat_ptr, cen_ptr, sch,
    H, T, out_scale, n_t_tiles, n_tiles,
    D: tl.constexpr, LOG2D: tl.constexpr, BITS: tl.constexpr, BLOCK_T: tl.constexpr,
    ROT: tl.constexpr, TERMS: tl.constexpr, O_UNIT: tl.constexpr, STAGES: tl.constexpr, WORDS: tl.constexpr,
):
    """Persistent: the rotation operand is loaded once, then the program walks tiles pid, pid + grid, ..."""
    rop = _load_rot(mat_ptr, D)
    for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), num_stages=STAGES):
        _dequantize_tile(
            p_ptr, spb, sph, spt, n_ptr, snb, snh, snt, o_ptr, sob, soh, sot, sod,
            rop, cen_ptr, sch, tile % n_t_tiles, tile // n_t_tiles, H, T, out_scale,
            D, LOG2D, BITS, BLOCK_T, ROT, TERMS, O_UNIT, WORDS,
        )


@triton.jit
def _dequantize_tile(
    p_ptr, spb, sph, spt,
    n_ptr, snb, snh, snt,
    o_ptr, sob, soh, sot, sod,
    rop, cen_ptr, sch, pid_t, pid_bh, H, T, out_scale,
    D: tl.constexpr, LOG2D: tl.constexpr, BITS: tl.constexpr, BLOCK_T: tl.constexpr,
    ROT: tl.constexpr, TERMS: tl.constexpr, O_UNIT: tl.constexpr, WORDS: tl.constexpr,
):
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    t64 = t.to(tl.int64)
    d = tl.arange(0, D)

    # ---- unpack, LSB first (packing.py's layout)
    p_rows = p_ptr + b * spb + h.to(tl.int64) * sph + t64 * spt
    if BITS == 8 and WORDS:  # four indices per int32 word, split in int32 (int64 groups were slower)
        w = tl.load(p_rows.to(tl.pointer_type(tl.int32), bitcast=True)[:, None] + tl.arange(0, D // 4)[None, :],
                    mask=tmask[:, None], other=0)
        idx = tl.reshape(tl.join(tl.join(w & 255, (w >> 16) & 255), tl.join((w >> 8) & 255, (w >> 24) & 255)),
                         (BLOCK_T, D))
    elif BITS == 8:  # one index per byte
        idx = tl.load(p_rows[:, None] + d[None, :], mask=tmask[:, None], other=0).to(tl.int32)
    else:  # 8 indices = one group of BITS bytes (whole words where rows are aligned: faster than byte tiles)
        idx = C.expand_groups(C.load_groups(p_rows, tmask, BITS, D, WORDS, D // 8), BITS, D, BLOCK_T)

    c = C.gather(cen_ptr + h * sch, idx)  # (BLOCK_T, D) fp32 gather from a 2**BITS table

    n_rows = n_ptr + b * snb + h.to(tl.int64) * snh + t64 * snt
    norm = tl.load(n_rows, mask=tmask, other=0.0).to(tl.float32)

    # ---- inverse rotation
    m = rop
    if ROT == 2:
        r = tl.dot(c, m, input_precision="ieee")
    else:
        if TERMS == 0:  # fp32 operands (interpreter)
            r = tl.dot(c * 1024.0, m, input_precision="ieee")
        else:
            cs = c * 1024.0
            hi = cs.to(tl.float16)
            r = tl.dot(hi, m)
            if TERMS == 2:
                r += tl.dot((cs - hi.to(tl.float32)).to(tl.float16), m)
    out = r * (norm * out_scale)[:, None]

    o_rows = o_ptr + b * sob + h.to(tl.int64) * soh + t64 * sot
    if O_UNIT:  # unit last-dim stride as a constexpr: contiguous, vectorizable rows
        tl.store(o_rows[:, None] + d[None, :], out.to(o_ptr.dtype.element_ty), mask=tmask[:, None])
    else:
        tl.store(o_rows[:, None] + d[None, :] * sod, out.to(o_ptr.dtype.element_ty), mask=tmask[:, None])


def dequantize_into(
    packed: torch.Tensor,
    norms: torch.Tensor,
    rotation: Rotation,
    codebook: Codebook,
    out: torch.Tensor,
    *,
    rot: str | None = None,
    terms: int | None = None,
    block_t: int | None = None,
    num_warps: int | None = None,
    progs_per_sm: int | None = None,
    stages: int = 1,
    words: int | None = None,
):
    """Dequantize packed (B, H, T, nbytes) + norms (B, H, T) into out (B, H, T, D), in out's dtype and strides.

    rot / terms / block_t / num_warps / progs_per_sm (0: one program per tile) / stages / words (the unit packed rows
    are read in: 0 bytes, 4 or 8, where the rows are aligned to it) override the defaults (for the benchmark); the
    cache never passes them.
    Returns the launched kernel handle (its n_regs / n_spills), or None when there was nothing to do.
    """
    where = "dequantize_into"
    if not isinstance(out, torch.Tensor) or out.dim() != 4:
        raise ValueError(f"{where}: out must be a (B, H, T, D) tensor, got shape {tuple(getattr(out, 'shape', ()))}")
    if out.dtype not in C.X_DTYPES:
        raise TypeError(f"{where}: out must be one of {C.X_DTYPES}, got {out.dtype}")
    bsz, heads, tokens, dim = out.shape
    bits, nbytes = C.check_common(where, rotation, codebook, dim, quantize=False)
    lead = (bsz, heads, tokens)
    for name, t in (("out", out), ("packed", packed), ("norms", norms)):
        C.check_device(f"{where}: {name}", t, out.device)
    C.check_packed(where, packed, lead, nbytes, dim, bits)
    C.check_norms(where, norms, lead)
    if out.numel() == 0:
        return None
    dev = out.device
    cen, _, sch, _ = C.codebook_tables(codebook, heads, dev)

    inv_sqrt_d = dim**-0.5
    if rot not in (None, "dot"):
        raise ValueError(f"{where}: rot must be None or 'dot', got {rot!r}")
    if rotation.kind != "hadamard":
        rmode, n_terms, mat, scale = C.ROT_DENSE, 0, C.rotation_operand(rotation, dev, "inv", torch.float32), 1.0
    else:
        rmode, scale = C.ROT_PM1_DOT, inv_sqrt_d / C_SCALE
        if C.INTERPRET:
            n_terms, mdtype = 0, torch.float32
        else:
            # one fp16 term is under a bf16 ulp; fp16/fp32 outputs need hi + lo to match the reference closely
            n_terms = terms if terms is not None else (1 if out.dtype == torch.bfloat16 else 2)
            if n_terms not in (1, 2):
                raise ValueError(f"{where}: terms must be 1 or 2, got {n_terms!r}")
            mdtype = torch.float16
        mat = C.rotation_operand(rotation, dev, "inv", mdtype)

    unit = word_unit(packed, bits) if words is None else words
    if unit not in (0, 4, 8) or (unit and not C.rows_aligned(packed, unit)) or (unit == 8 and bits not in WIDE_WORDS):
        raise ValueError(f"{where}: words={words} needs rows aligned to it and, for 8, {WIDE_WORDS} bits; these "
                         f"{bits}-bit rows take {word_unit(packed, bits)}")
    bt = C.block_t(tokens) if block_t is None else block_t
    n_t = triton.cdiv(tokens, bt)
    n_tiles = n_t * bsz * heads
    grid = (C.persistent_grid(n_tiles, dev, PROGS_PER_SM if progs_per_sm is None else progs_per_sm),)
    return _dequantize_kernel[grid](
        packed, *packed.stride()[:3],
        norms, *norms.stride(),
        out, *out.stride(),
        mat, cen, sch,
        heads, tokens, scale, n_t, n_tiles,
        D=dim, LOG2D=dim.bit_length() - 1, BITS=bits, BLOCK_T=bt,
        ROT=rmode, TERMS=n_terms, O_UNIT=out.stride(-1) == 1, STAGES=stages, WORDS=unit,
        num_warps=num_warps if num_warps is not None else 4,
    )
