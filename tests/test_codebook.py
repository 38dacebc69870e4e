import math

import pytest
import torch

from tq_hf_cache.quant.codebook import Codebook, coordinate_density, expected_mse, theoretical_codebook


@pytest.mark.parametrize("dim", [64, 128, 256])
def test_density_integrates_to_one_with_variance_one_over_d(dim):
    x = torch.linspace(-1, 1, 200_001, dtype=torch.float64)
    f = coordinate_density(x, dim)
    assert abs(torch.trapezoid(f, x).item() - 1) < 1e-6
    assert abs(torch.trapezoid(f * x * x, x).item() * dim - 1) < 1e-4


@pytest.mark.parametrize("bits", range(1, 9))
def test_codebook_is_sorted_symmetric_and_deterministic(bits):
    cb = theoretical_codebook(bits, 128)
    c = cb.centroids
    assert c.shape == (2**bits,) and cb.boundaries.shape == (2**bits - 1,)
    assert torch.all(c[1:] > c[:-1])
    assert torch.allclose(c, -c.flip(0), atol=1e-7)
    assert torch.equal(c, theoretical_codebook(bits, 128).centroids)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_lloyd_max_fixed_point(bits):
    """Each centroid is the conditional mean of its cell: the optimality condition Lloyd-Max converges to."""
    dim = 128
    cb = theoretical_codebook(bits, dim)
    x = torch.linspace(-1, 1, 2_000_001, dtype=torch.float64)
    f = coordinate_density(x, dim)
    cell = torch.bucketize(x, cb.boundaries.double())
    for i, c in enumerate(cb.centroids.double()):
        m = cell == i
        mean = (f[m] * x[m]).sum() / f[m].sum()
        assert abs(mean.item() - c.item()) < 1e-4 / math.sqrt(dim)


def test_one_bit_centroids_match_closed_form():
    # for large d a coordinate is ~N(0, 1/d): the 1-bit centroids are +-sqrt(2/(pi d))
    dim = 256
    c = theoretical_codebook(1, dim).centroids
    assert abs(c[1].item() - math.sqrt(2 / (math.pi * dim))) < 2e-3 * c[1].item() * 10


# E||x - x_hat||^2 for unit x at d=128: the paper's table (0.36, 0.117, 0.03, 0.009), which rounds the
# Lloyd-Max figures 0.3634, 0.1175, 0.03454, 0.009497 of the Gaussian limit.
PAPER = {1: 0.36, 2: 0.117, 3: 0.03, 4: 0.009}


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_expected_mse_reproduces_paper(bits):
    mse = expected_mse(theoretical_codebook(bits, 128), 128)
    assert abs(mse - PAPER[bits]) / PAPER[bits] < 0.15


def test_codebook_errors():
    with pytest.raises(ValueError, match=r"bits must be an integer in \[1, 8\], got 9"):
        theoretical_codebook(9, 128)
    with pytest.raises(ValueError, match=r"bits must be an integer in \[1, 8\], got 0"):
        theoretical_codebook(0, 128)
    with pytest.raises(ValueError, match="shape"):
        Codebook.from_centroids(torch.zeros(5), 2)
    with pytest.raises(ValueError, match="NaN"):
        Codebook.from_centroids(torch.tensor([0.0, float("nan"), 1.0, 2.0]), 2)
