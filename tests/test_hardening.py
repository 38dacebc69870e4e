"""Refusals at the edges: a kernel cache that others may write is not loaded, `bench` takes contexts longer than the
shipped text, `allocate` refuses an unreachable budget before it measures, and deeply nested JSON is a ValueError
naming the file, not a RecursionError."""

import json
import os
import stat
import warnings

import pytest
import torch
import transformers

from tq_hf_cache import cli
from tq_hf_cache.kernels import disk_cache

MAGIC = b"tq test entry\n"


@pytest.fixture
def umask_002():
    old = os.umask(0o002)
    try:
        yield
    finally:
        os.umask(old)


@pytest.fixture
def kernel_dir(tmp_path, monkeypatch):
    folder = tmp_path / "kernels"
    monkeypatch.setenv("TQ_HF_CACHE_KERNEL_DIR", str(folder))
    monkeypatch.setattr(disk_cache, "_warned", set(), raising=False)
    return folder


def _builder(image=b"\x7fELF image"):
    calls = []

    def build():
        calls.append(1)
        return image

    return build, calls


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_kernel_cache_entries_are_owner_only_under_a_group_umask(kernel_dir, umask_002):
    build, calls = _builder()
    key = disk_cache.key_of("src", 1)
    assert disk_cache.cached(f"k-{key}.so", key, MAGIC, build) == b"\x7fELF image"
    assert _mode(kernel_dir) == 0o700 and _mode(kernel_dir / f"k-{key}.so") == 0o600
    assert disk_cache.cached(f"k-{key}.so", key, MAGIC, build) == b"\x7fELF image" and len(calls) == 1


def test_a_group_writable_entry_is_built_again_and_replaced_owner_only(kernel_dir, umask_002):
    build, calls = _builder()
    key = disk_cache.key_of("src", 2)
    entry = kernel_dir / f"k-{key}.so"
    disk_cache.cached(entry.name, key, MAGIC, build)
    os.chmod(entry, 0o664)  # as an older release left it under umask 002: a group member could rewrite it
    with pytest.warns(RuntimeWarning, match=r"writable by group.*not loading it"):
        assert disk_cache.cached(entry.name, key, MAGIC, build) == b"\x7fELF image"
    assert len(calls) == 2 and _mode(entry) == 0o600
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        disk_cache.cached(entry.name, key, MAGIC, build)  # the replaced entry is loaded, silently
    assert len(calls) == 2


def test_a_group_writable_kernel_folder_is_not_loaded_from(kernel_dir, umask_002):
    build, calls = _builder(b"built here")
    key = disk_cache.key_of("src", 3)
    entry = kernel_dir / f"k-{key}.so"
    disk_cache.cached(entry.name, key, MAGIC, _builder(b"planted")[0])
    os.chmod(kernel_dir, 0o770)
    with pytest.warns(RuntimeWarning, match=r"(?s)writable by group.*chmod go-w " + str(kernel_dir)):
        assert disk_cache.cached(entry.name, key, MAGIC, build) == b"built here"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per folder, not one per kernel
        assert disk_cache.cached(entry.name, key, MAGIC, build) == b"built here"
    assert len(calls) == 2 and entry.read_bytes().endswith(b"planted")  # nothing written into it either


def test_write_bytes_takes_a_mode_over_the_umask(tmp_path, umask_002):
    from tq_hf_cache._io import write_bytes

    write_bytes(str(tmp_path / "a"), b"x")
    write_bytes(str(tmp_path / "b"), b"x", mode=0o600)
    assert _mode(tmp_path / "a") == 0o664 and _mode(tmp_path / "b") == 0o600


class _CharTokenizer:
    """One token per 5 characters, about what SmolLM2's tokenizer gives for English prose."""

    def __call__(self, text, return_tensors=None):
        return transformers.BatchEncoding({"input_ids": torch.tensor([[ord(c) % 120 + 3 for c in text[::5]]])})


def test_bench_contexts_longer_than_the_package_text_repeat_it_and_say_so(tmp_path, monkeypatch, capsys):
    from tq_hf_cache import bench
    from tq_hf_cache.tools.texts import total_chars

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                   max_position_embeddings=200_000)
    model = transformers.LlamaForCausalLM(cfg).eval()
    monkeypatch.setattr(cli, "_load_model", lambda *a, **k: (model, _CharTokenizer()))
    seen = {}

    def fake_bench(model, rows, contexts, batch, *, text_ids, on_row, **kw):
        seen.update(contexts=contexts, text_ids=text_ids)
        return []

    monkeypatch.setattr(bench, "decode_bench", fake_bench)
    monkeypatch.setattr(bench, "plot", lambda *a: None)
    out = tmp_path / "b.json"
    rc = cli.main(["bench", "--model", "smollm2", "--device", "cpu", "--contexts", "131072", "--steps", "3",
                   "--repeats", "3", "--warmup", "1", "--out", str(out), "--no-progress"])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    n = seen["text_ids"].shape[-1]
    assert n == pytest.approx(total_chars() / 5, rel=0.01)  # the whole text, once
    assert bench.prompt(1, 131072, 128, seen["text_ids"]).shape == (1, 131072)
    note = json.loads(out.read_text())["env"]["prompt"]
    assert f"{n} tokens of" in note and "repeated to fill contexts above" in note and note in printed.out


def test_bench_contexts_beyond_the_model_are_refused_before_it_loads(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "m"
    transformers.LlamaConfig(max_position_embeddings=4096).save_pretrained(folder)
    monkeypatch.setattr(cli, "_load_model", lambda *a, **k: pytest.fail("the model must not load"))
    rc = cli.main(["bench", "--model", str(folder), "--device", "cpu", "--contexts", "1024,131072", "--steps", "3",
                   "--repeats", "3", "--warmup", "1", "--out", str(tmp_path / "x.json")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert "131072" in err and "max_position_embeddings (4096)" in err and "1..4086" in err


def _model_folder(tmp_path, head_dim):
    folder = tmp_path / "model"
    transformers.LlamaConfig(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, hidden_size=64,
                             head_dim=head_dim, vocab_size=128).save_pretrained(folder)
    return folder


def test_allocate_refuses_an_unreachable_budget_before_loading_the_model(tmp_path, monkeypatch, capsys):
    folder = _model_folder(tmp_path, 64)
    monkeypatch.setattr(cli, "_load_model", lambda *a, **k: pytest.fail("the model must not load"))
    rc = cli.main(["allocate", str(folder), "--budget", "1.5", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert "--budget 1.5 is below" in err and "--budget must be >= 1.75" in err  # k2v1 + fp16 norms at head dim 64


def test_allocate_refuses_an_unreachable_budget_before_measuring(tmp_path, monkeypatch, capsys):
    """A folder whose config.json says nothing usable: the check runs on the loaded model, before any measurement."""
    from tq_hf_cache import allocation

    folder = tmp_path / "gguf_only"
    folder.mkdir()
    cfg = transformers.LlamaConfig(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                   hidden_size=64, head_dim=32, vocab_size=128)
    model = transformers.LlamaForCausalLM(cfg).eval()
    monkeypatch.setattr(cli, "_load_model", lambda *a, **k: (model, _CharTokenizer()))
    monkeypatch.setattr(allocation, "measure_sensitivity", lambda *a, **k: pytest.fail("nothing may be measured"))
    rc = cli.main(["allocate", str(folder), "--budget", "1.9", "--out", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "--budget 1.9 is below" in err and "must be >= 2" in err, err
    with pytest.raises(ValueError, match=r"budget 1.9 is below .*budget must be >= 2"):
        allocation.calibrate_bits(model, torch.zeros(1, 400, dtype=torch.long), 1.9, tokens=400, chunk=64)


def test_min_budget_is_the_narrowest_widths():
    from tq_hf_cache.calibrate.allocation import bits_per_coordinate, check_budget, min_budget

    assert min_budget(64) == bits_per_coordinate({0: [2, 1]}, 64) == 1.75
    assert min_budget(64, key_bits=(3, 4), value_bits=(2,)) == bits_per_coordinate({0: [3, 2]}, 64)
    check_budget(1.75, 64)
    with pytest.raises(ValueError, match=r"must be >= 1\.75"):
        check_budget(1.74, 64)
    shown = min_budget(96, key_bits=(3,), value_bits=(1,), norm_dtype="float32")
    with pytest.raises(ValueError, match=r"must be >= (\S+)") as e:
        check_budget(1.0, 96, key_bits=(3,), value_bits=(1,), norm_dtype="float32")
    check_budget(float(str(e.value).rsplit(">= ", 1)[1]), 96, key_bits=(3,), value_bits=(1,), norm_dtype="float32")
    assert shown > 2


def _deep(levels: int) -> str:
    return "[" * levels + "]" * levels


def _deep_config(folder):
    from tq_hf_cache import TurboQuantConfig

    TurboQuantConfig().save_pretrained(folder)
    path = folder / "turboquant_config.json"
    text = path.read_text()
    path.write_text(text[: text.rindex("}")] + f', "a": {_deep(100_000)}}}')
    return path


def test_a_deeply_nested_turboquant_config_is_a_value_error_naming_file_and_field(tmp_path):
    from tq_hf_cache.config import read_turboquant_json

    path = _deep_config(tmp_path)
    with pytest.raises(ValueError, match=rf"{path}.*deeper than 64 levels in field 'a'"):
        read_turboquant_json(tmp_path)


def test_info_on_a_deeply_nested_config_prints_one_error_line(tmp_path, capsys):
    path = _deep_config(tmp_path)
    rc = cli.main(["info", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc != 0 and err.startswith("error: ") and err.count("\n") == 1 and str(path) in err, err


def test_every_json_the_package_parses_refuses_deep_nesting(tmp_path):
    from tq_hf_cache import TurboQuantConfig
    from tq_hf_cache._io import parse_json, safetensors_layout
    from tq_hf_cache.config import check_model_facts

    with pytest.raises(ValueError, match="TurboQuantConfig JSON is corrupt"):
        TurboQuantConfig.from_json_string('{"key_bits": ' + _deep(5000) + "}")
    (tmp_path / "config.json").write_text('{"model_type": ' + _deep(5000) + "}")
    with pytest.raises(ValueError, match=r"config\.json is corrupt.*in field 'model_type'"):
        check_model_facts({"model": {"model_type": "llama"}}, str(tmp_path))
    header = ('{"__metadata__": ' + _deep(5000) + "}").encode()
    with pytest.raises(ValueError, match="safetensors header is corrupt"):
        safetensors_layout(len(header).to_bytes(8, "little") + header, "x.safetensors")
    # strings are skipped, depth up to the limit parses, keys with escapes are named
    assert parse_json('{"a": "[[[[", "b": ' + _deep(63) + "}", "t")["a"] == "[[[["
    with pytest.raises(ValueError, match=r"in field 'q\"k'"):
        parse_json('{"q\\"k": ' + _deep(64) + "}", "t")
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_json(b"\xff{}", "t")
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_json("[" * 5000 + "}", "t")  # unbalanced and deep: still a ValueError
