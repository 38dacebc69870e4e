"""Codebooks on pairs of rotated coordinates: 4**bits points in the plane for `bits` bits a coordinate.

Two coordinates (y1, y2) of a uniformly rotated unit vector in R^dim have the circularly symmetric density
    f(y1, y2) ~ (1 - r^2)^((dim - 4) / 2),   r^2 = y1^2 + y2^2 < 1,
so, as with the scalar codebook, one fixed pair codebook serves every pair of every vector of that head dim, with no
data. A 2-D codebook fitted to this law (Lloyd's algorithm on a fine weighted grid) has a lower mean squared error
than the product of two scalar codebooks at the same bits (cells closer to round than squares, and points placed
where the mass is). A pair's index is stored as two consecutive `bits`-bit codes (the low half at the even
coordinate), so packed pair codes have exactly the layout and size of scalar codes, and every decode kernel that
reads codes through tables of consecutive coordinates reads them unchanged (`Codebook.coordinate_values`).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from .codebook import Codebook, check_bits
from .derived import Derived

MAX_PAIR_BITS = 4  # 256 points a pair: a pair index is one byte
# (cells per axis, at most this many Lloyd steps) of the fitting grids by points: coarse to move fast, then fine (about
# 10 grid cells across a codebook cell near the centre at 4 bits); few points move slowly but cost little
_STEPS = {4: ((96, 400), (192, 200)), 16: ((96, 300), (192, 100)), 64: ((64, 150), (192, 40)), 256: ((64, 45), (192, 15))}
_STARTS = 8


def check_pair_bits(bits, what: str = "bits") -> int:
    check_bits(bits, what)
    if bits > MAX_PAIR_BITS:
        raise ValueError(f"{what} must be an integer in [1, {MAX_PAIR_BITS}] for pair codes (4**bits points a pair), "
                         f"got {bits!r}")
    return bits


def pair_density(r2: torch.Tensor, dim: int) -> torch.Tensor:
    """The (unnormalized) density of a pair of coordinates of a uniform random unit vector in R^dim at squared radius
    r2 (float64)."""
    inside = (1 - r2.double()).clamp_min(0)
    if dim == 4:
        return (inside > 0).double()
    return torch.exp((dim - 4) / 2 * torch.log(inside.clamp_min(1e-300))) * (inside > 0)


def _start(points: int, dim: int) -> torch.Tensor:
    """A sunflower spiral of `points` points whose radial spread follows the high-resolution optimum (point density
    ~ f^(1/2) in the plane): Lloyd from here takes tens of steps, and the start is the same on every machine."""
    r = torch.linspace(0, 1, 20_001, dtype=torch.float64)
    mass = torch.cumsum(pair_density(r * r, dim).sqrt() * r, 0)
    i = torch.arange(points, dtype=torch.float64)
    radius = r[torch.searchsorted(mass, (i + 0.5) / points * mass[-1]).clamp(max=r.numel() - 1)]
    angle = i * math.pi * (3 - math.sqrt(5))
    return torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], -1)


@lru_cache(maxsize=None)
def _fit(bits: int, dim: int) -> torch.Tensor:
    """(4**bits, 2) float32: Lloyd's algorithm on weighted grids of the pair law, coarse then fine (`_STEPS`), in
    float64 on the host, from the sunflower start and, for up to 64 points (where Lloyd stops in local optima that
    differ by a few percent of error, and runs are cheap), from `_STARTS` seeded random ones too; the lowest error
    wins."""
    points = 4**bits
    starts = [_start(points, dim)]
    if points <= 64:
        g = torch.Generator().manual_seed(0)
        starts += [torch.randn(points, 2, generator=g, dtype=torch.float64) / math.sqrt(dim) for _ in range(_STARTS)]
    best, best_err = None, math.inf
    for c in starts:
        c, err = _lloyd(c, dim, _STEPS[points])
        if err < best_err:
            best, best_err = c, err
    return best.float()


def _lloyd(c: torch.Tensor, dim: int, steps) -> tuple[torch.Tensor, float]:
    """Lloyd from c over the grids of `steps`; the points and their mean squared error on the last grid."""
    lim = min(1.0, 7.0 / math.sqrt(dim))  # the mass beyond 7 standard deviations of radius is below 1e-10
    for cells, iters in steps:
        g = (torch.arange(cells, dtype=torch.float64) + 0.5) / cells * 2 * lim - lim
        gx, gy = torch.meshgrid(g, g, indexing="ij")
        pts = torch.stack([gx.reshape(-1), gy.reshape(-1)], -1)
        w = pair_density(pts.pow(2).sum(-1), dim)
        keep = w > w.max() * 1e-12
        pts, w = pts[keep], w[keep]
        for _ in range(iters):
            idx = nearest(pts, c)
            mass = torch.zeros(c.shape[0], dtype=torch.float64).index_add_(0, idx, w)
            first = torch.zeros_like(c).index_add_(0, idx, pts * w.unsqueeze(1))
            new = torch.where((mass > 0).unsqueeze(1), first / mass.clamp_min(1e-300).unsqueeze(1), c)
            moved, c = float((new - c).abs().max()), new
            if moved < 1e-9:
                break
    err = float(((pts - c[nearest(pts, c)]).pow(2).sum(-1) * w).sum() / w.sum())
    return c, err


def nearest(x: torch.Tensor, points: torch.Tensor, block: int = 1 << 15) -> torch.Tensor:
    """Index of the nearest row of points (K, 2) for each row of x (N, 2), by squared distances in x's dtype
    (|p|^2 - 2 x.p: the |x|^2 term is common to a row)."""
    out = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    p = points.to(device=x.device, dtype=x.dtype)
    pn = p.pow(2).sum(-1)
    for s in range(0, x.shape[0], block):
        out[s : s + block] = torch.addmm(pn, x[s : s + block], p.T, alpha=-2).argmin(1)
    return out


@lru_cache(maxsize=None)
def _theoretical_tables(bits: int, dim: int) -> Derived:
    """The derived tables of the theoretical pair codebook of (bits, dim), shared by all its copies (as
    `codebook._theoretical_tables`)."""
    return Derived(shared=(_theoretical_tables, (bits, dim)))


def theoretical_pair_codebook(bits: int, dim: int) -> Codebook:
    """The pair codebook for the rotated-coordinate law in `dim` dimensions (cached; `dim` even, >= 4)."""
    check_pair_bits(bits)
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 4 or dim % 2:
        raise ValueError(f"pair codes need an even head dim >= 4, got {dim!r}")
    codebook = Codebook.from_points(_fit(bits, dim).clone(), bits)
    codebook.derived = _theoretical_tables(bits, dim)
    return codebook


def expected_pair_mse(codebook: Codebook, dim: int, samples: int = 200_000, seed: int = 0) -> float:
    """E||u - u_hat||^2 for a unit vector u in R^dim under this pair codebook (Monte Carlo over `samples` vectors'
    worth of pairs)."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.randn(samples // 8 + 1, dim, generator=gen, dtype=torch.float64)
    u = u / u.norm(dim=-1, keepdim=True)
    pairs = u.reshape(-1, 2)
    pts = codebook.centroids.double().reshape(-1, 2) if not codebook.per_head else codebook.centroids[0].double()
    q = pts[nearest(pairs, pts)]
    return float((pairs - q).pow(2).sum() / u.shape[0])
