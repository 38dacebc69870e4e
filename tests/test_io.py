"""`tq_hf_cache._io`: atomic writes, the block digest and the safetensors reader, against plain hashlib and the
safetensors package."""

import hashlib
import os
import random

import pytest
import torch
from safetensors.torch import save

from tq_hf_cache import _io


def test_the_block_digest_is_sha256_of_the_blocks_digests():
    data = os.urandom(2 * _io.DIGEST_BLOCK + 12345)
    blocks = [data[i: i + _io.DIGEST_BLOCK] for i in range(0, len(data), _io.DIGEST_BLOCK)]
    want = hashlib.sha256(b"".join(hashlib.sha256(b).digest() for b in blocks)).hexdigest()
    assert _io.sha256_blocks(data) == want
    assert _io.sha256_blocks(b"") == hashlib.sha256(hashlib.sha256(b"").digest()).hexdigest()
    assert _io.sha256_blocks(data[:-1] + bytes([data[-1] ^ 1])) != want


def test_parse_safetensors_reads_what_safetensors_wrote(tmp_path):
    seed = random.randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    tensors = {  # odd sizes, so that later tensors start at offsets no dtype's alignment promises
        "a": torch.randint(0, 255, (3, 5, 7), generator=g, dtype=torch.uint8),
        "b": torch.randn(2, 9, generator=g).half(),
        "c": torch.randn(5, generator=g).bfloat16(),
        "d": torch.randn(3, 3, generator=g),
        "e": torch.zeros(0, 4),
        "f": torch.randint(-9, 9, (4,), generator=g, dtype=torch.int64),
    }
    path = tmp_path / "t.safetensors"
    path.write_bytes(save(tensors, metadata={"k": "v"}))
    got = _io.parse_safetensors(_io.read_private(str(path)), str(path))
    assert set(got) == set(tensors), f"seed {seed}"
    for k, v in tensors.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, f"{k} (seed {seed})"
        torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=f"tensor {k} (seed {seed})")
    got["a"].fill_(7)  # each tensor is a copy of its own: writing one leaves the others (and the file) alone
    for k, v in tensors.items():
        if k != "a":
            torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=f"tensor {k} after a write to 'a' (seed {seed})")
    assert _io.parse_safetensors(_io.read_private(str(path)), str(path))["a"].equal(tensors["a"]), f"seed {seed}"
    views = _io.parse_safetensors(_io.read_private(str(path)), str(path), copy=False)  # what load_prefix reads
    for k, v in tensors.items():
        torch.testing.assert_close(views[k], v, rtol=0, atol=0, msg=f"view of tensor {k} (seed {seed})")


@pytest.mark.parametrize("mutate, message", [
    (lambda b: b[:5], "fewer than its 8-byte header"),
    (lambda b: (10**9).to_bytes(8, "little") + b[8:], "its header claims"),
    (lambda b: b[:8] + b"\xff" + b[9:], "not valid JSON"),
    (lambda b: b[:-3], "malformed"),
])
def test_a_malformed_safetensors_file_is_a_value_error_naming_it(tmp_path, mutate, message):
    path = tmp_path / "t.safetensors"
    path.write_bytes(mutate(save({"x": torch.arange(6.0)})))
    with pytest.raises(ValueError, match=message) as e:
        _io.parse_safetensors(_io.read_private(str(path)), str(path))
    assert str(path) in str(e.value)


def test_writes_replace_a_planted_symlink_instead_of_following_it(tmp_path):
    target = tmp_path / "target"
    target.write_text("keep")
    link = tmp_path / "out.json"
    link.symlink_to(target)
    _io.write_text(str(link), "new")
    assert target.read_text() == "keep" and not link.is_symlink() and link.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json", "target"]


def test_a_new_folder_appears_whole_or_not_at_all(tmp_path, monkeypatch):
    calls = []
    real = _io.write_bytes

    def failing(path, data):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full")
        return real(path, data)

    monkeypatch.setattr(_io, "write_bytes", failing)
    with pytest.raises(OSError, match="disk full"):
        _io.write_folder(str(tmp_path / "new"), {"a": b"1", "b": b"2"})
    assert list(tmp_path.iterdir()) == []
