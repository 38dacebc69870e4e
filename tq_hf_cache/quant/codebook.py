"""Lloyd-Max scalar codebooks for one coordinate of a rotated unit vector.

After a uniformly random rotation, one coordinate x of a unit vector in R^d has the density
    f(x) = Gamma(d/2) / (sqrt(pi) Gamma((d-1)/2)) * (1 - x^2)^((d-3)/2),   x in [-1, 1],
so one fixed scalar quantizer serves every coordinate. Lloyd-Max alternates "boundaries are midpoints of
neighbouring centroids" and "centroids are conditional means of their cell" until it stops moving; the
integrals are done on a fine grid with prefix sums, in float64, so the result is deterministic.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from .derived import Derived

MIN_BITS, MAX_BITS = 1, 8


def check_bits(bits, what: str = "bits") -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or not MIN_BITS <= bits <= MAX_BITS:
        raise ValueError(f"{what} must be an integer in [{MIN_BITS}, {MAX_BITS}], got {bits!r}")
    return bits


@dataclass(eq=False)
class Codebook:
    """What a code means, for one bit width: scalar centroids (ascending) and the midpoints between them, or, for
    pair codes (`pair`), 4**bits points in the plane for two consecutive coordinates (`pair_codebook`).

    `centroids` is (2**bits,) for a scalar codebook shared by all heads, or (H, 2**bits) for one per KV head
    (calibrated codebooks); `boundaries` has one entry fewer on the last dim. A pair codebook's `centroids` is
    (4**bits, 2) (or (H, 4**bits, 2)) and it has no boundaries (its codes are found by the nearest point).
    `norm_correction`: the stored norm is ||x|| / ||u_hat|| (u_hat: the decoded rotated unit vector), so that a
    decoded vector has exactly the input's length; the gain is at most `NORM_GAIN`.
    """

    bits: int
    centroids: torch.Tensor
    boundaries: torch.Tensor
    fingerprint: str = ""  # of the centroids (from_centroids): equal codebooks share an op id by it (`ops`)
    pair: bool = False
    norm_correction: bool = False
    derived: Derived = field(default_factory=Derived, init=False, repr=False)  # kernel tables, per device

    @classmethod
    def from_centroids(cls, centroids: torch.Tensor, bits: int) -> "Codebook":
        check_bits(bits)
        c = torch.as_tensor(centroids, dtype=torch.float32)
        if c.dim() not in (1, 2) or c.shape[-1] != 2**bits:
            raise ValueError(
                f"a {bits}-bit codebook needs centroids of shape (..., {2**bits}), got {tuple(c.shape)}"
            )
        if not torch.isfinite(c).all():
            raise ValueError("codebook centroids contain NaN or inf")
        c, _ = torch.sort(c, dim=-1)
        c = c.contiguous()
        return cls(bits, c, ((c[..., 1:] + c[..., :-1]) / 2).contiguous(), _digest(f"{bits}:{tuple(c.shape)}:", c))

    @classmethod
    def from_points(cls, points: torch.Tensor, bits: int) -> "Codebook":
        """A pair codebook: points (4**bits, 2), or (H, 4**bits, 2) per KV head; point i is what pair index i
        means (the even coordinate's code in the low `bits` bits)."""
        check_bits(bits)
        p = torch.as_tensor(points, dtype=torch.float32)
        if p.dim() not in (2, 3) or tuple(p.shape[-2:]) != (4**bits, 2):
            raise ValueError(f"a {bits}-bit pair codebook needs points of shape (..., {4**bits}, 2), got "
                             f"{tuple(p.shape)}")
        if not torch.isfinite(p).all():
            raise ValueError("pair codebook points contain NaN or inf")
        p = p.contiguous()
        return cls(bits, p, p.new_empty(0), _digest(f"pair:{bits}:{tuple(p.shape)}:", p), pair=True)

    def with_norm_correction(self, on: bool = True) -> "Codebook":
        """This codebook with `norm_correction` set (its own fingerprint; the derived tables are shared)."""
        if on == self.norm_correction:
            return self
        out = Codebook(self.bits, self.centroids, self.boundaries,
                       (self.fingerprint + ":nc") if on else self.fingerprint.removesuffix(":nc"), self.pair, on)
        out.derived = self.derived
        return out

    @property
    def per_head(self) -> bool:
        return self.centroids.dim() == (3 if self.pair else 2)

    @property
    def kind(self) -> str:
        """"pair" or "scalar"."""
        return "pair" if self.pair else "scalar"

    def coordinate_values(self, key: torch.Tensor, per: int) -> torch.Tensor:
        """(H', len(key), per) float32 on the codebook's device: the decoded values of `per` consecutive coordinates
        whose codes are packed, lowest first, in the bits of each key (H' = 1 for a shared codebook). Every kernel
        table is made from this, so scalar and pair codes are read the same way."""
        c = self.centroids.float()
        key = key.to(c.device)
        if not self.pair:
            c = c.reshape(-1, 2**self.bits)
            return torch.stack([c[:, (key >> (self.bits * j)) & (2**self.bits - 1)] for j in range(per)], -1)
        if per % 2:
            raise ValueError(f"pair codes are read two coordinates at a time, not {per}")
        p = c.reshape(-1, 4**self.bits, 2)
        idx = [(key >> (2 * self.bits * i)) & (4**self.bits - 1) for i in range(per // 2)]
        return torch.cat([p[:, i] for i in idx], -1)

    def to(self, device) -> "Codebook":
        """This codebook on `device`, sharing this one's derived tables (kept per device). From the host to a GPU
        the copies do not wait for the GPU's queue (a pageable source is read before the call returns): a cache's
        layers make theirs during a prefill, where a wait per layer would keep the host from running ahead of the
        GPU."""
        device = torch.device(device)
        ahead = device.type == "cuda" and self.centroids.device.type == "cpu" and not self.centroids.is_pinned()
        moved = Codebook(self.bits, self.centroids.to(device, non_blocking=ahead),
                         self.boundaries.to(device, non_blocking=ahead), self.fingerprint, self.pair,
                         self.norm_correction)
        moved.derived = self.derived
        return moved


NORM_GAIN = 2.0  # the largest norm-correction gain stored: the norm guards widen float16 norms past FP16_MAX / this


def _digest(prefix: str, t: torch.Tensor) -> str:
    return hashlib.sha1(prefix.encode() + t.detach().cpu().numpy().tobytes()).hexdigest()


def coordinate_density(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The density of one coordinate of a uniform random unit vector in R^dim (float64)."""
    x = x.double()
    log_c = math.lgamma(dim / 2) - 0.5 * math.log(math.pi) - math.lgamma((dim - 1) / 2)
    inside = (1 - x * x).clamp_min(0)
    if dim == 3:
        return torch.full_like(x, math.exp(log_c)) * (x.abs() <= 1)
    return torch.exp(log_c + (dim - 3) / 2 * torch.log(inside.clamp_min(1e-300))) * (inside > 0)


def lloyd_max(
    grid: torch.Tensor, weights: torch.Tensor, bits: int, init: torch.Tensor | None = None, iters: int = 5000
) -> torch.Tensor:
    """1-D Lloyd-Max (k-means) on a weighted sorted grid; returns 2**bits ascending float64 centroids."""
    grid, weights = grid.double(), weights.double().clamp_min(0)
    k = 2**bits
    w_cum = torch.cat([weights.new_zeros(1), torch.cumsum(weights, 0)])
    xw_cum = torch.cat([weights.new_zeros(1), torch.cumsum(weights * grid, 0)])
    if init is None:
        # start from the high-resolution optimum (point density ~ f^(1/3)): Lloyd from equal-mass cells
        # needs ~10k iterations at 8 bits, from here a few hundred
        dens = torch.cumsum(weights.pow(1 / 3), 0)
        targets = (torch.arange(k, dtype=torch.float64) + 0.5) / k * dens[-1]
        init = grid[torch.searchsorted(dens, targets).clamp(max=grid.numel() - 1)]
    c = torch.sort(init.double())[0]
    for _ in range(iters):
        b = (c[1:] + c[:-1]) / 2
        cut = torch.cat([torch.zeros(1, dtype=torch.long), torch.searchsorted(grid, b), torch.tensor([grid.numel()])])
        mass = w_cum[cut[1:]] - w_cum[cut[:-1]]
        first = xw_cum[cut[1:]] - xw_cum[cut[:-1]]
        new = torch.where(mass > 0, first / mass.clamp_min(1e-300), c)
        moved = (new - c).abs().max().item()
        c = new
        if moved < 1e-12:
            break
    return c


@lru_cache(maxsize=None)
def _theoretical(bits: int, dim: int) -> torch.Tensor:
    # the mass lies within a few 1/sqrt(dim) of 0; a 12-sigma window keeps the grid dense where it matters
    lim = min(1.0, 12.0 / math.sqrt(dim))
    grid = torch.linspace(-lim, lim, 200_001, dtype=torch.float64)
    c = lloyd_max(grid, coordinate_density(grid, dim), bits)
    c = (c - c.flip(0)) / 2  # the law is symmetric: remove float drift so the codebook is exactly symmetric
    return c.float()


@lru_cache(maxsize=None)
def _theoretical_tables(bits: int, dim: int) -> Derived:
    """The derived tables of the theoretical codebook of (bits, dim), shared by all its copies: every new cache makes
    new Codebook objects, and building their tables again (the 'poly' fit: milliseconds per layer, ~1.7 s of host
    time per Llama-8B-sized cache) or reading a GPU codebook back to build them would slow every first prefill."""
    return Derived(shared=(_theoretical_tables, (bits, dim)))


def theoretical_codebook(bits: int, dim: int) -> Codebook:
    """The Lloyd-Max codebook for the rotated-coordinate law in `dim` dimensions (cached)."""
    check_bits(bits)
    if not isinstance(dim, int) or dim < 3:
        raise ValueError(f"head dim must be an integer >= 3, got {dim!r}")
    codebook = Codebook.from_centroids(_theoretical(bits, dim).clone(), bits)
    codebook.derived = _theoretical_tables(bits, dim)
    return codebook


def expected_mse(codebook: Codebook, dim: int) -> float:
    """E||u - u_hat||^2 for a unit vector u under this codebook (dim times the per-coordinate MSE)."""
    lim = min(1.0, 12.0 / math.sqrt(dim))
    grid = torch.linspace(-lim, lim, 400_001, dtype=torch.float64)
    w = coordinate_density(grid, dim)
    c = codebook.centroids.double().reshape(-1, codebook.centroids.shape[-1])[0]
    q = c[torch.bucketize(grid, codebook.boundaries.double().reshape(-1, c.numel() - 1)[0])]
    return float(dim * torch.trapezoid(w * (grid - q) ** 2, grid) / torch.trapezoid(w, grid))
