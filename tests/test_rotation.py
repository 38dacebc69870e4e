import pytest
import torch

from tq_hf_cache.quant.rotation import fwht, is_power_of_two, make_rotation


@pytest.mark.parametrize("dim", [64, 80, 96, 112, 128, 256])
def test_rotation_is_orthogonal_and_exact(dim):
    rot = make_rotation(dim, seed=dim + 7)
    assert rot.kind == ("hadamard" if is_power_of_two(dim) else "orthogonal")
    m = rot.matrix.double()
    assert torch.allclose(m @ m.T, torch.eye(dim, dtype=torch.float64), atol=1e-6)
    x = torch.randn(3, 5, 7, dim, generator=torch.Generator().manual_seed(dim))
    y = rot.forward(x)
    assert torch.allclose(y, x @ rot.matrix.T, atol=1e-5)
    assert torch.allclose(rot.inverse(y), x, atol=2e-6 * x.abs().max())
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5)


def test_rotation_is_deterministic_in_the_seed():
    a, b, c = make_rotation(128, 3), make_rotation(128, 3), make_rotation(128, 4)
    assert torch.equal(a.matrix, b.matrix)
    assert not torch.equal(a.matrix, c.matrix)
    assert torch.equal(make_rotation(96, 1).matrix, make_rotation(96, 1).matrix)


def test_fwht_matches_dense_hadamard():
    h = torch.tensor([[1.0]])
    while h.shape[0] < 16:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    x = torch.randn(4, 16)
    assert torch.allclose(fwht(x), x @ h, atol=1e-5)


def test_rotation_errors_name_the_bad_value():
    with pytest.raises(ValueError, match="power-of-two.*96"):
        make_rotation(96, kind="hadamard")
    with pytest.raises(ValueError, match="rotation must be one of"):
        make_rotation(64, kind="givens")
    with pytest.raises(ValueError, match="head dim"):
        make_rotation(1)
