"""The Triton quantize/dequantize kernels against the torch reference (the oracle).

Runs the compiled kernels on CUDA when present, else the Triton interpreter on CPU (TRITON_INTERPRET=1 is
set here, before triton is imported). Every case draws a fresh seed (printed on failure), writes into poisoned
strided slices of bigger buffers, and checks that every slot of the slice was written and nothing outside it.

Indices may legitimately differ from the reference where a rotated coordinate sits within float rounding of a
codebook boundary (the kernel rotates by a dot, the reference by butterflies): each mismatch must be such a
case (adjacent cells, coordinate within 1e-5 of the boundary between them), and they must be rare.
"""

from __future__ import annotations

import math
import os
import warnings

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

triton = pytest.importorskip("triton", reason="triton is not installed: the kernel tests need it")

from tq_hf_cache import kernels, ops, reference  # noqa: E402
from tq_hf_cache.quant.codebook import Codebook, theoretical_codebook  # noqa: E402
from tq_hf_cache.kernels import _common  # noqa: E402
from tq_hf_cache.quant.packing import packed_bytes, unpack_indices  # noqa: E402
from tq_hf_cache.quant.rotation import make_rotation  # noqa: E402

DEV = torch.device("cuda" if CUDA else "cpu")
if not CUDA and not _common.INTERPRET:
    pytest.skip(
        "tq_hf_cache.kernels was imported without TRITON_INTERPRET=1 and there is no CUDA: "
        "run this module in its own pytest process or export TRITON_INTERPRET=1",
        allow_module_level=True,
    )

PAD_BYTE = (0x5A, 0xA5)  # two sentinels: a byte the kernel did not write keeps its sentinel, so the runs differ
NORM_DTYPES = {"fp16": torch.float16, "fp32": torch.float32}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def fresh_gen() -> tuple[int, torch.Generator]:
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return seed, g


def make_x(g, b, h, t, d, dtype, scale=1.0, lead=2, tail=3):
    """A non-contiguous (B, H, T, D) slice along T of a bigger random tensor, with varied per-vector scales."""
    big = torch.randn(b, h, lead + t + tail, d, generator=g) * scale
    big = big * torch.rand(b, h, lead + t + tail, 1, generator=g).add(0.05) * 4
    return big.to(dtype).to(DEV)[:, :, lead : lead + t]


def shared_codebook(bits, d) -> Codebook:
    return theoretical_codebook(bits, d)


def per_head_codebook(g, bits, heads, d) -> Codebook:
    base = shared_codebook(bits, d).centroids
    jitter = 1 + 0.3 * torch.rand(heads, 2**bits, generator=g)
    return Codebook.from_centroids(base.unsqueeze(0) * jitter, bits)


NORM_POISON = -7.0  # no norm is negative; NaN would not do: a NaN input's norm is NaN


def quantize_poisoned(x, rotation, cb, norm_dtype, **kw):
    """Run the kernel twice into slices [2, 2+T) of buffers poisoned with two sentinels; return packed, norms."""
    b, h, t, d = x.shape
    nb = packed_bytes(d, cb.bits)
    outs = []
    for pad in PAD_BYTE:
        pbig = torch.full((b, h, t + 5, nb), pad, dtype=torch.uint8, device=DEV)
        nbig = torch.full((b, h, t + 5), NORM_POISON, dtype=norm_dtype, device=DEV)
        kernels.quantize_into(x, rotation, cb, pbig[:, :, 2 : 2 + t], nbig[:, :, 2 : 2 + t], **kw)
        outside = torch.cat([pbig[:, :, :2], pbig[:, :, 2 + t :]], dim=2)
        assert (outside == pad).all(), "quantize wrote packed bytes outside its slice"
        assert (torch.cat([nbig[:, :, :2], nbig[:, :, 2 + t :]], dim=2) == NORM_POISON).all(), "norm written outside slice"
        assert not (nbig[:, :, 2 : 2 + t] == NORM_POISON).any(), "some norms were not written"
        outs.append((pbig[:, :, 2 : 2 + t], nbig[:, :, 2 : 2 + t]))
    assert torch.equal(outs[0][0], outs[1][0]), "some packed bytes were not written (they kept the sentinel)"
    return outs[0]


def check_indices(x, rot, cb, packed, seed):
    """Every index equals the reference's, except rare near-boundary ties between adjacent cells."""
    d = x.shape[-1]
    ref_p, _ = reference.quantize(x, rot, cb)
    got, want = unpack_indices(packed, cb.bits, d), unpack_indices(ref_p, cb.bits, d)
    bad = got != want
    n_bad = int(bad.sum())
    if n_bad:
        xf = x.float()
        y = rot.forward(xf / xf.norm(dim=-1, keepdim=True).clamp_min(1e-30))
        bnd = cb.boundaries.to(DEV)
        if cb.per_head:
            bnd_at = bnd[torch.arange(x.shape[1], device=DEV).view(1, -1, 1, 1).expand_as(got)[bad], torch.minimum(got, want)[bad]]
        else:
            bnd_at = bnd[torch.minimum(got, want)[bad]]
        assert ((got - want)[bad].abs() == 1).all(), f"seed {seed}: non-adjacent index mismatch"
        gap = (y[bad] - bnd_at).abs()
        assert (gap < 1e-5).all(), f"seed {seed}: index mismatch {gap.max():.3g} away from a boundary"
    assert n_bad <= 1 + 1e-3 * got.numel(), f"seed {seed}: {n_bad} of {got.numel()} indices differ"
    return ref_p


def check_norms(x, norms, seed):
    want = reference.store_norm(x.float().norm(dim=-1), norms.dtype).float()
    rtol = 1e-3 if norms.dtype == torch.float16 else 1e-5
    torch.testing.assert_close(norms.float(), want, rtol=rtol, atol=0, msg=lambda m: f"seed {seed}: norms: {m}")


def dequantize_poisoned(packed, norms, rotation, cb, dtype, layout="bhtd", **kw):
    """Dequantize into a NaN-poisoned slice [1, 1+T) of a bigger workspace in the given memory layout."""
    b, h, t, _ = packed.shape
    d = rotation.dim
    if layout == "bhtd":
        big = torch.full((b, h, t + 3, d), float("nan"), dtype=dtype, device=DEV)
    else:  # (B, T, H, D) memory, seen as (B, H, T, D): strided along H and T
        big = torch.full((b, t + 3, h, d), float("nan"), dtype=dtype, device=DEV).transpose(1, 2)
    out = big[:, :, 1 : 1 + t]
    kernels.dequantize_into(packed, norms, rotation, cb, out, **kw)
    assert not torch.isnan(out).any(), "some outputs were not written"
    assert torch.isnan(big[:, :, :1]).all() and torch.isnan(big[:, :, 1 + t :]).all(), "wrote outside out's slice"
    return out


def check_dequant(out, packed, norms, rot, cb, seed):
    want = reference.dequantize(packed, norms, rot, cb, torch.float32)
    rms = float(want.pow(2).mean().sqrt()) + 1e-30
    # fp32: a 128-term sum in another order (dot vs butterflies) differs by a few 1e-6 where terms cancel;
    # 16-bit outputs: about one ulp of the output dtype
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[out.dtype]
    torch.testing.assert_close(
        out.float(), want.to(out.dtype).float(), rtol=tol, atol=tol * rms, msg=lambda m: f"seed {seed}: {m}"
    )


# (bits, head dim, x dtype, (B, H, T), norm dtype, per-head codebook, out layout)
CASES = [
    (1, 64, "fp32", (1, 1, 1), "fp32", False, "bhtd"),
    (2, 128, "bf16", (1, 3, 7), "fp16", False, "bthd"),
    (3, 128, "fp16", (3, 1, 33), "fp16", True, "bhtd"),
    (4, 64, "bf16", (1, 3, 33), "fp16", False, "bhtd"),
    (5, 64, "fp16", (3, 3, 7), "fp32", True, "bthd"),
    (6, 128, "fp32", (1, 1, 7), "fp16", False, "bhtd"),
    (7, 64, "bf16", (1, 1, 33), "fp16", False, "bhtd"),
    (8, 128, "bf16", (3, 1, 7), "fp16", True, "bthd"),
    (8, 64, "fp32", (1, 3, 1), "fp32", False, "bhtd"),
    (4, 128, "fp32", (1, 1, 7), "fp32", True, "bthd"),
    (2, 256, "bf16", (1, 1, 33), "fp16", False, "bhtd"),  # Gemma 3's head dim (Hadamard: make_rotation's default)
    (4, 256, "fp32", (1, 2, 7), "fp32", True, "bthd"),
]


@pytest.mark.parametrize("bits,d,dt,shape,nd,per_head,layout", CASES)
def test_quantize_and_dequantize_match_reference(bits, d, dt, shape, nd, per_head, layout):
    seed, g = fresh_gen()
    rot = make_rotation(d, seed % 1000).to(DEV)
    cb = (per_head_codebook(g, bits, shape[1], d) if per_head else shared_codebook(bits, d)).to(DEV)
    x = make_x(g, *shape, d, DTYPES[dt])
    packed, norms = quantize_poisoned(x, rot, cb, NORM_DTYPES[nd])
    ref_p = check_indices(x, rot, cb, packed, seed)
    check_norms(x, norms, seed)
    # what the cache returns: the kernel's packed data, dequantized, is the reference's (on vectors without a tie:
    # one tied coordinate, checked above, moves its vector by a whole centroid gap)
    a = reference.dequantize(packed, norms, rot, cb)
    b_ = reference.dequantize(ref_p, reference.store_norm(x.float().norm(dim=-1), norms.dtype), rot, cb)
    same = (unpack_indices(packed, bits, d) == unpack_indices(ref_p, bits, d)).all(-1)
    assert float((a - b_)[same].norm() / b_[same].norm().clamp_min(1e-30)) < 1e-3, f"seed {seed}"
    # dequantize the reference's packed data into every model dtype
    for out_dt in (torch.float32, torch.float16, torch.bfloat16):
        out = dequantize_poisoned(ref_p, norms, rot, cb, out_dt, layout)
        check_dequant(out, ref_p, norms, rot, cb, seed)


@pytest.mark.parametrize("bits,per_head", [(2, False), (3, False), (4, False), (5, True), (6, False), (8, False)])
def test_search_modes_agree(bits, per_head):
    """Every search that serves the codebook gives the same indices on random data, except that 'sat' and 'poly' file
    a y exactly on a negative boundary in the cell above it (the others below it; both centroids are equally near).
    Random data hits such a tie about once in a thousand runs, so a difference is allowed only there: one cell up, on
    the negative side, where y is within a few ulps of that boundary."""
    seed, g = fresh_gen()
    rot = make_rotation(64, seed % 1000).to(DEV)
    cb = (per_head_codebook(g, bits, 3, 64) if per_head else shared_codebook(bits, 64)).to(DEV)
    x = make_x(g, 1, 3, 7, 64, torch.bfloat16)
    modes = ("lut", "linear", "binary") + ((("sat",) if bits <= 4 else ("poly",)) if not per_head else ())
    packed = {m: quantize_poisoned(x, rot, cb, torch.float16, search=m)[0] for m in modes}
    got = {m: unpack_indices(p, bits, 64) for m, p in packed.items()}
    for m in ("linear", "binary"):
        assert torch.equal(got["lut"], got[m]), f"seed {seed}: {m} differs from lut"
    for m in modes[3:]:
        bad = got[m] != got["lut"]
        if bad.any():
            xf = x.float()
            y = rot.forward(xf / xf.norm(dim=-1, keepdim=True))[bad]
            lo = got["lut"][bad]
            gap = (y - cb.boundaries.to(DEV)[lo]).abs()
            assert ((got[m][bad] == lo + 1) & (lo < 2 ** (bits - 1)) & (gap < 1e-6)).all(), (
                f"seed {seed}: {m} differs from lut off a negative tie: {got[m][bad].tolist()} against "
                f"{lo.tolist()}, y {gap.tolist()} from the boundary")
            assert int(bad.sum()) <= 2, f"seed {seed}: {m} differs at {int(bad.sum())} ties"
    check_indices(x, rot, cb, packed["lut"], seed)


def dyadic_codebook(bits: int, d: int, grid: int = 4096) -> Codebook:
    """The Lloyd-Max boundaries scaled to [-1/2, 1/2] and rounded to multiples of 1/grid: rows made of such values
    can have a norm of exactly 1 (every square and partial sum is exact), so the kernel's y is exactly its input."""
    pos = theoretical_codebook(bits, d).boundaries[2 ** (bits - 1):].double()
    pos = torch.round(pos / pos[-1] * grid / 2) / grid if pos.numel() else pos
    assert pos.numel() == 0 or (pos.diff() > 0).all() and pos[0] > 0
    bnd = torch.cat([-pos.flip(0), torch.zeros(1, dtype=torch.float64), pos]).float()
    gap = 1.0 / grid
    cen = torch.cat([bnd[:1] - gap, (bnd[1:] + bnd[:-1]) / 2, bnd[-1:] + gap])
    return Codebook(bits, cen, bnd)


def unit_rows_through(values: torch.Tensor, d: int, grid: int = 4096) -> torch.Tensor:
    """One row per value v (a multiple of 1/grid, |v| <= 1/2): v first, then whole multiples of 1/grid whose squares
    fill 1 - v**2 exactly (greedy sum of squares), zeros elsewhere: ||row|| = 1 exactly."""
    rows = torch.zeros(values.numel(), d, dtype=torch.float64)
    for i, v in enumerate(values.double().tolist()):
        k = round(v * grid)
        rest, j = grid * grid - k * k, 1
        rows[i, 0] = k
        while rest:
            m = math.isqrt(rest)
            rows[i, j], rest, j = m, rest - m * m, j + 1
        assert j <= d
    return (rows / grid).float()


def test_search_modes_agree_at_boundaries():
    """Coordinates exactly on every boundary (unit rows: the kernel's y is exactly the row), one float step either
    side of each, and far outside: the searches see the same y inside the kernel, so 'lut', 'linear' and 'binary'
    agree exactly and equal bucketize on the exact rows; 'sat' and 'poly' file a coordinate exactly equal to a
    negative boundary one cell up (nearer zero; both centroids are equally near) and agree everywhere else."""
    from tq_hf_cache.kernels import quantize as Q

    rot = make_rotation(64, 0, kind="orthogonal")
    rot._matrix = torch.eye(64)  # identity rotation: y = x / ||x||
    for bits in (2, 3, 4, 6, 8):
        cb = dyadic_codebook(bits, 64)
        b = cb.boundaries
        exact = unit_rows_through(b, 64)
        assert torch.equal(exact.double().pow(2).sum(-1), torch.ones(b.numel(), dtype=torch.float64))
        up, down = exact.clone(), exact.clone()
        up[:, 0], down[:, 0] = torch.nextafter(b, torch.full_like(b, 9)), torch.nextafter(b, torch.full_like(b, -9))
        far = torch.zeros(3, 64)
        far[0, 0], far[1, 0], far[2, :2] = -1.0, 1.0, torch.tensor([float(b[0]) - 1e-3, float(b[-1]) + 1e-3])
        rows = torch.cat([exact, up, down, far + 1e-3]).view(1, 1, -1, 64)
        nb = packed_bytes(64, bits)
        got = {}
        modes = ("lut", "linear", "binary") + (("sat",) if bits <= 4 else ("poly",))
        for mode in modes:
            p = torch.empty(1, 1, rows.shape[2], nb, dtype=torch.uint8, device=DEV)
            n = torch.empty(1, 1, rows.shape[2], dtype=torch.float32, device=DEV)
            Q.quantize_into(rows.to(DEV), rot.to(DEV), cb.to(DEV), p, n, search=mode)
            got[mode] = unpack_indices(p.cpu(), bits, 64)
        assert all(torch.equal(got["lut"], got[m]) for m in ("linear", "binary")), f"bits {bits}"
        n_exact = exact.shape[0]
        assert torch.equal(got["lut"][0, 0, :n_exact], torch.bucketize(exact, b)), f"bits {bits}"
        assert (got["lut"] - torch.bucketize(rows, b)).abs().max() <= 1
        neg_tie = (rows[..., None] == b[b < 0]).any(-1)
        neg_tie[:, :, n_exact:] = False  # only the unit rows reach the kernel's y unchanged
        near_neg = ((rows[..., None] - b[b < 0]).abs() <= 2 * torch.finfo(torch.float32).eps * b.abs().max()).any(-1)
        assert neg_tie[0, 0, :n_exact, 0].sum() == (b < 0).sum(), "every negative boundary must be hit exactly"
        m = "sat" if bits <= 4 else "poly"
        diff = got[m] - got["lut"]
        assert (diff[neg_tie] == 1).all(), f"bits {bits}: {m} must file exact negative ties one cell up"
        assert ((diff == 0) | ((diff == 1) & near_neg)).all(), f"bits {bits}: {m} differs away from a negative tie"


def test_tied_centroids_fall_back_to_binary_search():
    seed, g = fresh_gen()
    c = shared_codebook(4, 64).centroids.clone()
    c[5] = c[6] = c[4]  # two equal boundaries (a zero-width cell): no uniform grid separates them
    cb = Codebook.from_centroids(c, 4)
    from tq_hf_cache.kernels import _common as Cm

    assert Cm.search_lut(cb, 1, torch.device("cpu")) is None
    rot = make_rotation(64, seed % 1000).to(DEV)
    x = make_x(g, 1, 1, 7, 64, torch.float32)
    packed, _ = quantize_poisoned(x, rot, cb.to(DEV), torch.float16)
    check_indices(x, rot, cb.to(DEV), packed, seed)


def test_orthogonal_rotation():
    seed, g = fresh_gen()
    rot = make_rotation(64, seed % 1000, kind="orthogonal").to(DEV)
    cb = theoretical_codebook(4, 64).to(DEV)
    x = make_x(g, 1, 3, 7, 64, torch.float16)
    packed, norms = quantize_poisoned(x, rot, cb, torch.float16)
    check_indices(x, rot, cb, packed, seed)
    check_norms(x, norms, seed)
    out = dequantize_poisoned(packed, norms, rot, cb, torch.bfloat16)
    check_dequant(out, packed, norms, rot, cb, seed)


def test_non_unit_last_dim_strides():
    """x and out with a last-dim stride of 2 (the launchers accept any stride for them)."""
    seed, g = fresh_gen()
    rot = make_rotation(64, seed % 1000).to(DEV)
    cb = shared_codebook(3, 64).to(DEV)
    x = make_x(g, 1, 3, 7, 128, torch.float16)[..., ::2]
    packed, norms = quantize_poisoned(x, rot, cb, torch.float16)
    check_indices(x, rot, cb, packed, seed)
    check_norms(x, norms, seed)
    big = torch.full((1, 3, 7, 128), float("nan"), dtype=torch.bfloat16, device=DEV)
    kernels.dequantize_into(packed, norms, rot, cb, big[..., 1::2])
    assert torch.isnan(big[..., 0::2]).all(), "wrote between out's strided elements"
    check_dequant(big[..., 1::2], packed, norms, rot, cb, seed)


def test_quantize_kv_equals_two_launches():
    seed, g = fresh_gen()
    rot = make_rotation(128, seed % 1000).to(DEV)
    kcb, vcb = shared_codebook(8, 128).to(DEV), per_head_codebook(g, 3, 3, 128).to(DEV)
    k, v = make_x(g, 1, 3, 7, 128, torch.bfloat16), make_x(g, 1, 3, 7, 128, torch.bfloat16)
    pk, nk = quantize_poisoned(k, rot, kcb, torch.float16)
    pv, nv = quantize_poisoned(v, rot, vcb, torch.float16)
    bufs = [
        torch.full((1, 3, 9, n), 0xA5, dtype=torch.uint8, device=DEV) for n in (packed_bytes(128, 8), packed_bytes(128, 3))
    ]
    norms = [torch.full((1, 3, 9), float("nan"), dtype=torch.float16, device=DEV) for _ in range(2)]
    kernels.quantize_kv_into(
        k, v, rot, kcb, vcb, bufs[0][:, :, 1:8], norms[0][:, :, 1:8], bufs[1][:, :, 1:8], norms[1][:, :, 1:8]
    )
    assert torch.equal(bufs[0][:, :, 1:8], pk) and torch.equal(bufs[1][:, :, 1:8], pv), f"seed {seed}"
    assert torch.equal(norms[0][:, :, 1:8], nk) and torch.equal(norms[1][:, :, 1:8], nv), f"seed {seed}"
    for buf, nrm in zip(bufs, norms):
        assert (buf[:, :, [0, 8]] == 0xA5).all() and torch.isnan(nrm[:, :, [0, 8]]).all()


def test_head_dim_256_quantizes_keys_and_values_and_dequantizes_every_width():
    """Gemma 3's head dim: one launch for keys and values, the static append, and dequantize at 8 bits (quantize above
    4 bits and dense rotations at 256 are refused, and the cache takes the reference there)."""
    seed, g = fresh_gen()
    d = 256
    rot = make_rotation(d, seed % 1000).to(DEV)
    kcb, vcb = shared_codebook(4, d).to(DEV), per_head_codebook(g, 2, 2, d).to(DEV)
    k, v = make_x(g, 1, 2, 5, d, torch.bfloat16), make_x(g, 1, 2, 5, d, torch.bfloat16)
    pk, nk = quantize_poisoned(k, rot, kcb, torch.float16)
    pv, nv = quantize_poisoned(v, rot, vcb, torch.float16)
    check_indices(k, rot, kcb, pk, seed)
    check_indices(v, rot, vcb, pv, seed)
    out = [torch.full_like(t, 0xA5) for t in (pk, pv)] + [torch.full_like(t, float("nan")) for t in (nk, nv)]
    kernels.quantize_kv_into(k, v, rot, kcb, vcb, out[0], out[2], out[1], out[3])
    assert torch.equal(out[0], pk) and torch.equal(out[1], pv), f"seed {seed}: quantize_kv_into"
    assert torch.equal(out[2], nk) and torch.equal(out[3], nv), f"seed {seed}: quantize_kv_into norms"
    cap, window = 9, 4
    got = [torch.full((1, 2, cap, t.shape[-1]), 0xA5, dtype=torch.uint8, device=DEV) for t in (pk, pv)]
    gn = [torch.full((1, 2, cap), NORM_POISON, dtype=torch.float16, device=DEV) for _ in range(2)]
    windows = [torch.zeros(1, 2, window, d, dtype=torch.bfloat16, device=DEV) for _ in range(2)]
    sinks = [torch.zeros(1, 2, 3, d, dtype=torch.bfloat16, device=DEV) for _ in range(2)]
    length, exact_from = (torch.tensor(2, dtype=torch.int64, device=DEV), torch.tensor(0, dtype=torch.int64, device=DEV))
    kernels.append_kv_into(k, v, rot, kcb, vcb, got[0], gn[0], got[1], gn[1], *windows, *sinks, length, exact_from, 2)
    assert torch.equal(got[0][:, :, 2:7], pk) and torch.equal(got[1][:, :, 2:7], pv), f"seed {seed}: append_kv_into"
    assert torch.equal(gn[0][:, :, 2:7], nk) and int(length) == 7, f"seed {seed}: append_kv_into norms, length"
    cb8 = shared_codebook(8, d).to(DEV)
    p8, n8 = reference.quantize(k, rot, cb8)
    check_dequant(dequantize_poisoned(p8, n8, rot, cb8, torch.bfloat16, "bhtd"), p8, n8, rot, cb8, seed)
    with pytest.raises(ValueError, match="head dim 256 with 5 bits and a hadamard rotation is not supported"):
        kernels.quantize_into(k, rot, shared_codebook(5, d).to(DEV), out[0], out[2])
    dense = make_rotation(d, 0, "orthogonal").to(DEV)
    with pytest.raises(ValueError, match="head dim 256 with 4 bits and a orthogonal rotation is not supported"):
        kernels.quantize_into(k, dense, kcb, out[0], out[2])


def static_buffers(b, h, cap, window, sinks, d, start, key_bytes, value_bytes):
    """A static layer's buffers, poisoned: "keys" (packed, norms) per key part (`key_bytes` a row each), the values',
    the bf16 windows and sink copies, and the lengths after `start` positions."""
    def packed(nbytes):
        return (torch.full((b, h, cap, nbytes), 0xA5, dtype=torch.uint8, device=DEV),
                torch.full((b, h, cap), NORM_POISON, dtype=torch.float16, device=DEV))

    out = {"keys": [packed(nb) for nb in key_bytes]}
    out["v_packed"], out["v_norms"] = packed(value_bytes)
    for name, rows in (("window_k", window), ("window_v", window), ("sink_k", sinks + 1), ("sink_v", sinks + 1)):
        out[name] = torch.full((b, h, rows, d), -3.0, dtype=torch.bfloat16, device=DEV)
    out["length"] = torch.tensor(start, dtype=torch.int64, device=DEV)
    out["exact_from"] = torch.tensor(max(0, start - window), dtype=torch.int64, device=DEV)
    return out


@pytest.mark.parametrize("n, start", [(1, 0), (1, 3), (1, 29), (5, 2), (21, 0), (21, 15), (3, 31), (2, 33)])
def test_static_append_matches_reference(n, start):
    """The static layer's append (one quantize + copy launch, one launch for the lengths) against
    `reference.static_append`: capacity 33, a window of 8, 4 sinks; chunks longer than the window, chunks crossing the
    sinks, and chunks running past the capacity (those rows are dropped, never written out of bounds)."""
    seed, g = fresh_gen()
    b, h, d, cap, window, sinks = 2, 3, 64, 33, 8, 4
    rot = make_rotation(d, seed % 1000).to(DEV)
    kcb, vcb = shared_codebook(5, d).to(DEV), per_head_codebook(g, 3, h, d).to(DEV)
    k, v = make_x(g, b, h, n, d, torch.bfloat16), make_x(g, b, h, n, d, torch.bfloat16)
    got, want = (static_buffers(b, h, cap, window, sinks, d, start, [packed_bytes(d, 5)], packed_bytes(d, 3))
                 for _ in range(2))
    for t in (got, want):
        (t["k_packed"], t["k_norms"]), = t["keys"]
    kernels.append_kv_into(k, v, rot, kcb, vcb, got["k_packed"], got["k_norms"], got["v_packed"], got["v_norms"],
                           got["window_k"], got["window_v"], got["sink_k"], got["sink_v"], got["length"],
                           got["exact_from"], sinks)
    reference.static_append(k, v, *(want[name] for name in ("k_packed", "k_norms", "v_packed", "v_norms", "window_k",
                                                             "window_v", "sink_k", "sink_v", "length", "exact_from")),
                            sinks, rot, kcb, vcb)
    for name in ("window_k", "window_v", "sink_k", "sink_v", "length", "exact_from"):
        assert torch.equal(got[name], want[name]), f"seed {seed}: {name} differs from the reference"
    rows = slice(min(start, cap), min(start + n, cap))
    m = rows.stop - rows.start
    for kind, x, cb in (("k", k, kcb), ("v", v, vcb)):
        packed, norms = got[f"{kind}_packed"], got[f"{kind}_norms"]
        outside = torch.ones(cap, dtype=torch.bool)
        outside[rows] = False
        assert (packed[:, :, outside] == 0xA5).all(), f"seed {seed}: {kind} packed bytes written outside their rows"
        assert (norms[:, :, outside] == NORM_POISON).all(), f"seed {seed}: {kind} norms written outside their rows"
        if m:  # the same bytes as the quantize kernel, indices within rounding of the reference
            pk, nk = quantize_poisoned(x[:, :, :m], rot, cb, torch.float16)
            assert torch.equal(packed[:, :, rows], pk), f"seed {seed}: {kind} packed differs from quantize_into"
            assert torch.equal(norms[:, :, rows], nk), f"seed {seed}: {kind} norms differ from quantize_into"
            check_indices(x[:, :, :m], rot, cb, packed[:, :, rows], seed)


def test_norm_edge_cases():
    """A zero vector (indices of y = 0, norm 0) and a norm past fp16's range (inf: never a made-up finite norm; the
    cache widens its norms to float32 before that happens)."""
    seed, g = fresh_gen()
    rot = make_rotation(64, 1).to(DEV)
    cb = theoretical_codebook(4, 64).to(DEV)
    x = make_x(g, 1, 1, 3, 64, torch.float32)
    x[0, 0, 0] = 0
    x[0, 0, 1] *= 1e5 / x[0, 0, 1].norm()
    packed, norms = quantize_poisoned(x, rot, cb, torch.float16)
    check_indices(x, rot, cb, packed, seed)
    assert norms[0, 0, 0] == 0 and norms[0, 0, 1] == float("inf")
    check_norms(x, norms, seed)


@pytest.mark.parametrize("norm_dtype", [torch.float16, torch.float32])
def test_non_finite_inputs_give_non_finite_norms(norm_dtype):
    """A NaN or inf coordinate makes the vector's stored norm non-finite, as the reference does, so that its
    dequantized vector is never a made-up finite one; the other vectors are untouched."""
    seed, g = fresh_gen()
    rot = make_rotation(64, 1).to(DEV)
    cb = theoretical_codebook(4, 64).to(DEV)
    x = make_x(g, 1, 2, 5, 64, torch.float32)
    x[0, 0, 1, 3] = float("nan")
    x[0, 1, 3, 60] = float("inf")
    packed, norms = quantize_poisoned(x, rot, cb, norm_dtype)
    bad = torch.zeros(1, 2, 5, dtype=torch.bool)
    bad[0, 0, 1] = bad[0, 1, 3] = True
    n = norms.float().cpu()
    assert not torch.isfinite(n[bad]).any() and torch.isfinite(n[~bad]).all(), f"seed {seed}: {n}"
    out = reference.dequantize(packed.cpu(), norms.cpu(), rot.to("cpu"), cb.to("cpu"))
    assert not torch.isfinite(out[bad]).all(dim=-1).any() and torch.isfinite(out[~bad]).all()


def test_supports_and_available():
    assert kernels.available()
    for d in (64, 128):
        for bits in range(1, 9):
            assert kernels.supports(d, bits)
    assert not kernels.supports(96, 4) and not kernels.supports(80, 4) and not kernels.supports(512, 4)
    # head dim 256: a Hadamard rotation; quantize up to 4 bits, dequantize every width
    assert kernels.supports(256, 4, "hadamard") and not kernels.supports(256, 5, "hadamard")
    assert kernels.supports(256, 8, "hadamard", quantize=False) and not kernels.supports(256, 2, "orthogonal")
    assert not kernels.supports(128, 0) and not kernels.supports(128, 9)


def test_launchers_reject_bad_inputs():
    rot = make_rotation(64, 0).to(DEV)
    cb = theoretical_codebook(4, 64).to(DEV)
    x = torch.randn(1, 2, 3, 64, device=DEV)
    p = torch.empty(1, 2, 3, 32, dtype=torch.uint8, device=DEV)
    n = torch.empty(1, 2, 3, dtype=torch.float16, device=DEV)
    with pytest.raises(TypeError, match="float64"):
        kernels.quantize_into(x.double(), rot, cb, p, n)
    with pytest.raises(ValueError, match=r"shape \(1, 2, 3, 32\)"):
        kernels.quantize_into(x, rot, cb, p[:, :, :, :16], n)
    with pytest.raises(TypeError, match="uint8"):
        kernels.quantize_into(x, rot, cb, p.to(torch.int32), n)
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        kernels.quantize_into(x, rot, cb, torch.empty(1, 2, 3, 64, dtype=torch.uint8, device=DEV)[..., ::2], n)
    with pytest.raises(ValueError, match="norms must have shape"):
        kernels.quantize_into(x, rot, cb, p, n[:, :1])
    with pytest.raises(ValueError, match="head dim 96"):
        kernels.quantize_into(torch.randn(1, 2, 3, 96, device=DEV), make_rotation(96), theoretical_codebook(4, 96), p, n)
    with pytest.raises(ValueError, match="rotation is for head dim 128"):
        kernels.quantize_into(x, make_rotation(128).to(DEV), cb, p, n)
    with pytest.raises(ValueError, match="per-head codebook has 3 heads"):
        kernels.quantize_into(x, rot, Codebook.from_centroids(cb.centroids.repeat(3, 1).cpu(), 4).to(DEV), p, n)
    with pytest.raises(TypeError, match="out must be one of"):
        kernels.dequantize_into(p, n, rot, cb, torch.empty(1, 2, 3, 64, dtype=torch.float64, device=DEV))
    with pytest.raises(ValueError, match="packed must have shape"):
        kernels.dequantize_into(p[:, :1], n, rot, cb, torch.empty(1, 2, 3, 64, device=DEV))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_large_shapes_through_ops():
    seed, g = fresh_gen()
    for bits, d in ((2, 128), (3, 128), (4, 128), (8, 128), (2, 256), (4, 256)):
        rot = make_rotation(d, 7).to(DEV)
        cb = shared_codebook(bits, d).to(DEV)
        x = make_x(g, 2, 8, 1000, d, torch.bfloat16)
        packed = torch.empty(2, 8, 1000, packed_bytes(d, bits), dtype=torch.uint8, device=DEV)
        norms = torch.empty(2, 8, 1000, dtype=torch.float16, device=DEV)
        ops.quantize_into(x, rot, cb, packed, norms)
        check_indices(x, rot, cb, packed, seed)
        check_norms(x, norms, seed)
        out = torch.empty(2, 8, 1000, d, dtype=torch.bfloat16, device=DEV)
        ops.dequantize_into(packed, norms, rot, cb, out)
        check_dequant(out, packed, norms, rot, cb, seed)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_fallback_warns_once():
    ops._WARNED.clear()
    rot = make_rotation(96, 0).to(DEV)
    cb = theoretical_codebook(4, 96).to(DEV)
    x = torch.randn(1, 2, 3, 96, device=DEV)
    p = torch.empty(1, 2, 3, packed_bytes(96, 4), dtype=torch.uint8, device=DEV)
    n = torch.empty(1, 2, 3, dtype=torch.float16, device=DEV)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        ops.quantize_into(x, rot, cb, p, n)
        ops.quantize_into(x, rot, cb, p, n)
    assert sum("falls back" in str(w.message) for w in rec) == 1
    ref_p, _ = reference.quantize(x, rot, cb)
    assert torch.equal(p, ref_p)


def test_sat_search_per_head_alignment_and_refusal():
    """The saturated-FMA search serves per-head symmetric codebooks (each head its own boundaries), refuses asymmetric
    codebooks and more than 4 bits by name, and needs word-aligned packed rows: the default falls back to the linear
    scan on a misaligned view (same indices), an explicit 'sat' refuses it. 5- and 8-bit rows off a word get byte
    stores, and dequantize reads them back."""
    from tq_hf_cache.kernels import quantize as Q

    seed, g = fresh_gen()
    rot = make_rotation(64, seed % 1000).to(DEV)
    base = shared_codebook(4, 64).centroids
    scale = 0.5 + torch.rand(3, 1, generator=g)
    sym = Codebook.from_centroids(base.unsqueeze(0) * scale, 4).to(DEV)  # (3, 16), each row mirrored around 0
    assert Q.is_symmetric(sym)
    x = make_x(g, 1, 3, 9, 64, torch.bfloat16)
    got = {m: quantize_poisoned(x, rot, sym, torch.float16, search=m)[0] for m in ("sat", "linear")}
    assert torch.equal(got["sat"], got["linear"]), f"seed {seed}"
    check_indices(x, rot, sym, got["sat"], seed)
    skew = per_head_codebook(g, 4, 3, 64).to(DEV)
    assert not Q.is_symmetric(skew)
    with pytest.raises(ValueError, match="symmetric"):
        quantize_poisoned(x, rot, skew, torch.float16, search="sat")
    with pytest.raises(ValueError, match="at most 4 bits"):
        quantize_poisoned(x, rot, shared_codebook(5, 64).to(DEV), torch.float16, search="sat")
    # rows 1 byte off a word (nb + 1 byte stride): 'sat' (<= 4 bits) refuses them, the default scans; 5 and 8 bits
    # store bytes instead of int32 words; dequantize reads them back as bytes (every width reads words when aligned)
    from tq_hf_cache.kernels import dequantize as DQ

    for bits in (1, 3, 4, 5, 7, 8):
        cb = shared_codebook(bits, 64).to(DEV)
        nb = packed_bytes(64, bits)
        big = torch.full((1, 3, 9, nb + 1), 0xA5, dtype=torch.uint8, device=DEV)
        view = big[..., 1:]
        n = torch.empty(1, 3, 9, dtype=torch.float16, device=DEV)
        assert not Q._store_aligned(view, bits, 64)
        Q.quantize_into(x, rot, cb, view, n)
        check_indices(x, rot, cb, view, seed)
        assert (big[..., 0] == 0xA5).all(), f"the byte before each misaligned {bits}-bit row was overwritten"
        if bits <= 4:
            with pytest.raises(ValueError, match="aligned"):
                Q.quantize_into(x, rot, cb, view, n, search="sat")
        out = torch.full((1, 3, 9, 64), float("nan"), device=DEV)
        DQ.dequantize_into(view, n, rot, cb, out)
        check_dequant(out, view, n, rot, cb, seed)


@pytest.mark.parametrize("d", [64, 128])
def test_dequantize_reads_rows_in_every_word_unit_alike(d):
    """Packed rows read as int64 words (the default at 6 and 7 bits where rows start on 8 bytes), int32 words or bytes
    give the same output at every group width (to fp32 rounding: on a GPU each unit is its own compiled kernel, whose
    sums may run in another order); rows 4 bytes off an 8-byte boundary fall back to int32 words;
    a unit the rows do not allow, or int64 words at a width without groups, is refused by name."""
    from tq_hf_cache.kernels import dequantize as DQ

    seed, g = fresh_gen()
    rot = make_rotation(d, seed % 1000).to(DEV)
    for bits in DQ.WIDE_WORDS:
        cb = per_head_codebook(g, bits, 3, d).to(DEV)
        nb = packed_bytes(d, bits)
        t = 11
        packed = torch.randint(0, 256, (2, 3, t, nb), generator=g, dtype=torch.uint8).to(DEV)
        norms = (torch.rand(2, 3, t, generator=g) + 0.1).to(torch.float16).to(DEV)
        assert DQ.word_unit(packed, bits) == (8 if bits in DQ.INT64_WORDS else 4)
        outs = {}
        for unit in (8, 4, 0):
            outs[unit] = torch.full((2, 3, t, d), float("nan"), device=DEV)
            DQ.dequantize_into(packed, norms, rot, cb, outs[unit], words=unit)
        check_dequant(outs[8], packed, norms, rot, cb, seed)
        for unit in (4, 0):
            torch.testing.assert_close(outs[unit], outs[8], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{bits} bits, words {unit} vs 8, seed {seed}: {m}")
        # rows whose stride is 4 bytes past a multiple of 8: int32 words, same output
        big = torch.zeros(2, 3, t, nb + 4, dtype=torch.uint8, device=DEV)
        big[..., :nb] = packed
        off = big[..., :nb]
        assert DQ.word_unit(off, bits) == 4
        out = torch.full((2, 3, t, d), float("nan"), device=DEV)
        DQ.dequantize_into(off, norms, rot, cb, out)
        torch.testing.assert_close(out, outs[8], rtol=1e-5, atol=1e-6, msg=lambda m: f"{bits} bits, 4-aligned rows: {m}")
        with pytest.raises(ValueError, match="words=8"):
            DQ.dequantize_into(off, norms, rot, cb, out, words=8)
    with pytest.raises(ValueError, match="words=8"):
        DQ.dequantize_into(packed[..., :packed_bytes(d, 4)].contiguous(), norms, rot, shared_codebook(4, d).to(DEV),
                           torch.empty(2, 3, t, d, device=DEV), words=8)


def test_poly_search_table_default_and_refusals():
    """'poly' is the default above 4 bits for symmetric codebooks (per-head ones too: each head its own polynomial) and
    matches the table search; its fit check rejects a polynomial off by 0.6 of an index; asymmetric codebooks keep
    the table (or the binary search), and an explicit 'poly' on them, or at 4 bits, is refused by name."""
    from tq_hf_cache.kernels import quantize as Q

    seed, g = fresh_gen()
    rot = make_rotation(64, seed % 1000).to(DEV)
    x = make_x(g, 1, 3, 9, 64, torch.bfloat16)
    base = shared_codebook(8, 64).centroids
    sym = Codebook.from_centroids(base.unsqueeze(0) * (0.5 + torch.rand(3, 1, generator=g)), 8).to(DEV)
    nb = packed_bytes(64, 8)
    assert Q._search_args(sym, 3, x.device, None, torch.empty(1, 3, 9, nb, dtype=torch.uint8, device=DEV))[1] == Q.SEARCHES["poly"]
    got = {m: quantize_poisoned(x, rot, sym, torch.float16, search=m)[0] for m in ("poly", "lut")}
    assert torch.equal(got["poly"], got["lut"]), f"seed {seed}"
    check_indices(x, rot, sym, got["poly"], seed)

    tab, _ = _common.poly_table(shared_codebook(8, 64), 1, torch.device("cpu"))
    n = _common.POLY_DEG + 1
    coef, pos = tab[0, :n].double(), tab[0, n + 1 :].double()
    assert _common._poly_ok(coef, pos, _common.POLY_MARGIN)
    assert not _common._poly_ok(coef + torch.eye(n, dtype=torch.float64)[-1] * 0.6, pos, _common.POLY_MARGIN)

    skew = per_head_codebook(g, 8, 3, 64).to(DEV)
    packed = torch.empty(1, 3, 9, nb, dtype=torch.uint8, device=DEV)
    assert Q._search_args(skew, 3, x.device, None, packed)[1] in (Q.SEARCHES["lut"], Q.SEARCHES["binary"])
    with pytest.raises(ValueError, match="symmetric"):
        quantize_poisoned(x, rot, skew, torch.float16, search="poly")
    with pytest.raises(ValueError, match="5 to 8 bits"):
        quantize_poisoned(x, rot, shared_codebook(4, 64).to(DEV), torch.float16, search="poly")


def test_kernel_tables_are_shared_by_codebooks_with_the_same_centroids():
    """Every new cache builds new Codebook objects: their tables (the 'poly' fit costs milliseconds of host time
    per layer) are found by the centroids' fingerprint, not rebuilt."""
    a, b = theoretical_codebook(5, 128), theoretical_codebook(5, 128)
    assert a is not b and a.fingerprint == b.fingerprint
    assert _common.poly_table(a, 1, DEV) is _common.poly_table(b.to(DEV), 1, DEV)
    other = theoretical_codebook(6, 128)
    assert _common.poly_table(other, 1, DEV) is not _common.poly_table(a, 1, DEV)


@pytest.mark.parametrize("n, start", [(1, 3), (5, 2), (21, 15), (3, 31)])
def test_static_append_of_split_keys_matches_reference(n, start):
    """A static layer's append with split keys (`key_split`): the values and both tensors' exact copies as
    `reference.static_append`, each key part's codes as the quantize kernel gives them for that part's channels,
    nothing written outside the new rows (capacity 33: the last case runs past it)."""
    from tq_hf_cache.quant.key_split import check_spec, make_split

    seed, g = fresh_gen()
    b, h, d, cap, window, sinks = 2, 3, 64, 33, 8, 4
    spec = check_spec({"bits": [6, 4, 3], "sizes": [16, 16, 32],
                       "order": [torch.randperm(d, generator=g).tolist() for _ in range(h)]}, 0)
    split = make_split(spec, 0, h, d, lambda m: make_rotation(m, (seed + m) % 1000), theoretical_codebook).to(DEV)
    rot, vcb = make_rotation(d, seed % 1000).to(DEV), per_head_codebook(g, 3, h, d).to(DEV)
    k, v = make_x(g, b, h, n, d, torch.bfloat16), make_x(g, b, h, n, d, torch.bfloat16)
    key_bytes = [packed_bytes(m, w) for m, w in zip(spec["sizes"], spec["bits"])]
    got, want = (static_buffers(b, h, cap, window, sinks, d, start, key_bytes, packed_bytes(d, 3)) for _ in range(2))
    rest = ("v_packed", "v_norms", "window_k", "window_v", "sink_k", "sink_v", "length", "exact_from")
    parts = got["keys"]
    kernels.append_parts_into(k, v, split.split(k), split.parts, parts, rot, vcb, *(got[name] for name in rest), sinks)
    reference.static_append(k, v, *want["keys"][0], *(want[name] for name in rest), sinks, rot, split.parts[0][1], vcb,
                            key_split=split, key_parts=want["keys"])
    for name in ("window_k", "window_v", "sink_k", "sink_v", "length", "exact_from"):
        assert torch.equal(got[name], want[name]), f"seed {seed}: {name} differs from the reference"
    rows = slice(min(start, cap), min(start + n, cap))
    m = rows.stop - rows.start
    outside = torch.ones(cap, dtype=torch.bool)
    outside[rows] = False
    xs = split.split(k[:, :, :m]) + [v[:, :, :m]]
    quantizers = list(split.parts) + [(rot, vcb)]
    names = ["key part 0", "key part 1", "key part 2", "values"]
    for what, (packed, norms), x, (r, cb) in zip(names, parts + [(got["v_packed"], got["v_norms"])], xs, quantizers):
        assert (packed[:, :, outside] == 0xA5).all(), f"seed {seed}: {what}: bytes written outside their rows"
        assert (norms[:, :, outside] == NORM_POISON).all(), f"seed {seed}: {what}: norms written outside their rows"
        if m:
            pk, nk = quantize_poisoned(x, r, cb, torch.float16)
            assert torch.equal(packed[:, :, rows], pk), f"seed {seed}: {what}: packed differs from quantize_into"
            assert torch.equal(norms[:, :, rows], nk), f"seed {seed}: {what}: norms differ from quantize_into"
            check_indices(x, r, cb, packed[:, :, rows], seed)
