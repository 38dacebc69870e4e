"""Per-layer bit allocation: sensitivities on a tiny model, the budget-constrained choice, save / load."""

import pytest
import torch
from transformers import LlamaForCausalLM

from conftest import tiny_llama_config, with_cache
from tq_hf_cache import TurboQuantCache, TurboQuantConfig
from tq_hf_cache.calibrate.allocation import allocate_bits, bits_per_coordinate, calibrate_bits, measure_sensitivity


def fresh_seed() -> int:
    return torch.seed() % 2**31


def test_bits_per_coordinate_counts_codes_and_norms():
    assert bits_per_coordinate({0: [4, 2]}, 64) == 3.25  # (32 + 16 + 2 + 2) bytes for 128 coordinates
    assert bits_per_coordinate({0: [5, 3], 1: [3, 1]}, 128) == pytest.approx(((5 + 3) / 2 + (3 + 1) / 2) / 2 + 0.125)
    assert bits_per_coordinate({0: [4, 4]}, 64, "float32") == 4.5


def _synthetic(seed, layers=6):
    """KLs that fall by ~4x per bit, each layer scaled by its own random sensitivity."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(layers, 2, generator=g) * 100
    return {i: {"key": {b: float(scale[i, 0]) * 4.0**-b for b in (2, 3, 4, 5, 6)},
                "value": {b: float(scale[i, 1]) * 4.0**-b for b in (1, 2, 3, 4)}} for i in range(layers)}


@pytest.mark.parametrize("budget", [2.0, 2.5, 3.25, 4.25])
def test_allocation_spends_at_most_the_budget_and_beats_uniform(budget):
    seed = fresh_seed()
    sens = _synthetic(seed)
    choice = allocate_bits(sens, budget, 64)
    assert sorted(choice) == list(range(6)), f"seed {seed}"
    assert bits_per_coordinate(choice, 64) <= budget + 1e-9, f"seed {seed}: {choice}"
    cost = sum(sens[i]["key"][k] + sens[i]["value"][v] for i, (k, v) in choice.items())
    uniform = {2.0: (2, 1), 2.5: (3, 1), 3.25: (4, 2), 4.25: (5, 3)}[budget]  # within each budget
    assert bits_per_coordinate({0: list(uniform)}, 64) <= budget
    flat = sum(sens[i]["key"][uniform[0]] + sens[i]["value"][uniform[1]] for i in sens)
    assert cost <= flat + 1e-12, f"seed {seed}: allocated {cost} vs uniform {flat}"


def test_allocation_gives_the_sensitive_layer_more_bits():
    sens = {i: {"key": {b: 4.0**-b for b in (2, 3, 4, 5, 6)}, "value": {b: 4.0**-b for b in (1, 2, 3, 4)}}
            for i in range(4)}
    sens[2]["key"] = {b: 1000 * 4.0**-b for b in (2, 3, 4, 5, 6)}
    choice = allocate_bits(sens, 3.25, 64)
    assert choice[2][0] == max(k for k, _ in choice.values()) > min(k for k, _ in choice.values())


def test_allocation_refuses_a_budget_below_the_narrowest_widths():
    with pytest.raises(ValueError, match="below the narrowest"):
        allocate_bits(_synthetic(0), 1.5, 64)  # k2v1 costs 1.75 bits per coordinate at head dim 64


@torch.no_grad()
def test_sensitivities_on_a_tiny_model_and_the_saved_allocation(tmp_path):
    torch.manual_seed(0)
    cfg = tiny_llama_config(num_hidden_layers=3)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(1))
    base = TurboQuantConfig(residual_length=8, sink_tokens=0)
    sens = measure_sensitivity(model, ids, chunk=64, base=base, key_bits=(2, 5), value_bits=(1, 4), progress=False)
    assert sorted(sens) == [0, 1, 2]
    for i in sens:
        assert sorted(sens[i]["key"]) == [2, 5] and sorted(sens[i]["value"]) == [1, 4]
        # 1-bit values move the output far more than 4-bit ones (a wide gap: it holds for random weights too)
        assert sens[i]["value"][1] > sens[i]["value"][4] >= 0
        assert sens[i]["key"][2] >= 0 and sens[i]["key"][5] >= 0
    config, measured = calibrate_bits(model, ids, 2.5, tokens=200, chunk=64, base=base, progress=False)
    assert bits_per_coordinate(config.layer_bits, 32) <= 2.5
    config.save_pretrained(tmp_path, model_config=cfg)
    cache = TurboQuantCache.from_pretrained(tmp_path, config=cfg)
    assert cache.tq_config.layer_bits == config.layer_bits
    assert [(l.key_bits, l.value_bits) for l in cache.layers] == [tuple(config.layer_bits[i]) for i in range(3)]
    model(ids[:, :100], **with_cache(cache))  # the allocated cache runs


def test_bad_arguments_are_refused_by_name(tiny_llama):
    ids = torch.randint(3, 128, (1, 100))
    with pytest.raises(ValueError, match="budget must be a positive"):
        calibrate_bits(tiny_llama, ids, 0.0)
    with pytest.raises(ValueError, match="needs tokenizer"):
        calibrate_bits(tiny_llama, "some text", 3.0)
    with pytest.raises(ValueError, match="tokens=1024"):
        calibrate_bits(tiny_llama, ids, 3.0)
    with pytest.raises(ValueError, match="without layer_bits or skips"):
        calibrate_bits(tiny_llama, ids, 3.0, base=TurboQuantConfig(skip_first=1))
    with pytest.raises(ValueError, match="T > chunk"):
        measure_sensitivity(tiny_llama, ids, chunk=256)
    with pytest.raises(ValueError, match="value_bits must be"):
        measure_sensitivity(tiny_llama, ids, chunk=64, value_bits=(0, 2))


def test_an_allocation_folder_is_an_eval_cache(tmp_path):
    from tq_hf_cache.tools.eval.caches import folder_spec

    cfg = tiny_llama_config(num_hidden_layers=2, head_dim=64)
    TurboQuantConfig(layer_bits={0: [5, 3], 1: [3, 1]}).save_pretrained(tmp_path / "alloc", model_config=cfg)
    spec = folder_spec(str(tmp_path / "alloc"))
    assert spec.name == "alloc" and spec.family == "turboquant"
    # H x mean over layers of (codes + 2 float16 norms): (40 + 24 + 4 + 24 + 8 + 4) / 2 bytes per KV head
    assert spec.formula_bytes_per_token_layer(2, 64) == 2 * (40 + 24 + 4 + 24 + 8 + 4) / 2
    cache = spec.make(cfg)
    x = torch.randn(1, 2, 5, 64)
    cache.update(x, x, 0)
    cache.update(x, x, 1)
    assert [(l.key_bits, l.value_bits) for l in cache.layers] == [(5, 3), (3, 1)]


@pytest.mark.parametrize("args,match", [
    (["allocate", "smollm2", "--budget", "3.25"], "pass --out DIR"),
    (["allocate", "smollm2", "--budget", "0", "--out", "X"], "--budget must be a positive"),
    (["allocate", "smollm2", "--budget", "nan", "--out", "X"], "--budget must be a positive"),
    (["allocate", "smollm2", "--budget", "3", "--tokens", "100", "--out", "X"], "pass --tokens 257 or more"),
    (["allocate", "smollm2", "--budget", "3", "--tokens", "192", "--chunk", "128", "--out", "X"], "measure nothing"),
    (["allocate", "smollm2", "--budget", "3", "--chunk", "0", "--out", "X"], "chunk must be a positive"),
    (["allocate", "/no/such/folder", "--budget", "3"], "is not a folder"),
])
def test_allocate_cli_refuses_bad_arguments_before_loading_the_model(tmp_path, capsys, monkeypatch, args, match):
    from tq_hf_cache import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "_load_model", lambda *a, **k: pytest.fail("the model must not load"))
    assert cli.main(args) == 2
    assert match in capsys.readouterr().err


def test_sliding_layers_weigh_by_the_tokens_they_hold():
    from transformers import Gemma3TextConfig

    from tq_hf_cache.calibrate.allocation import layer_token_weights

    cfg = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=64, sliding_window=32)
    w = layer_token_weights(cfg, 128)
    assert w == {0: 0.25, 1: 0.25, 2: 0.25, 3: 0.25, 4: 0.25, 5: 1.0}
    assert layer_token_weights(cfg, 16)[0] == 1.0  # a context inside the window: every layer holds all of it
    with pytest.raises(ValueError, match="context must be a positive"):
        layer_token_weights(cfg, 0)
    # equally sensitive layers: the cheap (sliding) ones get the bits, and the weighted bytes stay in the budget
    sens = {i: {"key": {b: 4.0**-b for b in (2, 3, 4, 5, 6)}, "value": {b: 4.0**-b for b in (1, 2, 3, 4)}}
            for i in range(6)}
    choice = allocate_bits(sens, 3.0, 64, weights=w)
    assert bits_per_coordinate(choice, 64, weights=w) <= 3.0
    assert sum(choice[0]) > sum(choice[5])
    assert bits_per_coordinate(choice, 64) > 3.0  # unweighted, it would look over budget


@torch.no_grad()
def test_tokens_that_reach_no_quantized_token_are_refused_and_the_minimum_measures():
    """Below `min_tokens` no scored position attends to a quantized token (every KL would be 0 and the narrowest
    widths would win any budget): refused naming tokens, chunk and residual_length. At the minimum the
    sensitivities are not all 0."""
    from tq_hf_cache.calibrate.allocation import min_tokens

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config()).eval()
    ids = torch.randint(3, 128, (1, 400), generator=torch.Generator().manual_seed(2))
    base = TurboQuantConfig(residual_length=16, sink_tokens=4)
    least = min_tokens(16, base)
    assert least == 49  # the window overflows its capacity (16 + 16) at the chunk boundary 48
    with pytest.raises(ValueError, match=r"48 tokens in chunks of 16 with residual_length=16 and sink_tokens=4 "
                                         r"measure nothing.*at least 49 tokens"):
        measure_sensitivity(model, ids[:, :48], chunk=16, base=base, key_bits=(2,), value_bits=(1,), progress=False)
    with pytest.raises(ValueError, match=r"192 tokens in chunks of 128 with residual_length=128"):
        calibrate_bits(model, ids, 3.0, tokens=192, chunk=128, progress=False)
    sens = measure_sensitivity(model, ids[:, :least], chunk=16, base=base, key_bits=(2,), value_bits=(1,),
                               progress=False)
    assert any(sens[i][k][b] > 0 for i in sens for k, b in (("key", 2), ("value", 1)))
    for chunk, r, sinks in ((16, 8, 0), (8, 20, 0), (16, 4, 0), (16, 4, 24)):
        b = TurboQuantConfig(residual_length=r, sink_tokens=sinks)
        n = min_tokens(chunk, b)
        if n - 1 > chunk:
            with pytest.raises(ValueError, match="measure nothing"):
                measure_sensitivity(model, ids[:, : n - 1], chunk=chunk, base=b, key_bits=(2,), value_bits=(1,),
                                    progress=False)
        s = measure_sensitivity(model, ids[:, :n], chunk=chunk, base=b, key_bits=(2,), value_bits=(1,), progress=False)
        assert any(v > 0 for layer in s.values() for d in layer.values() for v in d.values()), (chunk, r, sinks)


def test_all_zero_sensitivities_are_refused(monkeypatch):
    """A measurement where no width moved the output (every KL 0) is an error, not an allocation of the narrowest
    widths."""
    from tq_hf_cache import allocation

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config()).eval()
    ids = torch.randint(3, 128, (1, 100), generator=torch.Generator().manual_seed(2))
    real = allocation._chunk_logprobs
    monkeypatch.setattr(allocation, "_chunk_logprobs",
                        lambda m, i, cache, chunk: real(m, i, TurboQuantCache("k8v4", skip_first=2, config=m.config),
                                                        chunk))
    with pytest.raises(ValueError, match=r"every one of the 4 measured sensitivities is 0"):
        measure_sensitivity(model, ids, chunk=16, base=TurboQuantConfig(residual_length=0, sink_tokens=0),
                            key_bits=(2,), value_bits=(1,), progress=False)
