"""Shared pieces of the quantize/dequantize launchers: input checks, rotation operands and codebook tables (held by
the rotation / codebook they derive from: `derived`), block sizes.

Kept free of kernel code so that the checks stay readable and both launchers raise the same errors.
"""

from __future__ import annotations

import functools
import math
import os

import torch

from ..quant.codebook import Codebook
from ..quant.packing import packed_bytes
from ..quant.rotation import Rotation

import triton  # noqa: E402  (the package imports this module only after checking triton imports)
import triton.language as tl  # noqa: E402

try:  # triton >= 3.4 exposes its settings as knobs; the env var is what older ones read
    INTERPRET = bool(triton.knobs.runtime.interpret)
except AttributeError:  # pragma: no cover
    INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

from .support import SUPPORTED_BITS, SUPPORTED_DIMS, WIDE_DIM, WIDE_QUANTIZE_BITS, supports  # noqa: E402

X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
NORM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# rotation modes (constexpr ROT in the kernels)
ROT_PM1_DOT = 0  # tensor-core dot against sqrt(D) * Pi, whose entries are exactly +-1 (hadamard)
ROT_DENSE = 2  # fp32 dot against Pi (orthogonal rotations, whose entries no 16-bit type holds)

# how a quantize kernel feeds x to a +-1 dot (constexpr XMODE)
X_NATIVE = 0  # fp16/bf16 x is exact in its own type: one 16-bit dot, fp32 accumulate
X_FP32 = 1  # fp32 operands, ieee dot (interpreter, whose bf16 dot is broken; orthogonal rotations)
X_SPLIT3 = 2  # fp32 x split into three bf16 terms that sum to x exactly: three bf16 dots


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def block_t(tokens: int, cap: int = 64) -> int:
    """Tokens per program: 16 is the smallest tl.dot tile; 64 keeps a (64, D) fp32 tile in registers."""
    return max(16, min(cap, next_pow2(tokens)))


PROGS_PER_SM = 2
_SM_COUNT: dict = {}


def persistent_grid(n_tiles: int, device: torch.device, progs_per_sm: int | None = None) -> int:
    """Programs for a persistent launch: a few per SM (0 = one per tile, the plain grid)."""
    per = PROGS_PER_SM if progs_per_sm is None else progs_per_sm
    if per == 0:
        return n_tiles
    if device.type != "cuda":
        return min(n_tiles, 4)  # interpreter: a few programs, so the tile loop runs more than once
    sms = _SM_COUNT.get(device.index)
    if sms is None:
        sms = _SM_COUNT[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(n_tiles, sms * per))


def mma_column_order(dim: int) -> torch.Tensor:
    """The coordinate each dot output column computes: column 8j + 2q + e -> q * dim/4 + 2j + e.

    In the tensor-core accumulator layout (Hopper wgmma and Ampere mma alike) lane q = lane % 4 of a row's quad
    owns columns {8j + 2q + e}; with this order those are dim/4 consecutive coordinates."""
    n = torch.arange(dim)
    return (n % 8 // 2) * (dim // 4) + (n // 8) * 2 + n % 2


def rotation_operand(rotation: Rotation, device: torch.device, what: str, dtype: torch.dtype) -> torch.Tensor:
    """Device copy of one rotation operand, built once per (device, what, dtype) and held by the rotation.

    what: "fwd" = the (D, D) right operand of y_row = x_row @ Pi^T; "fwd_mma" = the same with its columns in
    mma_column_order(D); "inv" = that of out_row = c_row @ Pi. For hadamard they are scaled by sqrt(D) so every
    entry is exactly +-1 (then a 16-bit dot of 16-bit data is exact up to fp32 accumulation); the kernels apply
    1/sqrt(D).
    """
    return rotation.derived.get(("rotation_operand", torch.device(device), what, dtype),
                                lambda: _rotation_operand(rotation, device, what, dtype))


def _rotation_operand(rotation: Rotation, device: torch.device, what: str, dtype: torch.dtype) -> torch.Tensor:
    if what not in ("fwd", "fwd_mma", "inv"):
        raise ValueError(f"rotation operand must be 'fwd', 'fwd_mma' or 'inv', got {what!r}")
    pi = rotation.matrix.detach().to("cpu", torch.float64)
    m = pi.T if what in ("fwd", "fwd_mma") else pi
    if what == "fwd_mma":
        m = m[:, mma_column_order(rotation.dim)]
    if rotation.kind == "hadamard":
        s = m * math.sqrt(rotation.dim)
        r = s.round()
        if not (bool((r.abs() == 1).all()) and float((s - r).abs().max()) < 1e-4):
            raise ValueError("a hadamard rotation's sqrt(D) * Pi should hold only +-1 entries")
        m = r
    return m.to(device=device, dtype=dtype).contiguous()


def codebook_tables(codebook: Codebook, heads: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(centroids, boundaries, centroid head stride, boundary head stride) as fp32 on `device`; shared -> stride 0."""
    c, b = codebook.centroids, codebook.boundaries
    if c.device != device or b.device != device:
        raise ValueError(f"the codebook lives on {c.device}, the data on {device}: call codebook.to(device) first")
    k = 2**codebook.bits
    if c.shape[-1] != k or b.shape[-1] != k - 1:
        raise ValueError(
            f"a {codebook.bits}-bit codebook needs {k} centroids and {k - 1} boundaries, "
            f"got shapes {tuple(c.shape)} and {tuple(b.shape)}"
        )
    if codebook.per_head and c.shape[0] != heads:
        raise ValueError(f"the per-head codebook has {c.shape[0]} heads, the data has {heads}")
    c = c.to(torch.float32).contiguous()
    b = b.to(torch.float32).contiguous()
    if codebook.per_head:
        return c, b, c.stride(0), b.stride(0)
    return c, b, 0, 0


def check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} like the other tensors")
    if not INTERPRET and t.device.type != "cuda":
        raise ValueError(f"{name} is on {t.device}; the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1)")


def check_common(
    where: str, rotation: Rotation, codebook: Codebook, dim: int, quantize: bool = True
) -> tuple[int, int]:
    bits = codebook.bits
    if not supports(dim, bits, rotation.kind, quantize):
        raise ValueError(
            f"{where}: head dim {dim} with {bits} bits and a {rotation.kind} rotation is not supported by the kernels "
            f"(head dims {SUPPORTED_DIMS}, bits {SUPPORTED_BITS[0]}..{SUPPORTED_BITS[-1]}; head dim {WIDE_DIM} with "
            f"a hadamard rotation, quantize at 1..{WIDE_QUANTIZE_BITS} bits); use the reference"
        )
    if rotation.dim != dim:
        raise ValueError(f"{where}: the rotation is for head dim {rotation.dim}, the data has head dim {dim}")
    return bits, packed_bytes(dim, bits)


def check_packed(where: str, packed: torch.Tensor, lead: tuple, nbytes: int, dim: int, bits: int) -> None:
    if packed.dtype != torch.uint8:
        raise TypeError(f"{where}: packed indices must be uint8, got {packed.dtype}")
    if packed.dim() != 4 or tuple(packed.shape) != (*lead, nbytes):
        raise ValueError(
            f"{where}: packed must have shape {(*lead, nbytes)} (dim={dim}, bits={bits}), got {tuple(packed.shape)}"
        )
    if nbytes > 1 and packed.stride(-1) != 1:
        raise ValueError(f"{where}: packed must be contiguous in its last dim, got stride {packed.stride(-1)}")


def check_norms(where: str, norms: torch.Tensor, lead: tuple) -> None:
    if norms.dtype not in NORM_DTYPES:
        raise TypeError(f"{where}: norms must be one of {NORM_DTYPES}, got {norms.dtype}")
    if tuple(norms.shape) != tuple(lead):
        raise ValueError(f"{where}: norms must have shape {tuple(lead)}, got {tuple(norms.shape)}")


def _per_codebook_and_device(build):
    """build(codebook, heads, device), made once per device and held by the codebook (`codebook.derived`, which its
    copies on other devices share, as do all copies of a theoretical codebook): the tables are read on the host once.
    The tables depend on the heads only through the codebook (one row per head of a per-head codebook)."""
    name = f"{build.__module__}.{build.__qualname__}"

    @functools.wraps(build)
    def cached(codebook: Codebook, heads: int, device: torch.device):
        key = torch.device(device)
        return codebook.derived.get((name, key), lambda: build(codebook, heads, key))

    return cached


LUT_MAX_CELLS = 4096


@_per_codebook_and_device
def search_lut(codebook: Codebook, heads: int, device: torch.device):
    """A uniform-grid table that turns the boundary search into two gathers, or None when the grid would be too fine.

    Cells are half the smallest boundary gap wide, so a cell widened by a 1% margin on each side holds at most one
    boundary. lut[j] counts the boundaries below cell j's start minus the margin; then for y in cell j the answer is
    lut[j] + (y > b[lut[j]]), exactly, whatever fp32 rounding does to j (far less than the margin). Returns
    (lut uint8 (H', N), padded boundaries fp32 (H', 2**bits) ending in +inf, lo (H',), inv_w (H',), N, head stride).
    """
    b = codebook.boundaries.detach().to("cpu", torch.float64).reshape(-1, 2**codebook.bits - 1)
    gaps = b[:, 1:] - b[:, :-1]
    res = None
    if b.shape[1] >= 2 and bool((gaps > 0).all()):
        w = gaps.min(dim=1).values / 2
        lo = b[:, 0].float().double()  # the kernel subtracts the fp32 value
        inv_w = (1 / w).float().double()
        w_eff = 1 / inv_w  # the width the kernel's fp32 inv_w really encodes
        n = int(((b[:, -1] - lo) * inv_w).ceil().max()) + 2
        if n <= LUT_MAX_CELLS:
            starts = lo[:, None] + torch.arange(n, dtype=torch.float64)[None, :] * w_eff[:, None]
            lut = (b[:, None, :] < (starts - 0.01 * w_eff[:, None])[:, :, None]).sum(-1)
            bpad = torch.cat([b, torch.full((b.shape[0], 1), float("inf"), dtype=torch.float64)], dim=1)
            res = (
                lut.to(torch.uint8).contiguous().to(device),
                bpad.float().contiguous().to(device),
                lo.float().to(device),
                inv_w.float().to(device),
                n,
                n if codebook.per_head else 0,
            )
    return res


def _positive_boundaries(codebook: Codebook) -> torch.Tensor:
    """(H', 2**(bits-1) - 1) fp32 on the host: the boundaries above the middle one (0 in a symmetric codebook)."""
    half = 2 ** (codebook.bits - 1)
    return codebook.boundaries.detach().to("cpu", torch.float32).reshape(-1, 2 * half - 1)[:, half:]


@_per_codebook_and_device
def sat_table(codebook: Codebook, heads: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """Per head [-B_0 K, ..., -B_{m-1} K, K] over the m = 2**(bits-1) - 1 positive boundaries of a symmetric codebook.

    K = 2**k is chosen so that K * (|y| - B_j), rounded, is >= 2 whenever |y| > B_j (the gap is at least one ulp of the
    smallest positive boundary) and <= -2 whenever |y| < B_j; so min(max(|y| K - B_j K, 0), 1), one saturated FMA, is
    exactly [|y| > B_j]. Both products are exact (K is a power of two). Returns the table and its head stride.
    """
    pos = _positive_boundaries(codebook)
    if pos.numel():
        _, e = torch.frexp(pos.min())  # min = m 2**e, m in [0.5, 1): its ulp is 2**(e - 24)
        k = 2.0 ** (25 - int(e))
    else:
        k = 1.0
    tab = torch.cat([-pos.double() * k, torch.full((pos.shape[0], 1), k, dtype=torch.float64)], dim=1).float()
    return tab.contiguous().to(device), tab.shape[1] if codebook.per_head else 0


POLY_DEG = 5
POLY_MARGIN = 0.05


def _horner(coef: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    f = torch.zeros_like(t)
    for c in coef.tolist():
        f = f * t + c
    return f


def _poly_ok(coef: torch.Tensor, pos: torch.Tensor, margin: float) -> bool:
    """Whether trunc(F(min(a, hi))) is c(a) - 1 or c(a) for every a >= 0 (c(a): boundaries strictly below a).

    That holds iff F lies in [c - 1, c + 1) on each cell (in (-1, 1) below the first boundary) and in [m - 1, m) at
    hi, the last of the m boundaries. Checked with `margin` to spare at every boundary, one fp32 step either side of
    it, and on a grid fine enough that F cannot move by the margin between two samples. pos: fp32 values, float64."""
    m, hi = pos.numel(), float(pos[-1])
    deriv = coef[:-1] * torch.arange(coef.numel() - 1, 0, -1, dtype=torch.float64)
    slope = float(_horner(deriv, torch.linspace(0.0, hi, 4097, dtype=torch.float64)).abs().max())
    n = int(min(max(1.5 * slope * hi / margin, 65536), 1 << 22)) + 1
    p32 = pos.float()
    a = torch.cat([torch.linspace(0.0, hi, n, dtype=torch.float64).float(), p32,
                   torch.nextafter(p32, torch.full_like(p32, math.inf)), torch.nextafter(p32, torch.zeros_like(p32))])
    a = torch.minimum(a, p32[-1])
    f = _horner(coef, a.double())
    c = torch.searchsorted(pos, a.double(), right=False).double()  # boundaries strictly below a
    lo = torch.where(a == p32[-1], m - 1.0, torch.where(c == 0, -1.0, c - 1.0)) + margin
    return bool(((f >= lo) & (f < c + 1.0 - margin)).all())


@_per_codebook_and_device
def poly_table(codebook: Codebook, heads: int, device: torch.device):
    """The 'poly' search table of a symmetric codebook, or None when no degree-POLY_DEG polynomial fits it.

    Over the m = 2**(bits-1) - 1 positive boundaries P_j, a polynomial F of u = min(|y|, P_{m-1}) follows the count of
    boundaries below |y| closely enough (`_poly_ok`) that g = trunc(F) is that count or one less; the count is then
    g + (|y| > P_g): one gather instead of the table's two. Lloyd-Max codebooks are smooth in j: degree 5 is within
    ~0.2 of an index at 8 bits. Per head, fp32: [F's coefficients (highest first), P_{m-1}, P_0 .. P_{m-1}].
    Returns (table, head stride), or None.
    """
    rows = []
    for pos in _positive_boundaries(codebook).double():
        if pos.numel() < 2 or not bool((pos.diff() > 0).all()) or float(pos[0]) <= 0:
            return None
        hi = float(pos[-1])
        # least squares on the piecewise-linear count through (0, 0) and (P_j, j + 1/2), reweighted towards minimax;
        # fitted in t = u / hi (well conditioned), evaluated in u
        xs = torch.linspace(0.0, hi, 8193, dtype=torch.float64)
        knots = torch.cat([torch.zeros(1, dtype=torch.float64), pos])
        vals = torch.cat([torch.zeros(1, dtype=torch.float64), torch.arange(pos.numel(), dtype=torch.float64) + 0.5])
        j = torch.searchsorted(knots, xs, right=True).clamp(1, knots.numel() - 1)
        frac = (xs - knots[j - 1]) / (knots[j] - knots[j - 1])
        target = vals[j - 1] + frac * (vals[j] - vals[j - 1])
        powers = torch.arange(POLY_DEG, -1, -1, dtype=torch.float64)
        v = (xs[:, None] / hi) ** powers
        w = torch.ones_like(xs)
        for _ in range(40):
            coef = torch.linalg.lstsq(v * w[:, None], (target * w)[:, None]).solution[:, 0]
            err = (v @ coef - target).abs()
            w = w * (1 + err / err.max().clamp_min(1e-30))
        coef = (coef / hi**powers).float().double()
        if not _poly_ok(coef, pos, POLY_MARGIN):
            return None
        rows.append(torch.cat([coef, torch.tensor([hi], dtype=torch.float64), pos]))
    tab = torch.stack(rows).float().contiguous()
    return tab.to(device), tab.shape[1] if codebook.per_head else 0


_PTX_GATHER: tl.constexpr = tl.constexpr(not INTERPRET)


@triton.jit
def gather(base, offs):
    """tl.load(base + offs) for a gather (no mask) from a small L1-resident fp32 or uint8 table (uint8 comes back as
    int32), kept in the layout of `offs`: base is a scalar pointer, offs a non-negative int32 tile.

    A tl.load of a pointer tile is re-laid out by Triton's coalescing pass (a blocked layout), costing two layout
    conversions through shared memory when the tile lives in the MMA layout: more than all the rest of the quantize
    kernel at 8 bits. An elementwise inline PTX load has no layout of its own; it forms the address from the
    32-bit offset itself (ptxas emits two LEAs for the mad.wide). The interpreter takes tl.load."""
    if _PTX_GATHER:
        if base.dtype.element_ty == tl.float32:
            out = tl.inline_asm_elementwise(
                "{ .reg .u64 a; mad.wide.u32 a, $1, 4, $2; ld.global.nc.f32 $0, [a]; }", "=r,r,l", [offs, base],
                dtype=tl.float32, is_pure=True, pack=1)
        else:
            tl.static_assert(base.dtype.element_ty == tl.uint8, "gather serves fp32 and uint8 tables")
            out = tl.inline_asm_elementwise(
                "{ .reg .u64 a; mad.wide.u32 a, $1, 1, $2; ld.global.nc.u8 $0, [a]; }", "=r,r,l", [offs, base],
                dtype=tl.int32, is_pure=True, pack=1)
    else:
        out = tl.load(base + offs)
        if base.dtype.element_ty == tl.uint8:
            out = out.to(tl.int32)
    return out


def rows_aligned(packed: torch.Tensor, unit: int = 4) -> bool:
    """Whether every packed row of a (B, H, T, bytes) buffer starts on a `unit`-byte boundary, so that a kernel may
    read (`load_groups`) or write it in whole words."""
    return packed.data_ptr() % unit == 0 and all(
        st % unit == 0 for st, n in zip(packed.stride()[:3], packed.shape[:3]) if n > 1
    )


@triton.jit
def load_groups(rows, ok, BITS: tl.constexpr, D: tl.constexpr, WORDS: tl.constexpr, COLS: tl.constexpr):
    """The packed groups of 8 indices (BITS bytes each, packing.py's LSB-first layout) of the rows at uint8
    pointers `rows` (BLOCK,), as an int64 (BLOCK, COLS) tile. COLS >= D // 8 (a power of two); columns past D // 8
    read as 0, so that a tile can be padded to the 16 columns of a dot. Dequantize reads every width but 8 this way
    (its int32 words of four 8-bit indices are faster: benchmarks/results/bench_attention_dequant_h100.json).

    WORDS, the unit the rows start on (`rows_aligned`): 4, a group is cut from the int32 words it overlaps (one at 1,
    2 and 4 bits; two at 3, 5, 6 and 8; two or three at 7); 8, from the one or two int64 words it overlaps (for the
    group widths 3, 5, 6 and 7); 0, the bytes are assembled. Bits past a group's 8 * BITS may be set;
    `expand_groups` masks them off."""
    col = tl.arange(0, COLS)
    live = ok[:, None] & (col < D // 8)[None, :]
    if WORDS == 8:
        tl.static_assert(BITS == 3 or BITS == 5 or BITS == 6 or BITS == 7, "int64 words serve the group widths")
        wrows = rows.to(tl.pointer_type(tl.int64), bitcast=True)
        bit0 = col * (8 * BITS)
        j0 = bit0 // 64
        s = bit0 % 64
        w0 = tl.load(wrows[:, None] + j0[None, :], mask=live, other=0).to(tl.uint64, bitcast=True)
        two = live & ((s + 8 * BITS) > 64)[None, :]
        w1 = tl.load(wrows[:, None] + j0[None, :] + 1, mask=two, other=0).to(tl.uint64, bitcast=True)
        # logical shifts; w1 is 0 where the group ends in w0, so the (64 - s) % 64 shift of s = 0 adds nothing
        v = ((w0 >> s.to(tl.uint64)[None, :]) | (w1 << ((64 - s) % 64).to(tl.uint64)[None, :])).to(tl.int64,
                                                                                                  bitcast=True)
    elif WORDS and (BITS == 1 or BITS == 2 or BITS == 4):  # a group is a quarter, half or whole word
        wrows = rows.to(tl.pointer_type(tl.int32), bitcast=True)
        w0 = tl.load(wrows[:, None] + (col * BITS // 4)[None, :], mask=live, other=0)
        v = (w0.to(tl.int64) & 0xFFFFFFFF) >> ((col * 8 * BITS) % 32).to(tl.int64)[None, :]
    elif WORDS:
        wrows = rows.to(tl.pointer_type(tl.int32), bitcast=True)
        bit0 = col * (8 * BITS)
        j0 = bit0 // 32
        s = (bit0 % 32).to(tl.int64)[None, :]
        w0 = tl.load(wrows[:, None] + j0[None, :], mask=live, other=0)
        w1 = tl.load(wrows[:, None] + j0[None, :] + 1, mask=live & ((bit0 % 32 + 8 * BITS) > 32)[None, :], other=0)
        v = ((w1.to(tl.int64) << 32) | (w0.to(tl.int64) & 0xFFFFFFFF)) >> s  # bits from 64 - s on: w1's sign
        if BITS == 7:  # groups starting 16 or 24 bits into a word end in a third one
            third = (bit0 % 32 + 8 * BITS) > 64
            w2 = tl.load(wrows[:, None] + j0[None, :] + 2, mask=live & third[None, :], other=0)
            top = tl.where(third[None, :], 64 - s, 63)  # < 64: a shift by the width is undefined
            v = (v & ((tl.full(top.shape, 1, tl.int64) << top) - 1)) | ((w2.to(tl.int64) & 0xFFFFFFFF) << top)
    else:
        grp = rows[:, None] + (col * BITS)[None, :]
        v = tl.load(grp, mask=live, other=0).to(tl.int64)
        for j in tl.static_range(1, BITS):
            v = v | (tl.load(grp + j, mask=live, other=0).to(tl.int64) << (8 * j))
    return v


@triton.jit
def expand_groups(v, BITS: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
    """(BLOCK, D) int32 indices from `load_groups`' groups: the join tree puts index j of a group at position j."""
    m = (1 << BITS) - 1
    e = tl.join(tl.join(v & m, (v >> (4 * BITS)) & m), tl.join((v >> (2 * BITS)) & m, (v >> (6 * BITS)) & m))
    o = tl.join(tl.join((v >> BITS) & m, (v >> (5 * BITS)) & m), tl.join((v >> (3 * BITS)) & m, (v >> (7 * BITS)) & m))
    return tl.reshape(tl.join(e, o), (BLOCK, D)).to(tl.int32)
