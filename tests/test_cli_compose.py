"""calibrate / allocate / split-keys into one folder: results that compose are merged, the others are refused by
name before any model loads; none is dropped silently. split-keys --base of another model is refused."""

import hashlib
import os

import pytest
import torch
from transformers import LlamaForCausalLM

from conftest import tiny_llama_config
from tq_hf_cache import TurboQuantCache, TurboQuantConfig, cli
from tq_hf_cache.calibrate.calibration import CODEBOOKS_NAME, CalibratedCodebooks
from tq_hf_cache.config import TURBOQUANT_CONFIG_NAME, read_turboquant_json


class _Ids(dict):
    @property
    def input_ids(self):
        return self["input_ids"]


class FakeTokenizer:
    """Bytes of the text as token ids (3..127): enough for the three commands, no tokenizer files."""

    eos_token_id = 2

    def __call__(self, text, add_special_tokens=True, return_tensors=None):
        ids = [3 + b % 125 for b in text.encode("utf-8")]
        return _Ids(input_ids=torch.tensor([ids]) if return_tensors == "pt" else ids)


def _model(layers=2):
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(num_hidden_layers=layers)).eval()


@pytest.fixture(scope="module")
def model():
    return _model()


@pytest.fixture
def env(tmp_path, monkeypatch, model):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    model.config.save_pretrained(model_dir)
    loads = []

    def load(path, gguf, tokenizer_optional=False):
        loads.append(path)
        return model, FakeTokenizer()

    monkeypatch.setattr(cli, "_load_model", load)
    return str(model_dir), tmp_path / "out", loads


COMMANDS = {
    "calibrate": ["calibrate", "{m}", "--out", "{o}", "--max-tokens", "200", "--seq-len", "100", "--no-progress"],
    "allocate": ["allocate", "{m}", "--out", "{o}", "--budget", "3.25", "--tokens", "200", "--chunk", "64",
                 "--no-progress"],
    "split-keys": ["split-keys", "{m}", "--out", "{o}", "--sizes", "16,16", "--deltas", "1,-1", "--tokens", "64"],
}


def run(capsys, name, m, o, *more):
    rc = cli.main([a.format(m=m, o=o) for a in COMMANDS[name]] + list(more))
    return rc, capsys.readouterr().err


def _files(folder):
    return {p: hashlib.sha256(open(os.path.join(folder, p), "rb").read()).hexdigest() for p in os.listdir(folder)}


def test_allocate_then_calibrate_fits_the_allocation_and_keeps_it(env, capsys, model):
    m, o, _ = env
    assert run(capsys, "allocate", m, o)[0] == 0
    alloc = TurboQuantConfig.from_pretrained(o).layer_bits
    rc, err = run(capsys, "calibrate", m, o)
    assert rc == 0, err
    cfg = TurboQuantConfig.from_pretrained(o)
    assert cfg.layer_bits == alloc and "bit_allocation" in read_turboquant_json(o)
    CalibratedCodebooks.from_pretrained(o).check_covers(cfg)
    TurboQuantCache.from_pretrained(o, config=model.config)
    rc, err = run(capsys, "calibrate", m, o, "--preset", "k4v4")
    assert rc == 2 and "a bit allocation (layer_bits)" in err and "--preset" in err, err


@pytest.mark.parametrize("first, held, advice", [("calibrate", "holds calibrated codebooks", "another --out"),
                                                  ("split-keys", "holds a key split", "--base")])
def test_allocate_over_another_result_is_refused_before_the_model_loads(env, capsys, first, held, advice):
    m, o, loads = env
    assert run(capsys, first, m, o)[0] == 0
    before, n = _files(o), len(loads)
    rc, err = run(capsys, "allocate", m, o)
    assert rc == 2 and held in err and advice in err, err
    assert len(loads) == n and _files(o) == before


def test_allocate_then_split_keys_splits_on_top_of_the_allocation(env, capsys):
    m, o, loads = env
    assert run(capsys, "allocate", m, o)[0] == 0
    alloc = TurboQuantConfig.from_pretrained(o).layer_bits
    before, n = _files(o), len(loads)
    rc, err = run(capsys, "split-keys", m, o, "--base", "k4v2")
    assert rc == 2 and "holds a bit allocation (layer_bits)" in err and "Drop --base" in err, err
    assert len(loads) == n and _files(o) == before
    assert run(capsys, "split-keys", m, o)[0] == 0
    cfg = TurboQuantConfig.from_pretrained(o)
    assert cfg.layer_bits == alloc and "bit_allocation" in read_turboquant_json(o)
    assert {i: s["bits"] for i, s in cfg.key_split.items()} == {i: [k + 1, k - 1] for i, (k, _) in alloc.items()}


def test_calibrate_then_split_keys_keeps_the_codebooks(env, capsys, model):
    m, o, loads = env
    assert run(capsys, "calibrate", m, o)[0] == 0
    n = len(loads)
    rc, err = run(capsys, "split-keys", m, o, "--key-centering")
    assert rc == 2 and "calibrated codebooks, fitted to uncentred keys" in err and len(loads) == n, err
    assert run(capsys, "split-keys", m, o)[0] == 0
    cfg = TurboQuantConfig.from_pretrained(o)
    assert cfg.key_split and os.path.exists(os.path.join(o, CODEBOOKS_NAME))
    cache = TurboQuantCache.from_pretrained(o, config=model.config)
    assert cache.codebooks is not None and cache.tq_config.key_split == cfg.key_split


def test_split_keys_then_calibrate_keeps_the_split(env, capsys, model):
    m, o, loads = env
    assert run(capsys, "split-keys", m, o)[0] == 0
    split = TurboQuantConfig.from_pretrained(o).key_split
    n = len(loads)
    rc, err = run(capsys, "calibrate", m, o, "--key-bits", "3")
    assert rc == 2 and "holds a key split" in err and len(loads) == n, err
    rc, err = run(capsys, "calibrate", m, o, "--seed", "3")
    assert rc == 2 and "under seed=0" in err, err
    assert run(capsys, "calibrate", m, o)[0] == 0
    cache = TurboQuantCache.from_pretrained(o, config=model.config)
    assert cache.tq_config.key_split == split and cache.codebooks is not None
    assert "key_split_calibration" in read_turboquant_json(o)


def test_split_keys_then_calibrate_refuses_centred_keys(env, capsys):
    m, o, loads = env
    assert run(capsys, "split-keys", m, o, "--key-centering")[0] == 0
    n = len(loads)
    rc, err = run(capsys, "calibrate", m, o)
    assert rc == 2 and "centres the keys" in err and len(loads) == n, err


def test_split_keys_refuses_a_base_of_another_model(env, capsys, tmp_path, monkeypatch):
    m, o, loads = env
    other = _model(layers=3)
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    other.config.save_pretrained(other_dir)
    monkeypatch.setattr(cli, "_load_model", lambda *a, **k: (other, FakeTokenizer()))
    assert run(capsys, "allocate", str(other_dir), str(tmp_path / "alloc3"))[0] == 0
    monkeypatch.setattr(cli, "_load_model", lambda *a, **k: pytest.fail("the model must not load"))
    rc, err = run(capsys, "split-keys", m, o, "--base", str(tmp_path / "alloc3"))
    assert rc == 2 and "num_hidden_layers=3" in err and "num_hidden_layers=2" in err, err
    # a model folder without config.json: the loaded model's facts are compared before any measuring
    bare = tmp_path / "bare"
    bare.mkdir()
    model = _model()
    monkeypatch.setattr(cli, "_load_model", lambda *a, **k: (model, FakeTokenizer()))
    rc, err = run(capsys, "split-keys", str(bare), o, "--base", str(tmp_path / "alloc3"))
    assert rc == 2 and "num_hidden_layers=3" in err, err
    assert not os.path.exists(o / TURBOQUANT_CONFIG_NAME)
