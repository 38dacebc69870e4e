import pytest
import torch

from tq_hf_cache.quant.packing import pack_indices, packed_bytes, unpack_indices


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("dim", [64, 80, 96, 128, 13, 3])
def test_pack_unpack_bit_exact(bits, dim):
    g = torch.Generator().manual_seed(bits * 1000 + dim)
    idx = torch.randint(0, 2**bits, (3, 5, 7, dim), generator=g)
    packed = pack_indices(idx, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (3, 5, 7, (dim * bits + 7) // 8)
    assert torch.equal(unpack_indices(packed, bits, dim), idx)


def test_three_bits_cost_three_bits():
    assert packed_bytes(128, 3) == 48
    assert packed_bytes(64, 3) == 24
    assert packed_bytes(128, 4) == 64
    assert packed_bytes(128, 2) == 32
    assert packed_bytes(128, 1) == 16
    assert packed_bytes(80, 3) == 30


def test_layout_is_lsb_first_bitstream():
    # indices 1,2,3 at 3 bits: bits 0-2 = 001, 3-5 = 010, 6-8 = 011 -> byte0 = 0b11_010_001, byte1 = 0b0
    packed = pack_indices(torch.tensor([[1, 2, 3]]), 3)
    assert packed.tolist() == [[0b11010001, 0b0]]
    assert pack_indices(torch.tensor([[1, 2]]), 4).tolist() == [[0x21]]


def test_packing_errors():
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        pack_indices(torch.tensor([[8]]), 3)
    with pytest.raises(ValueError, match="last dim 48"):
        unpack_indices(torch.zeros(2, 47, dtype=torch.uint8), 3, 128)
    with pytest.raises(ValueError, match="bits"):
        pack_indices(torch.tensor([[1]]), 9)
