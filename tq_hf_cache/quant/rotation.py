"""Random rotations that make every coordinate of a unit vector follow the same known law.

Power-of-two head dims use a randomized Hadamard transform (random signs, then a normalized fast
Walsh-Hadamard transform): O(d log d) and exactly orthogonal. Other head dims (80, 96, 112, ...) use a
seeded random orthogonal matrix (QR of a Gaussian matrix). Both are deterministic in the seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .derived import Derived

ROTATION_KINDS = ("auto", "hadamard", "orthogonal")


def is_power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalized fast Walsh-Hadamard transform over the last dim (a power of two)."""
    d = x.shape[-1]
    lead = x.shape[:-1]
    h = 1
    while h < d:
        x = x.reshape(*lead, d // (2 * h), 2, h)
        a, b = x[..., 0, :], x[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2)
        h *= 2
    return x.reshape(*lead, d)


def _generator(seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(int(seed))
    return g


@dataclass(eq=False)
class Rotation:
    """An orthogonal map Pi on R^dim: `forward(x) = Pi x`, `inverse(y) = Pi^T y`, over the last dim."""

    dim: int
    seed: int
    kind: str  # "hadamard" or "orthogonal" (resolved, never "auto")
    signs: torch.Tensor | None  # (dim,) float32 of +-1, hadamard only
    _matrix: torch.Tensor  # (dim, dim) float32, Pi
    _on: dict = field(default_factory=dict, repr=False)  # device -> this rotation there
    derived: Derived = field(default_factory=Derived, init=False, repr=False)  # kernel operands, per device

    @property
    def matrix(self) -> torch.Tensor:
        """Pi as a dense float32 matrix (kernels that rotate with a matrix product use it)."""
        return self._matrix

    def to(self, device: torch.device | str) -> "Rotation":
        """The same rotation on `device`: one object per device, sharing this one's derived tensors (per device)."""
        device = torch.device(device)
        if self._matrix.device == device:
            return self
        moved = self._on.get(device)
        if moved is None:
            signs = None if self.signs is None else self.signs.to(device)
            moved = self._on[device] = Rotation(self.dim, self.seed, self.kind, signs, self._matrix.to(device))
            moved.derived = self.derived
        return moved

    def __getstate__(self) -> dict:
        """Pickled and deep-copied without its copies on other devices (made again by `to`): a pickle holds the
        rotation once, on its own device, and loads where the other devices are missing."""
        return {**self.__dict__, "_on": {}}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one GEMM beats log2(d) butterfly passes of small torch ops on CPU; Triton kernels do the butterfly
        x = x.float()
        return x @ self._matrix.to(x.device).T

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        y = y.float()
        return y @ self._matrix.to(y.device)


def make_rotation(dim: int, seed: int = 0, kind: str = "auto") -> Rotation:
    """Build the rotation for `dim`; `kind="auto"` picks Hadamard for powers of two, else orthogonal."""
    if not isinstance(dim, int) or dim < 2:
        raise ValueError(f"head dim must be an integer >= 2, got {dim!r}")
    if kind not in ROTATION_KINDS:
        raise ValueError(f"rotation must be one of {ROTATION_KINDS}, got {kind!r}")
    if kind == "auto":
        kind = "hadamard" if is_power_of_two(dim) else "orthogonal"
    if kind == "hadamard" and not is_power_of_two(dim):
        raise ValueError(
            f"rotation='hadamard' needs a power-of-two head dim, got {dim}; use rotation='orthogonal' or 'auto'"
        )
    g = _generator(seed)
    if kind == "hadamard":
        signs = (torch.randint(0, 2, (dim,), generator=g) * 2 - 1).to(torch.float32)
        eye = torch.eye(dim, dtype=torch.float64)
        matrix = (fwht(eye * signs.double()) / math.sqrt(dim)).T.contiguous()
        return Rotation(dim, int(seed), kind, signs, matrix.float())
    gauss = torch.randn(dim, dim, generator=g, dtype=torch.float64)
    q, r = torch.linalg.qr(gauss)
    q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)
    return Rotation(dim, int(seed), kind, None, q.float().contiguous())
