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
    assert demo.main(["--new-tokens", "12", "--context-chars", "2500"]) == 0
    out = capsys.readouterr().out
    assert "[DynamicCache]" in out and "[TurboQuantCache(k5v3)]" in out
    line = next(l for l in out.splitlines() if l.startswith("memory at "))
    factor = float(line.split("x less")[0].rsplit("(", 1)[1])
    assert factor > 1.5, line  # both caches hold the same tokens; most of them are packed
    assert "verdict: the two answers are" in out
