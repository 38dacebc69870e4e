"""The examples run as a new user runs them (embedded SmolLM2 model, CPU), with small settings."""

import importlib.util
import os

import pytest

EXAMPLES = os.path.join(os.path.dirname(__file__), os.pardir, "examples")


def load_example(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.model
def test_generate_demo(smollm2, monkeypatch, capsys):
    import tq_hf_cache.models

    monkeypatch.setattr(tq_hf_cache.models, "load_smollm2", lambda *a, **k: smollm2)
    demo = load_example("generate_demo")
    try:
        assert demo.main(["--new-tokens", "12", "--context-chars", "2500"]) == 0
    finally:
        smollm2[0].set_attn_implementation("sdpa")  # the demo selects the turboquant attention on the shared model
    out = capsys.readouterr().out
    assert "[DynamicCache, attention turboquant]" in out and "[TurboQuantCache(k5v3), attention turboquant]" in out
    line = next(l for l in out.splitlines() if l.startswith("memory at "))
    factor = float(line.split("x less")[0].rsplit("(", 1)[1])
    assert factor > 1.5, line  # both caches hold the same tokens; most of them are packed
    assert "verdict: the two answers are" in out


@pytest.mark.model
def test_pipeline_chat_reuses_the_cache_across_turns(smollm2, monkeypatch, capsys):
    import re

    import tq_hf_cache.models

    monkeypatch.setattr(tq_hf_cache.models, "load_smollm2", lambda *a, **k: smollm2)
    assert load_example("pipeline_chat").main(["--new-tokens", "6", "--context-chars", "1200", "--turns", "2"]) == 0
    out = capsys.readouterr().out
    turns = re.findall(r"\[turn (\d)\] (\d+) prompt tokens, (\d+) prefilled this turn", out)
    assert [t[0] for t in turns] == ["1", "2"]
    prompt2, prefilled2 = int(turns[1][1]), int(turns[1][2])
    assert 0 < prefilled2 < prompt2 / 4  # the second turn prefills its new message, not the history
    assert out.count("assistant: ") == 2


@pytest.mark.model
def test_calibrate_and_save(smollm2, monkeypatch, capsys, tmp_path):
    import tq_hf_cache.models

    monkeypatch.setattr(tq_hf_cache.models, "load_smollm2", lambda *a, **k: smollm2)
    example = load_example("calibrate_and_save")
    assert example.main(["--tokens", "256", "--eval-tokens", "300", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["turboquant_codebooks.safetensors", "turboquant_config.json"]
    assert "theoretical" in out and "calibrated" in out and "against full precision" in out


@pytest.mark.model
def test_long_context(smollm2, monkeypatch, capsys):
    import tq_hf_cache.models

    monkeypatch.setattr(tq_hf_cache.models, "load_smollm2", lambda *a, **k: smollm2)
    assert load_example("long_context").main(["--tokens", "1200", "--new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    prompt = int(out.split("prompt: ")[1].split(" tokens")[0])
    assert 1000 < prompt <= 1200
    assert out.count("the code 48213 is found") == 2  # full precision and TurboQuant both find it at this length
    assert "x less with TurboQuantCache" in out
