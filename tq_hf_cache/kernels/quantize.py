"""Fused TurboQuant quantize: x (B, H, T, D) -> packed indices + norm, one pass, nothing but them written.

One program takes BLOCK_T tokens of one (batch, head): it loads the (BLOCK_T, D) tile once, takes the fp32
norms, rotates, finds each coordinate's cell (the number of codebook boundaries strictly below it, like
torch.bucketize), packs the indices LSB-first (packing.py's layout) and stores bytes and norms at the
caller's strided slots. No intermediate tensor goes through global memory.

Rotation. For the randomized Hadamard rotation Pi = H diag(s) / sqrt(D), sqrt(D) * Pi holds only +-1, so
the rotation is one tensor-core dot (wgmma on Hopper) of the raw x tile against that +-1 matrix
(ROT_PM1_DOT): fp16/bf16 x is exact in its own type and every product is exact, leaving only fp32
accumulation rounding (the reference has the same order of rounding); the 1/(sqrt(D) * norm) scale is
applied to the fp32 result. A fast Walsh-Hadamard transform in registers (rot="fwht") is kept for
comparison: each of its log2(D) butterfly stages is a register-layout shuffle in Triton, and on the H100 it
was slower than the dot where the rotation mattered (4 bits, B=8, T=32768: quantize 334 vs 527 GB/s,
dequantize 1196 vs 1327 GB/s; benchmarks/results/bench_quantize_v1.json), so the dot is the default. fp32 x
is split into three bf16 terms that sum to it exactly (three dots). Orthogonal rotations (no +-1 form) use
an fp32 ieee dot.

Codebook search (measured, see search defaults in _search_args): up to 4 bits an unrolled compare against
each boundary (<= 15 scalar loads per tile); above, a uniform-grid table (_common.search_lut) that needs
two gathers per coordinate; a branchless binary search is the fallback for degenerate codebooks. Per-head
codebooks are one pointer offset (head stride 0 for a shared codebook).

Grid: persistent, a few programs per SM, each loading the (D, D) operand once and walking tiles; the
cache's decode step can use `quantize_kv_into`, one launch for a layer's keys and values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..codebook import Codebook
from ..rotation import Rotation
from . import _common as C

FP16_MAX = 65504.0


@triton.jit
def _fwht_rows(y, BLOCK_T: tl.constexpr, D: tl.constexpr, LOG2D: tl.constexpr):
    """Unnormalized Walsh-Hadamard transform of each row of y (BLOCK_T, D), same butterfly order as fwht()."""
    for s in tl.static_range(LOG2D):
        y4 = tl.reshape(y, (BLOCK_T, D // (2 << s), 2, 1 << s))
        a, b = tl.split(tl.permute(y4, (0, 1, 3, 2)))
        y4 = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
        y = tl.reshape(y4, (BLOCK_T, D))
    return y


@triton.jit
def _quantize_tile(
    x_ptr, sxb, sxh, sxt, sxd,
    p_ptr, spb, sph, spt,
    n_ptr, snb, snh, snt,
    rop, bnd_ptr, sbh, lut_ptr, slh, lo_ptr, invw_ptr, hsel, NLUT,
    pid_t, pid_bh, H, T, inv_sqrt_d,
    D: tl.constexpr, LOG2D: tl.constexpr, BITS: tl.constexpr, BLOCK_T: tl.constexpr,
    ROT: tl.constexpr, XMODE: tl.constexpr, CLAMP_FP16: tl.constexpr, X_UNIT: tl.constexpr, SEARCH: tl.constexpr,
):
    """One (BLOCK_T, D) tile of one (batch, head); rop is the (D, D) matrix operand, or the (D,) signs for FWHT."""
    b = pid_bh // H
    h = pid_bh % H
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    t64 = t.to(tl.int64)
    d = tl.arange(0, D)

    x_rows = x_ptr + b.to(tl.int64) * sxb + h.to(tl.int64) * sxh + t64 * sxt
    if X_UNIT:  # unit last-dim stride as a constexpr: contiguous, vectorizable rows
        x = tl.load(x_rows[:, None] + d[None, :], mask=tmask[:, None], other=0.0)
    else:
        x = tl.load(x_rows[:, None] + d[None, :] * sxd, mask=tmask[:, None], other=0.0)
    xf = x.to(tl.float32)
    norm = tl.sqrt(tl.sum(xf * xf, axis=1))
    inv = 1.0 / tl.maximum(norm, 1e-30)

    # ---- rotation: y = Pi (x / norm), row-wise
    if ROT == 1:  # FWHT in registers
        y = _fwht_rows(xf * rop[None, :], BLOCK_T, D, LOG2D) * (inv * inv_sqrt_d)[:, None]
    else:
        m = rop
        if ROT == 2:  # dense orthogonal: fp32 ieee dot of the unit vectors
            y = tl.dot(xf * inv[:, None], m, input_precision="ieee")
        else:
            if XMODE == 0:  # fp16/bf16 x, +-1 matrix in the same dtype: exact products
                acc = tl.dot(x, m)
            elif XMODE == 1:  # fp32 operands (interpreter)
                acc = tl.dot(xf, m, input_precision="ieee")
            else:  # fp32 x = hi + mid + lo exactly, three bf16 dots
                hi = xf.to(tl.bfloat16)
                r = xf - hi.to(tl.float32)
                mid = r.to(tl.bfloat16)
                lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
                acc = tl.dot(hi, m) + tl.dot(mid, m) + tl.dot(lo, m)
            y = acc * (inv * inv_sqrt_d)[:, None]

    # ---- codebook search: number of boundaries strictly below y
    bnd = bnd_ptr + h * sbh
    if SEARCH == 0:  # linear: one scalar boundary per step (cheapest for <= 3 bits)
        idx = tl.zeros((BLOCK_T, D), dtype=tl.int32)
        for k in tl.static_range((1 << BITS) - 1):
            idx += (y > tl.load(bnd + k)).to(tl.int32)
    elif SEARCH == 1:  # uniform-grid table + one compare (see _common.search_lut)
        lo = tl.load(lo_ptr + h * hsel)
        inv_w = tl.load(invw_ptr + h * hsel)
        j = tl.minimum(tl.maximum(((y - lo) * inv_w).to(tl.int32), 0), NLUT - 1)
        g = tl.load(lut_ptr + h * slh + j).to(tl.int32)
        idx = g + (y > tl.load(bnd + g)).to(tl.int32)
    else:  # branchless binary search, BITS dependent gathers (fallback for degenerate codebooks)
        idx = tl.zeros((BLOCK_T, D), dtype=tl.int32)
        for s in tl.static_range(BITS):
            step = 1 << (BITS - 1 - s)
            bk = tl.load(bnd + idx + (step - 1))
            idx = tl.where(y > bk, idx + step, idx)

    # ---- pack, LSB first (packing.py's layout)
    p_rows = p_ptr + b.to(tl.int64) * spb + h.to(tl.int64) * sph + t64 * spt
    if (8 % BITS) == 0:  # whole indices per byte: contiguous full-byte stores
        PER: tl.constexpr = 8 // BITS
        NB: tl.constexpr = D // PER
        if BITS == 8:
            byts = idx.to(tl.uint8)
        else:
            i3 = tl.reshape(idx, (BLOCK_T, NB, PER))
            byts = tl.sum(i3 << (tl.arange(0, PER) * BITS)[None, None, :], axis=2).to(tl.uint8)
        tl.store(p_rows[:, None] + tl.arange(0, NB)[None, :], byts, mask=tmask[:, None])
    else:  # 8 indices = one word of BITS bytes; int32 holds it for 3 bits
        G: tl.constexpr = D // 8
        g8 = tl.arange(0, G)
        if BITS < 4:
            k4 = tl.arange(0, 4)
            i3 = tl.reshape(idx, (BLOCK_T, G, 8))
            word = tl.sum(i3 << (tl.arange(0, 8) * BITS)[None, None, :], axis=2)
            byts = ((word[:, :, None] >> (k4 * 8)[None, None, :]) & 0xFF).to(tl.uint8)
            off = g8[None, :, None] * BITS + k4[None, None, :]
            tl.store(p_rows[:, None, None] + off, byts, mask=tmask[:, None, None] & (k4 < BITS)[None, None, :])
        else:
            k8 = tl.arange(0, 8)
            i3 = tl.reshape(idx, (BLOCK_T, G, 8)).to(tl.int64)
            word = tl.sum(i3 << (k8 * BITS).to(tl.int64)[None, None, :], axis=2)  # disjoint fields: sum == or
            byts = ((word[:, :, None] >> (k8 * 8).to(tl.int64)[None, None, :]) & 0xFF).to(tl.uint8)
            off = g8[None, :, None] * BITS + k8[None, None, :]
            tl.store(p_rows[:, None, None] + off, byts, mask=tmask[:, None, None] & (k8 < BITS)[None, None, :])

    # ---- norm
    if CLAMP_FP16:
        norm = tl.minimum(norm, 65504.0)
    n_rows = n_ptr + b.to(tl.int64) * snb + h.to(tl.int64) * snh + t64 * snt
    tl.store(n_rows, norm.to(n_ptr.dtype.element_ty), mask=tmask)


@triton.jit
def _load_rot(mat_ptr, sgn_ptr, D: tl.constexpr, ROT: tl.constexpr):
    d = tl.arange(0, D)
    if ROT == 1:
        r = tl.load(sgn_ptr + d)
    else:
        r = tl.load(mat_ptr + d[:, None] * D + d[None, :])  # (D, D) right operand, row-major
    return r


@triton.jit
def _quantize_kernel(
    x_ptr, sxb, sxh, sxt, sxd, p_ptr, spb, sph, spt, n_ptr, snb, snh, snt,
    mat_ptr, sgn_ptr, bnd_ptr, sbh, lut_ptr, slh, lo_ptr, invw_ptr, hsel, NLUT, H, T, inv_sqrt_d,
    n_t_tiles, n_tiles,
    D: tl.constexpr, LOG2D: tl.constexpr, BITS: tl.constexpr, BLOCK_T: tl.constexpr,
    ROT: tl.constexpr, XMODE: tl.constexpr, CLAMP_FP16: tl.constexpr, X_UNIT: tl.constexpr, SEARCH: tl.constexpr,
    STAGES: tl.constexpr,
):
    """Persistent: the rotation operand is loaded once, then the program walks tiles pid, pid + grid, ..."""
    rop = _load_rot(mat_ptr, sgn_ptr, D, ROT)
    for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), num_stages=STAGES):
        _quantize_tile(
            x_ptr, sxb, sxh, sxt, sxd, p_ptr, spb, sph, spt, n_ptr, snb, snh, snt,
            rop, bnd_ptr, sbh, lut_ptr, slh, lo_ptr, invw_ptr, hsel, NLUT,
            tile % n_t_tiles, tile // n_t_tiles, H, T, inv_sqrt_d,
            D, LOG2D, BITS, BLOCK_T, ROT, XMODE, CLAMP_FP16, X_UNIT, SEARCH,
        )


@triton.jit
def _quantize_kv_kernel(
    k_ptr, skb, skh, skt, skd, pk_ptr, spkb, spkh, spkt, nk_ptr, snkb, snkh, snkt,
    bndk_ptr, sbkh, lutk_ptr, slkh, lok_ptr, invwk_ptr, hselk, NLUTK,
    v_ptr, svb, svh, svt, svd, pv_ptr, spvb, spvh, spvt, nv_ptr, snvb, snvh, snvt,
    bndv_ptr, sbvh, lutv_ptr, slvh, lov_ptr, invwv_ptr, hselv, NLUTV,
    mat_ptr, sgn_ptr, H, T, inv_sqrt_d, n_t_tiles, n_tiles,
    D: tl.constexpr, LOG2D: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr, BLOCK_T: tl.constexpr,
    ROT: tl.constexpr, XMODE: tl.constexpr, CLAMP_FP16: tl.constexpr, K_UNIT: tl.constexpr, V_UNIT: tl.constexpr,
    KSEARCH: tl.constexpr, VSEARCH: tl.constexpr,
):
    """Keys and values of one layer in one launch (grid axis 1: 0 = keys, 1 = values); not persistent (decode)."""
    rop = _load_rot(mat_ptr, sgn_ptr, D, ROT)
    tile = tl.program_id(0)
    if tl.program_id(1) == 0:
        _quantize_tile(
            k_ptr, skb, skh, skt, skd, pk_ptr, spkb, spkh, spkt, nk_ptr, snkb, snkh, snkt,
            rop, bndk_ptr, sbkh, lutk_ptr, slkh, lok_ptr, invwk_ptr, hselk, NLUTK,
            tile % n_t_tiles, tile // n_t_tiles, H, T, inv_sqrt_d,
            D, LOG2D, KBITS, BLOCK_T, ROT, XMODE, CLAMP_FP16, K_UNIT, KSEARCH,
        )
    else:
        _quantize_tile(
            v_ptr, svb, svh, svt, svd, pv_ptr, spvb, spvh, spvt, nv_ptr, snvb, snvh, snvt,
            rop, bndv_ptr, sbvh, lutv_ptr, slvh, lov_ptr, invwv_ptr, hselv, NLUTV,
            tile % n_t_tiles, tile // n_t_tiles, H, T, inv_sqrt_d,
            D, LOG2D, VBITS, BLOCK_T, ROT, XMODE, CLAMP_FP16, V_UNIT, VSEARCH,
        )


def _modes(x_dtype: torch.dtype, rotation: Rotation, rot: str | None) -> tuple[int, int, torch.dtype]:
    """(ROT, XMODE, dtype of the matrix operand) for this input and rotation."""
    if rotation.kind != "hadamard":
        if rot == "fwht":
            raise ValueError("rot='fwht' needs a hadamard rotation")
        return C.ROT_DENSE, C.X_FP32, torch.float32
    if rot == "fwht":
        return C.ROT_FWHT, C.X_FP32, torch.float32
    if rot not in (None, "dot"):
        raise ValueError(f"rot must be None, 'dot' or 'fwht', got {rot!r}")
    if C.INTERPRET:  # the interpreter's bf16 dot multiplies raw bit patterns: use fp32 there
        return C.ROT_PM1_DOT, C.X_FP32, torch.float32
    if x_dtype == torch.float32:
        return C.ROT_PM1_DOT, C.X_SPLIT3, torch.bfloat16
    return C.ROT_PM1_DOT, C.X_NATIVE, x_dtype


SEARCHES = {"linear": 0, "lut": 1, "binary": 2}


def _search_args(codebook: Codebook, heads: int, dev, search: str | None) -> tuple[tuple, int]:
    """(bnd, sbh, lut, slh, lo, inv_w, hsel, NLUT) for the kernel, and the SEARCH mode."""
    if search is None:
        # measured on the H100 (benchmarks/results/bench_quantize.json, B=8 T=32768): at 4 bits the linear scan
        # ran at 651 GB/s and the table at 220; at 8 bits the table ran at 888 and the binary search at 220
        search = "linear" if codebook.bits <= 4 else "lut"
    if search not in SEARCHES:
        raise ValueError(f"search must be None or one of {sorted(SEARCHES)}, got {search!r}")
    _, bnd, _, sbh = C.codebook_tables(codebook, heads, dev)
    if search == "lut":
        t = C.search_lut(codebook, heads, dev)
        if t is None:  # boundaries too close (or tied) for a small table
            search = "binary"
        else:
            lut, bpad, lo, inv_w, n, slh = t
            return (bpad, bpad.stride(0) if codebook.per_head else 0, lut, slh, lo, inv_w, int(codebook.per_head), n), 1
    return (bnd, sbh, bnd, 0, bnd, bnd, 0, 1), SEARCHES[search]


def _check_x(where: str, x: torch.Tensor, rotation: Rotation, codebook: Codebook, packed_out, norms_out):
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        raise ValueError(f"{where}: x must be a (B, H, T, D) tensor, got shape {tuple(getattr(x, 'shape', ()))}")
    if x.dtype not in C.X_DTYPES:
        raise TypeError(f"{where}: x must be one of {C.X_DTYPES}, got {x.dtype}")
    bsz, heads, tokens, dim = x.shape
    bits, nbytes = C.check_common(where, rotation, codebook, dim)
    lead = (bsz, heads, tokens)
    C.check_device(f"{where}: x", x, x.device)
    C.check_device(f"{where}: packed_out", packed_out, x.device)
    C.check_device(f"{where}: norms_out", norms_out, x.device)
    C.check_packed(where, packed_out, lead, nbytes, dim, bits)
    C.check_norms(where, norms_out, lead)
    return bits


def _launch_cfg(tokens: int, block: int | None, num_warps: int | None) -> tuple[int, int]:
    bt = C.block_t(tokens) if block is None else block
    return bt, (num_warps if num_warps is not None else 4)


def quantize_into(
    x: torch.Tensor,
    rotation: Rotation,
    codebook: Codebook,
    packed_out: torch.Tensor,
    norms_out: torch.Tensor,
    *,
    rot: str | None = None,
    search: str | None = None,
    block_t: int | None = None,
    num_warps: int | None = None,
    progs_per_sm: int | None = None,
    stages: int = 1,
):
    """Quantize x (B, H, T, D) into packed_out (B, H, T, nbytes) uint8 and norms_out (B, H, T), in place.

    rot / search / block_t / num_warps / progs_per_sm (0: one program per tile) / stages override the defaults (for the benchmark); the cache never passes them.
    Returns the launched kernel handle (its n_regs / n_spills), or None when there was nothing to do.
    """
    bits = _check_x("quantize_into", x, rotation, codebook, packed_out, norms_out)
    bsz, heads, tokens, dim = x.shape
    if x.numel() == 0:
        return None
    dev = x.device
    rmode, xmode, mdtype = _modes(x.dtype, rotation, rot)
    sargs, smode = _search_args(codebook, heads, dev, search)
    bnd = sargs[0]
    # the unused one of (matrix, signs) gets any valid pointer: its branch is compiled out
    if rmode == C.ROT_FWHT:
        mat, sgn = bnd, C.rotation_operand(rotation, dev, "signs", torch.float32)
    else:
        mat, sgn = C.rotation_operand(rotation, dev, "fwd", mdtype), bnd
    bt, nw = _launch_cfg(tokens, block_t, num_warps)
    n_t = triton.cdiv(tokens, bt)
    n_tiles = n_t * bsz * heads
    grid = (C.persistent_grid(n_tiles, dev, progs_per_sm),)
    return _quantize_kernel[grid](
        x, *x.stride(),
        packed_out, *packed_out.stride()[:3],
        norms_out, *norms_out.stride(),
        mat, sgn, *sargs,
        heads, tokens, dim**-0.5, n_t, n_tiles,
        D=dim, LOG2D=dim.bit_length() - 1, BITS=bits, BLOCK_T=bt,
        ROT=rmode, XMODE=xmode, CLAMP_FP16=norms_out.dtype == torch.float16, X_UNIT=x.stride(-1) == 1,
        SEARCH=smode, STAGES=stages,
        num_warps=nw,
    )


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
    *,
    block_t: int | None = None,
    num_warps: int | None = None,
):
    """`quantize_into` for keys and values of one layer in a single launch (the per-decode-step path)."""
    kbits = _check_x("quantize_kv_into (keys)", k, rotation, k_codebook, k_packed, k_norms)
    vbits = _check_x("quantize_kv_into (values)", v, rotation, v_codebook, v_packed, v_norms)
    if k.shape != v.shape or k.dtype != v.dtype or k.device != v.device:
        raise ValueError(
            f"quantize_kv_into: keys {tuple(k.shape)} {k.dtype} {k.device} and values "
            f"{tuple(v.shape)} {v.dtype} {v.device} must match in shape, dtype and device"
        )
    if k_norms.dtype != v_norms.dtype:
        raise TypeError(f"quantize_kv_into: key norms are {k_norms.dtype}, value norms {v_norms.dtype}; use one dtype")
    bsz, heads, tokens, dim = k.shape
    if k.numel() == 0:
        return None
    dev = k.device
    rmode, xmode, mdtype = _modes(k.dtype, rotation, None)
    mat = C.rotation_operand(rotation, dev, "fwd", mdtype)
    kargs, kmode = _search_args(k_codebook, heads, dev, None)
    vargs, vmode = _search_args(v_codebook, heads, dev, None)
    bt, nw = _launch_cfg(tokens, block_t, num_warps)
    n_t = triton.cdiv(tokens, bt)
    grid = (n_t * bsz * heads, 2)
    return _quantize_kv_kernel[grid](
        k, *k.stride(), k_packed, *k_packed.stride()[:3], k_norms, *k_norms.stride(), *kargs,
        v, *v.stride(), v_packed, *v_packed.stride()[:3], v_norms, *v_norms.stride(), *vargs,
        mat, mat, heads, tokens, dim**-0.5, n_t, n_t * bsz * heads,
        D=dim, LOG2D=dim.bit_length() - 1, KBITS=kbits, VBITS=vbits, BLOCK_T=bt,
        ROT=rmode, XMODE=xmode, CLAMP_FP16=k_norms.dtype == torch.float16,
        K_UNIT=k.stride(-1) == 1, V_UNIT=v.stride(-1) == 1, KSEARCH=kmode, VSEARCH=vmode,
        num_warps=nw,
    )
