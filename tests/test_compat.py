"""One cache layer per layer type, for real config classes of several model families (issue: drop-in across
families). Each tiny model runs prefill + decode through TurboQuantCache(config=...) and DynamicCache(config=...)."""

import warnings

import pytest
import torch
import transformers
from transformers import DynamicCache

from tq_hf_cache import TurboQuantCache, TurboQuantLayer, TurboQuantSlidingLayer, cache_kwargs
from tq_hf_cache._compat import IS_V5, TRANSFORMERS_VERSION
from tq_hf_cache.hf.hybrid_layer import hybrid_classes

COMMON = dict(
    vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)


def build(config_cls_name, model_cls_name, **kw):
    cfg_cls = getattr(transformers, config_cls_name, None)
    model_cls = getattr(transformers, model_cls_name, None)
    if cfg_cls is None or model_cls is None:
        pytest.skip(f"{config_cls_name} is not in transformers {transformers.__version__}")
    cfg = cfg_cls(**{**COMMON, **kw})
    torch.manual_seed(0)
    return cfg, model_cls(cfg).eval()


def run_steps(model, cache, seq, prefill=24):
    out = [model(seq[:, :prefill], **cache_kwargs(model, cache), use_cache=True).logits]
    for i in range(prefill, seq.shape[1]):
        out.append(model(seq[:, i : i + 1], **cache_kwargs(model, cache), use_cache=True).logits)
    return out


def compare(cfg, model, tol=0.03, length=40, **cache_kw):
    seq = torch.randint(3, 96, (2, length), generator=torch.Generator().manual_seed(1))
    tq = TurboQuantCache(key_bits=8, value_bits=8, residual_length=4, config=cfg, **cache_kw)
    a = run_steps(model, tq, seq)
    b = run_steps(model, DynamicCache(config=cfg), seq)
    for x, y in zip(a, b):
        err = ((x - y).norm() / y.norm()).item()
        assert err < tol, err
    assert tq.get_seq_length() == length
    return tq


FAMILIES = [
    ("LlamaConfig", "LlamaForCausalLM", {}),
    ("Qwen2Config", "Qwen2ForCausalLM", {}),
    ("Qwen3Config", "Qwen3ForCausalLM", {}),
    ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
]


@pytest.mark.parametrize("cfg_name, model_name, kw", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_full_attention_families(cfg_name, model_name, kw):
    cfg, model = build(cfg_name, model_name, **kw)
    # MoE routing is discontinuous: a tiny K/V change can move a token to another expert
    tq = compare(cfg, model, tol=0.1 if "Moe" in cfg_name or "Mixtral" in cfg_name else 0.03)
    assert all(type(layer) is TurboQuantLayer for layer in tq.layers)
    assert all(layer.quantized_length + layer.residual_tokens == 40 and layer.residual_tokens >= 4 for layer in tq.layers)


@pytest.mark.parametrize("cfg_name, model_name", [("Gemma2Config", "Gemma2ForCausalLM"), ("Gemma3TextConfig", "Gemma3ForCausalLM")])
def test_gemma_sliding_and_global_layers(cfg_name, model_name):
    cfg, model = build(
        cfg_name, model_name, sliding_window=12, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention"] * 2,
    )
    # 8-bit noise at head dim 16 in a random Gemma reaches a few percent of the logits
    tq = compare(cfg, model, tol=0.06)
    # the sliding layers compute what a config-less cache (all history kept, window by mask) computes, up to the
    # order of fp32 sums over their different key lengths (up to 3e-5 of logits near 1 with AVX-512 kernels; a window
    # one token off moves them by 1.3)
    seq = torch.randint(3, 96, (2, 40), generator=torch.Generator().manual_seed(1))
    a = run_steps(model, TurboQuantCache(key_bits=8, value_bits=8, residual_length=4, config=cfg), seq)
    b = run_steps(model, TurboQuantCache(key_bits=8, value_bits=8, residual_length=4), seq)
    worst = max((x - y).abs().max().item() for x, y in zip(a, b))
    assert worst < 1e-4, f"{cfg_name}: sliding layers differ from the config-less cache by {worst:.2e}"
    kinds = [type(layer) for layer in tq.layers]
    types = list(getattr(cfg, "layer_types", []) or [])
    assert TurboQuantSlidingLayer in kinds and TurboQuantLayer in kinds
    for layer, t in zip(tq.layers, types):
        assert isinstance(layer, TurboQuantSlidingLayer) == (t == "sliding_attention")
        if t == "sliding_attention":
            assert layer.quantized_length + layer.residual_tokens == 11
    # a window inside the residual window stays a plain full-precision sliding layer
    plain = TurboQuantCache(residual_length=64, config=cfg)
    assert not any(isinstance(layer, TurboQuantSlidingLayer) for layer in plain.layers)
    skipped = TurboQuantCache(residual_length=4, config=cfg, skip_layer_types=["sliding_attention"])
    assert not any(isinstance(layer, TurboQuantSlidingLayer) for layer in skipped.layers)


@pytest.mark.skipif(not IS_V5, reason="linear-attention cache layers exist in transformers 5.x only")
def test_hybrid_linear_attention_model_qwen3_next():
    cfg, model = build(
        "Qwen3NextConfig", "Qwen3NextForCausalLM", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, linear_num_value_heads=2, linear_num_key_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16, full_attention_interval=2,
    )
    from transformers.cache_utils import LinearAttentionLayer

    tq = compare(cfg, model, tol=0.05)
    for layer, t in zip(tq.layers, cfg.layer_types):
        if t == "linear_attention":
            assert type(layer) is LinearAttentionLayer  # recurrent state untouched
        else:
            assert type(layer) is TurboQuantLayer and layer.quantized_length >= 36 - 4


@pytest.mark.skipif(not IS_V5, reason="hybrid cache layers exist in transformers 5.x only")
def test_hybrid_layers_falcon_h1():
    cfg, model = build(
        "FalconH1Config", "FalconH1ForCausalLM", mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8,
        mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=16,
    )
    tq = compare(cfg, model, tol=0.05)
    for layer in tq.layers:
        assert isinstance(layer, TurboQuantLayer) and type(layer).__name__ == "TurboQuantLinearHybridLayer"
        assert layer.quantized_length >= 32 and any(layer.is_conv_states_initialized.values())


@pytest.mark.skipif(not IS_V5, reason="hybrid cache layers exist in transformers 5.x only")
def test_hybrid_layers_count_the_attention_tokens_and_record_both_parts():
    """A hybrid layer's length is its attention part's (transformers >= 5.25's linear part keeps a count of its own,
    which assisted decoding moves apart), and past recording reaches both parts with what transformers passes them
    (>= 5.25: `recurrent_states_to_keep`); a sliding layer takes that keyword too."""
    full_cls, sliding_cls = hybrid_classes()
    x = torch.randn(1, 2, 30, 16)
    for cls, extra in ((full_cls, {}), (sliding_cls, {"sliding_window": 64})):
        cache = TurboQuantCache(key_bits=8, value_bits=8, residual_length=4)
        layer = cache._tq_layer(cls, 0, (8, 8), **extra)
        layer.update(x, x)
        if hasattr(layer, "cumulative_length_linear"):
            layer.cumulative_length_linear += 7  # the linear part's own count, off from the attention part's
        assert int(layer.get_seq_length()) == 30, cls.__name__
        layer.activate_past_recording(recurrent_states_to_keep=3)
        assert layer.record_past, cls.__name__
    sliding = TurboQuantCache(key_bits=8, value_bits=8, residual_length=4)._tq_layer(
        TurboQuantSlidingLayer, 0, (8, 8), sliding_window=16)
    sliding.activate_past_recording(recurrent_states_to_keep=3)
    assert sliding.record_past


@pytest.mark.skipif(not IS_V5, reason="KV sharing through kv_sharing_modes is transformers 5.x")
def test_cache_kwargs_names_the_argument_this_release_takes(recwarn):
    """transformers 5.24 renamed past_key_values to cache (past_key_values warns, then goes: forward in 5.40,
    generate in 6.0). cache_kwargs must pick the name the installed release takes, with no deprecation warning, for a
    forward and for generate, and give what the other name gives."""
    from packaging.version import Version

    cfg, model = build("LlamaConfig", "LlamaForCausalLM")
    want = "cache" if TRANSFORMERS_VERSION >= Version("5.24.0") else "past_key_values"
    seq = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(3))
    assert list(cache_kwargs(model, DynamicCache())) == [want]
    with torch.no_grad():
        a = model(seq, **cache_kwargs(model, DynamicCache())).logits
        gen = model.generate(seq, max_new_tokens=3, do_sample=False, pad_token_id=0,
                             **cache_kwargs(model, TurboQuantCache(key_bits=8, value_bits=8, config=cfg)))
    assert not [w for w in recwarn if "past_key_values" in str(w.message)], [str(w.message) for w in recwarn]
    assert gen.shape == (1, 15)
    if TRANSFORMERS_VERSION >= Version("5.40.0"):
        return  # forward no longer takes the old name
    with torch.no_grad(), warnings.catch_warnings():  # the old name, where it is still taken, gives the same logits
        warnings.simplefilter("ignore", FutureWarning)
        b = model(seq, past_key_values=DynamicCache()).logits
    torch.testing.assert_close(a, b, rtol=0, atol=0, msg="logits under cache_kwargs vs past_key_values")


def test_kv_sharing_producers_return_private_tensors():
    cfg_cls = getattr(transformers, "Gemma4TextConfig", None)
    if cfg_cls is None:
        pytest.skip("no Gemma4TextConfig")
    cfg = cfg_cls(**{**COMMON, "num_hidden_layers": 6, "sliding_window": 12, "num_kv_shared_layers": 2,
                      "layer_types": ["sliding_attention", "full_attention"] * 3})
    modes = cfg.kv_sharing_modes
    tq = TurboQuantCache(residual_length=4, config=cfg)
    for i, (layer, mode) in enumerate(zip(tq.layers, modes)):
        if mode == "reuse":
            assert type(layer).__name__ == "DummyLayer"
        elif isinstance(layer, TurboQuantLayer):
            assert layer.private_output == (mode == "store")
    assert any(getattr(layer, "private_output", False) for layer in tq.layers)
    # a private producer's output survives other layers' updates; a workspace view would be overwritten
    producer = next(i for i, m in enumerate(modes) if m == "store" and isinstance(tq.layers[i], TurboQuantLayer))
    other = next(i for i, layer in enumerate(tq.layers) if isinstance(layer, TurboQuantLayer) and not layer.private_output)
    x = torch.randn(1, 2, 30, 16)
    tq.update(x, x, producer)
    k, _ = tq.update(x[:, :, :1], x[:, :, :1], producer)
    tq.update(torch.randn(1, 2, 30, 16), torch.randn(1, 2, 30, 16), other)
    tq.update(torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16), other)
    assert torch.equal(k[:, :, -5:], torch.cat([x[:, :, -4:], x[:, :, :1]], 2))


def test_unsupported_layer_types_are_refused_by_name():
    class Cfg(transformers.LlamaConfig):
        pass

    cfg = Cfg(**COMMON)
    cfg.layer_types = ["full_attention", "indexed_attention", "full_attention", "full_attention"]
    with pytest.raises(ValueError, match=r"layer 1 has layer type 'indexed_attention'.*skip_layer_types=\['indexed_attention'\]"):
        TurboQuantCache(config=cfg)
    if IS_V5:
        tq = TurboQuantCache(config=cfg, skip_layers=[1])
        assert not isinstance(tq.layers[1], TurboQuantLayer) and isinstance(tq.layers[0], TurboQuantLayer)


def test_per_layer_bits_and_skips_from_config():
    cfg, model = build("LlamaConfig", "LlamaForCausalLM")
    tq = compare(cfg, model, skip_first=1, skip_last=1, layer_bits={2: [4, 4]}, tol=0.1)
    assert not isinstance(tq.layers[0], TurboQuantLayer) and not isinstance(tq.layers[3], TurboQuantLayer)
    assert (tq.layers[1].key_bits, tq.layers[2].key_bits, tq.layers[2].value_bits) == (8, 4, 4)
    assert tq.nbytes()["full_precision"] > 0
