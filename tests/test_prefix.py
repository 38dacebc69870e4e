"""Reusable quantized prompt caches: save_prefix / load_prefix round trips exactly and refuses what does not fit."""

import copy
import json
import os

import pytest
import torch
import transformers
from transformers import LlamaForCausalLM

from conftest import tiny_llama_config, with_cache
from tq_hf_cache import TurboQuantCache
from tq_hf_cache.prefix import PREFIX_JSON, PREFIX_TENSORS


def ids(batch, length, seed=0):
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def llama(**kw):
    torch.manual_seed(0)
    cfg = tiny_llama_config(**kw)
    return cfg, LlamaForCausalLM(cfg).eval()


def gemma3():
    cfg = transformers.Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=12, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention"] * 2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    return cfg, transformers.Gemma3ForCausalLM(cfg).eval()


def steps(model, cache, x, start):
    return [model(x[:, i : i + 1], **with_cache(cache)).logits for i in range(start, x.shape[1])]


@torch.no_grad()
@pytest.mark.parametrize("build, cache_kw", [
    (llama, dict(residual_length=8)),
    (llama, dict(residual_length=8, skip_layers=[1])),  # a full-precision layer beside a quantized one
    (llama, dict(preset="k4v2", residual_length=0, sink_tokens=0)),
    (gemma3, dict(residual_length=4)),  # sliding-window layers past their window
    (llama, dict(residual_length=8, key_centering=True)),  # the key means travel with the codes
    (llama, dict(preset="k4v2", residual_length=8, split=((8, 24), (5, 3)), key_centering=True)),
    (gemma3, dict(preset="k4v2", residual_length=4, split=((4, 4, 8), (6, 4, 3)), key_centering=True)),
])
def test_a_loaded_prefix_continues_with_the_saved_caches_logits(tmp_path, build, cache_kw):
    cfg, model = build()
    kw = dict(cache_kw)
    preset = kw.pop("preset", None)
    if "split" in kw:  # split keys: a random channel order per KV head and layer
        (sizes, bits), g = kw.pop("split"), torch.Generator().manual_seed(3)
        kw["key_split"] = {i: {"bits": list(bits), "sizes": list(sizes),
                               "order": [torch.randperm(sum(sizes), generator=g).tolist()
                                         for _ in range(cfg.num_key_value_heads)]}
                           for i in range(cfg.num_hidden_layers)}
    x = ids(2, 50)
    cache = TurboQuantCache(preset, config=cfg, **kw)
    model(x[:, :40], **with_cache(cache))
    cache.save_prefix(str(tmp_path), x[:, :40])
    loaded = TurboQuantCache.load_prefix(str(tmp_path), cfg, token_ids=x)
    assert loaded.get_seq_length() == 40
    want = steps(model, cache, x, 40)
    got = steps(model, loaded, x, 40)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@torch.no_grad()
def test_generate_from_a_loaded_prefix_and_from_a_deepcopy(tmp_path):
    cfg, model = llama()
    prefix = ids(1, 30)
    cache = TurboQuantCache(config=cfg, residual_length=8)
    model(prefix, **with_cache(cache))
    cache.save_prefix(str(tmp_path), prefix)
    prompt = torch.cat([prefix, ids(1, 5, seed=1)], dim=1)
    kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=10, do_sample=False, pad_token_id=0)
    from_copy = model.generate(prompt, **with_cache(copy.deepcopy(cache)), **kw)
    from_disk = model.generate(prompt, **with_cache(TurboQuantCache.load_prefix(str(tmp_path), cfg)), **kw)
    again = model.generate(prompt, **with_cache(copy.deepcopy(cache)), **kw)
    assert torch.equal(from_copy, from_disk) and torch.equal(from_copy, again)


@torch.no_grad()
def test_mismatches_are_refused(tmp_path):
    cfg, model = llama()
    x = ids(1, 30)
    cache = TurboQuantCache(config=cfg, residual_length=4)
    model(x[:, :20], **with_cache(cache))
    with pytest.raises(ValueError, match="holds 20 tokens but token_ids has 30"):
        cache.save_prefix(str(tmp_path), x)
    cache.save_prefix(str(tmp_path), x[:, :20])
    with pytest.raises(ValueError, match="num_key_value_heads=2, but this model has num_key_value_heads=4"):
        TurboQuantCache.load_prefix(str(tmp_path), tiny_llama_config(num_key_value_heads=4))
    other = x.clone()
    other[0, 5] += 1
    with pytest.raises(ValueError, match="other tokens than the first 20"):
        TurboQuantCache.load_prefix(str(tmp_path), cfg, token_ids=other)
    with pytest.raises(ValueError, match="other tokens"):
        TurboQuantCache.load_prefix(str(tmp_path), cfg, token_ids=x[:, :10])  # shorter than the prefix
    # codes decode only with the rotation and codebooks they were made with
    doc = json.loads((tmp_path / PREFIX_JSON).read_text())
    doc["tq_config"]["seed"] = 5
    (tmp_path / PREFIX_JSON).write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="another rotation or other codebooks"):
        TurboQuantCache.load_prefix(str(tmp_path), cfg)


def test_prefix_files_are_plain_safetensors_and_json(tmp_path):
    cfg, model = llama()
    x = ids(1, 20)
    cache = TurboQuantCache(config=cfg, residual_length=4)
    with torch.no_grad():
        model(x, **with_cache(cache))
    cache.save_prefix(str(tmp_path), x)
    assert sorted(os.listdir(tmp_path)) == sorted([PREFIX_JSON, PREFIX_TENSORS])
    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / PREFIX_TENSORS))  # no pickle anywhere
    assert tensors["layers.0.k_packed"].dtype == torch.uint8
    blob = (tmp_path / PREFIX_TENSORS).read_bytes()
    (tmp_path / PREFIX_TENSORS).write_bytes(blob[: len(blob) // 2])
    with pytest.raises(ValueError):
        TurboQuantCache.load_prefix(str(tmp_path), cfg)
    with pytest.raises(FileNotFoundError, match="no turboquant_prefix.json"):
        TurboQuantCache.load_prefix(str(tmp_path / "nothing"), cfg)


def test_save_prefix_needs_the_model_config(tmp_path):
    cache = TurboQuantCache()
    cache.update(torch.randn(1, 2, 5, 32), torch.randn(1, 2, 5, 32), 0)
    with pytest.raises(ValueError, match="config=model.config"):
        cache.save_prefix(str(tmp_path), torch.arange(5))


def test_recurrent_states_are_refused_by_name(tmp_path):
    from tq_hf_cache._compat import IS_V5

    if not IS_V5:
        pytest.skip("linear-attention cache layers exist in transformers 5.x only")
    from transformers.cache_utils import LinearAttentionLayer

    cfg, _ = llama()
    cache = TurboQuantCache(config=cfg)
    cache.layers[1] = LinearAttentionLayer()
    with pytest.raises(ValueError, match="layer 1 is a LinearAttentionLayer"):
        cache.save_prefix(str(tmp_path), torch.zeros(1, 0, dtype=torch.long))


def test_hybrid_layers_are_refused_by_name(tmp_path):
    from tq_hf_cache._compat import IS_V5

    if not IS_V5 or not hasattr(transformers, "FalconH1Config"):
        pytest.skip("hybrid cache layers exist in transformers 5.x only")
    cfg = transformers.FalconH1Config(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=1,
        mamba_d_state=8, mamba_chunk_size=16,
    )
    cache = TurboQuantCache(config=cfg)
    with pytest.raises(ValueError, match="layer 0 is a TurboQuantLinearHybridLayer"):
        cache.save_prefix(str(tmp_path), torch.zeros(1, 0, dtype=torch.long))
