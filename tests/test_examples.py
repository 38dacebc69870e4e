"""The examples run as a new user runs them (embedded SmolLM2 model, CPU), with small settings."""

import importlib.util
import os

import pytest
import torch

EXAMPLES = os.path.join(os.path.dirname(__file__), os.pardir, "examples")


def load_example(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.model
def test_generate_demo(smollm2, monkeypatch, capsys):
    import re

    import tq_hf_cache.tools.models

    monkeypatch.setattr(tq_hf_cache.tools.models, "load_smollm2", lambda *a, **k: smollm2)
    demo = load_example("generate_demo")
    assert demo.main(["--new-tokens", "12", "--context-chars", "2500"]) == 0
    out = capsys.readouterr().out
    # what ran is named: the cache, its bits, the model's own attention (the demo sets none)
    assert '[DynamicCache; attention "sdpa"]' in out and '[TurboQuantCache k5v3 (keys 5 bits, values 3 bits' in out
    timings = re.findall(r"prefill ([\d.]+) s, then ([\d.]+) ms per generated token", out)
    assert len(timings) == 2 and all(float(p) > 0 and float(ms) > 0 for p, ms in timings)
    line = next(l for l in out.splitlines() if l.startswith("memory with both caches"))
    factor = float(line.split("x less")[0].rsplit("(", 1)[1])
    assert factor > 1.5, line  # both caches hold the same tokens; most of them are packed
    packed = int(re.search(r"(\d+) tokens per layer packed", out).group(1))
    assert packed > 0 and "nothing was quantized" not in out
    assert re.search(r"picks the same next token at \d+/\d+ steps", out)
    assert "the two answers are identical" in out or "the answers agree for" in out


@pytest.mark.model
def test_pipeline_chat_reuses_the_cache_across_turns(smollm2, monkeypatch, capsys):
    import re

    import tq_hf_cache.tools.models

    monkeypatch.setattr(tq_hf_cache.tools.models, "load_smollm2", lambda *a, **k: smollm2)
    assert load_example("pipeline_chat").main(["--new-tokens", "6", "--context-chars", "1200", "--turns", "2"]) == 0
    out = capsys.readouterr().out
    turns = re.findall(r"\[turn (\d)\] (\d+) prompt tokens, (\d+) prefilled this turn", out)
    assert [t[0] for t in turns] == ["1", "2"]
    prompt2, prefilled2 = int(turns[1][1]), int(turns[1][2])
    assert 0 < prefilled2 < prompt2 / 4  # the second turn prefills its new message, not the history
    assert out.count("assistant: ") == 2


@pytest.mark.model
def test_prefix_store_chat_reuses_system_prompts_and_turns_exactly(smollm2, monkeypatch, capsys):
    import re

    import tq_hf_cache.tools.models

    monkeypatch.setattr(tq_hf_cache.tools.models, "load_smollm2", lambda *a, **k: smollm2)
    assert load_example("prefix_store_chat").main(["--users", "2", "--new-tokens", "4", "--context-chars", "1200"]) == 0
    out = capsys.readouterr().out
    reqs = [(int(a), int(b)) for a, b in re.findall(r"(\d+) prompt tokens, (\d+) reused", out)]
    assert len(reqs) == 8 and all(0 < n < p for p, n in reqs)  # every request reuses a stored prefix
    assert "gives the same answer as a fresh cache" in out


@pytest.mark.model
def test_calibrate_and_save(smollm2, monkeypatch, capsys, tmp_path):
    import tq_hf_cache.tools.models

    monkeypatch.setattr(tq_hf_cache.tools.models, "load_smollm2", lambda *a, **k: smollm2)
    example = load_example("calibrate_and_save")
    assert example.main(["--tokens", "256", "--eval-tokens", "300", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["turboquant_codebooks.safetensors", "turboquant_config.json"]
    assert "theoretical" in out and "calibrated" in out and "against full precision" in out


@pytest.mark.model
def test_long_context(smollm2, monkeypatch, capsys):
    import tq_hf_cache.tools.models

    monkeypatch.setattr(tq_hf_cache.tools.models, "load_smollm2", lambda *a, **k: smollm2)
    assert load_example("long_context").main(["--tokens", "1200", "--new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    prompt = int(out.split("prompt: ")[1].split(" tokens")[0])
    assert 1000 < prompt <= 1200
    assert out.count("the code 48213 is found") == 2  # full precision and TurboQuant both find it at this length
    assert "x less with TurboQuantCache" in out


@pytest.mark.slow
def test_multi_gpu_tensor_parallel_gives_the_single_device_tokens(tmp_path):
    """examples/multi_gpu.py on CPU: tensor parallel over 2 gloo ranks (each rank holds half the KV heads) gives
    every cache the tokens of the one-process run, and device_map="auto" runs."""
    import json
    import subprocess
    import sys

    import transformers

    example = load_example("multi_gpu")
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, head_dim=64, max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    example.sharpen(model)
    model.save_pretrained(tmp_path / "m")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    script = os.path.join(EXAMPLES, "multi_gpu.py")
    common = ["--model", str(tmp_path / "m"), "--context", "300", "--new-tokens", "12"]
    for mode in ("single", "device_map"):
        subprocess.run([sys.executable, script, *common, "--mode", mode, "--json", str(tmp_path / f"{mode}.json")],
                       check=True, env=env, capture_output=True, timeout=300)
    tp = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", script, *common, "--mode", "tp",
         "--json", str(tmp_path / "tp.json"), "--compare", str(tmp_path / "single.json")],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert tp.returncode == 0, tp.stdout[-3000:] + tp.stderr[-3000:]
    res = json.loads((tmp_path / "tp.json").read_text())
    runs = {(r["cache"], r["attn"]): r for r in res["runs"]}
    assert runs[("TurboQuantCache", "turboquant")]["kv_heads_per_layer_here"] == 2  # 4 KV heads over 2 ranks
    assert res["compare"] and all(c["same_tokens"] and c["teacher_forced_top1"] == 1.0 for c in res["compare"].values())
    single = json.loads((tmp_path / "single.json").read_text())
    assert single["runs"][1]["kv_heads_per_layer_here"] == 4


@pytest.mark.model
def test_compiled_generate_runs_both_static_caches(smollm2, monkeypatch, capsys):
    from tq_hf_cache._compat import IS_V5

    if not IS_V5:
        pytest.skip("TurboQuantStaticCache needs transformers >= 5")
    import tq_hf_cache.tools.models

    monkeypatch.setattr(tq_hf_cache.tools.models, "load_smollm2", lambda *a, **k: smollm2)
    try:
        assert load_example("compiled_generate").main(["--context-chars", "2500", "--new-tokens", "8", "--calls", "1"]) == 0
    finally:
        smollm2[0].set_attn_implementation("sdpa")
    out = capsys.readouterr().out
    sizes = {name: float(mib) for name, mib in __import__("re").findall(r"\[(\w+), call 1\].* cache ([\d.]+) MiB", out)}
    assert set(sizes) == {"StaticCache", "TurboQuantStaticCache"}
    assert sizes["TurboQuantStaticCache"] < sizes["StaticCache"] / 2, out
    assert "share" in out and "[StaticCache] " in out and "[TurboQuantStaticCache] " in out  # both answers
