"""TurboQuantCache behaves like DynamicCache everywhere generate and the Cache API use one."""

import pytest
import torch
from transformers import DynamicCache

from conftest import tiny_llama_config, with_cache
from tq_hf_cache import TurboQuantCache, TurboQuantLayer, TurboQuantSlidingLayer


def ids(batch, length, seed=0):
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def greedy(model, inputs, cache, n=20, **kw):
    return model.generate(
        inputs, attention_mask=kw.pop("attention_mask", torch.ones_like(inputs)), max_new_tokens=n,
        do_sample=False, **with_cache(cache), pad_token_id=0, **kw,
    )


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("residual", [0, 5, 128])
def test_logits_close_at_4_bits(tiny_llama, residual):
    x = ids(2, 48)
    tq, dyn = TurboQuantCache("k4v4", residual_length=residual), DynamicCache()
    tiny_llama(x[:, :40], **with_cache(tq))
    tiny_llama(x[:, :40], **with_cache(dyn))
    a = tiny_llama(x[:, 40:], **with_cache(tq)).logits
    b = tiny_llama(x[:, 40:], **with_cache(dyn)).logits
    err = rel_err(a, b)
    assert err < (1e-5 if residual == 128 else 0.1), err
    assert tq.get_seq_length() == dyn.get_seq_length() == 48
    layer = tq.layers[0]
    assert isinstance(layer, TurboQuantLayer)
    assert layer.quantized_length == max(48 - residual, 0) and layer.residual_tokens == min(residual, 48)


@pytest.mark.parametrize("residual", [0, 4])
def test_same_greedy_tokens_at_8_bits(tiny_llama, residual):
    x = ids(2, 30, seed=1)
    out = greedy(tiny_llama, x, TurboQuantCache(key_bits=8, value_bits=8, residual_length=residual), n=25)
    ref = greedy(tiny_llama, x, DynamicCache(), n=25)
    assert torch.equal(out, ref)


def test_mask_sizes_and_lengths_match_dynamic_cache(tiny_llama):
    x = ids(1, 20)
    tq, dyn = TurboQuantCache(residual_length=3), DynamicCache()
    for cache in (tq, dyn):
        tiny_llama(x[:, :17], **with_cache(cache))
        tiny_llama(x[:, 17:18], **with_cache(cache))
    assert tq.get_seq_length() == dyn.get_seq_length() == 18
    for q in (1, 5):
        arg = q if _v5() else torch.arange(18, 18 + q)
        assert tq.get_mask_sizes(arg, 0) == dyn.get_mask_sizes(arg, 0)
    assert tq.layers[0].get_max_length() == -1


def _v5():
    from tq_hf_cache._compat import IS_V5

    return IS_V5


def test_keys_values_materialize_the_history(tiny_llama):
    x = ids(1, 30)
    tq, dyn = TurboQuantCache(key_bits=8, value_bits=8, residual_length=6), DynamicCache()
    tiny_llama(x, **with_cache(tq))
    tiny_llama(x, **with_cache(dyn))
    k, v = tq.layers[1].keys, tq.layers[1].values
    assert k.shape == dyn.layers[1].keys.shape
    assert rel_err(k, dyn.layers[1].keys) < 0.02 and rel_err(v, dyn.layers[1].values) < 0.02
    # the residual window is exact
    assert torch.equal(k[:, :, -6:], dyn.layers[1].keys[:, :, -6:])
    with pytest.raises(AttributeError, match="derived"):
        tq.layers[1].keys = torch.zeros(1)


def test_crop_then_replay_is_exact(tiny_llama):
    x = ids(1, 30, seed=3)
    cache = TurboQuantCache("k4v4", residual_length=0)
    tiny_llama(x[:, :20], **with_cache(cache))
    first = [tiny_llama(x[:, i : i + 1], **with_cache(cache)).logits for i in range(20, 30)]
    cache.crop(-5)
    assert cache.get_seq_length() == 25
    again = [tiny_llama(x[:, i : i + 1], **with_cache(cache)).logits for i in range(25, 30)]
    for a, b in zip(first[5:], again):
        assert torch.allclose(a, b, atol=1e-6)
    cache.crop(10)  # positive: keep the first 10 tokens (transformers 4.x semantics)
    assert cache.get_seq_length() == 10 and cache.layers[0].quantized_length == 10


def test_crop_inside_the_residual_window(tiny_llama):
    x = ids(1, 24)
    cache = TurboQuantCache(residual_length=8)
    tiny_llama(x, **with_cache(cache))
    before = cache.layers[0].keys
    cache.crop(-3)
    layer = cache.layers[0]
    assert (layer.quantized_length, layer.residual_tokens, cache.get_seq_length()) == (16, 5, 21)
    assert torch.equal(layer.keys, before[:, :, :21])


def test_batch_reorder_repeat_select(tiny_llama):
    x = ids(3, 20)
    cache = TurboQuantCache(residual_length=4)
    tiny_llama(x, **with_cache(cache))
    k = cache.layers[0].keys
    cache.reorder_cache(torch.tensor([2, 0, 0]))
    assert torch.equal(cache.layers[0].keys, k[[2, 0, 0]])
    cache.batch_select_indices(torch.tensor([0, 1]))
    assert torch.equal(cache.layers[0].keys, k[[2, 0]])
    cache.batch_repeat_interleave(2)
    assert torch.equal(cache.layers[0].keys, k[[2, 2, 0, 0]])
    out = tiny_llama(ids(4, 1), **with_cache(cache)).logits
    assert out.shape[0] == 4 and cache.get_seq_length() == 21


def test_beam_search_matches_dynamic_cache_at_8_bits(tiny_llama):
    x = ids(2, 25, seed=4)
    kw = dict(num_beams=3, num_return_sequences=2)
    out = greedy(tiny_llama, x, TurboQuantCache(key_bits=8, value_bits=8, residual_length=2), n=12, **kw)
    ref = greedy(tiny_llama, x, DynamicCache(), n=12, **kw)
    assert torch.equal(out, ref)


def test_beam_search_runs_at_4_bits(tiny_llama):
    out = greedy(tiny_llama, ids(1, 20), TurboQuantCache("k4v4", residual_length=0), n=10, num_beams=4)
    assert out.shape == (1, 30)


def test_sampling(tiny_llama):
    torch.manual_seed(0)
    out = tiny_llama.generate(
        ids(2, 10), attention_mask=torch.ones(2, 10, dtype=torch.long), do_sample=True, top_k=20,
        max_new_tokens=15, **with_cache(TurboQuantCache("k3v3", residual_length=0)), pad_token_id=0,
    )
    assert out.shape == (2, 25) and int(out.max()) < 128


def test_multi_turn_reuse_of_one_cache(tiny_llama):
    turn1 = ids(1, 20, seed=5)
    tq, dyn = TurboQuantCache(key_bits=8, value_bits=8, residual_length=4), DynamicCache()
    a, b = greedy(tiny_llama, turn1, tq, n=8), greedy(tiny_llama, turn1, dyn, n=8)
    assert torch.equal(a, b)
    turn2 = torch.cat([a, ids(1, 7, seed=6)], dim=1)
    a2, b2 = greedy(tiny_llama, turn2, tq, n=8), greedy(tiny_llama, turn2, dyn, n=8)
    assert torch.equal(a2, b2)
    assert tq.get_seq_length() == dyn.get_seq_length() == turn2.shape[1] + 7


def test_left_padded_batch(tiny_llama):
    long, short = ids(1, 24, seed=7), ids(1, 15, seed=8)
    batch = torch.cat([long, torch.cat([torch.zeros(1, 9, dtype=torch.long), short], 1)])
    mask = torch.ones_like(batch)
    mask[1, :9] = 0
    tq = greedy(tiny_llama, batch, TurboQuantCache(key_bits=8, value_bits=8, residual_length=3), n=10, attention_mask=mask)
    dyn = greedy(tiny_llama, batch, DynamicCache(), n=10, attention_mask=mask)
    alone = greedy(tiny_llama, short, TurboQuantCache(key_bits=8, value_bits=8, residual_length=3), n=10)
    # the padded row matches DynamicCache and the same prompt run alone: padding is masked, not attended
    assert torch.equal(tq[1], dyn[1]) and torch.equal(tq[1, 9:], alone[0])
    # every decode step of the batch sees logits close to DynamicCache's on the same inputs
    caches = TurboQuantCache(key_bits=8, value_bits=8, residual_length=3), DynamicCache()
    seq, m = dyn, torch.cat([mask, torch.ones(2, 10, dtype=torch.long)], 1)
    logits = [tiny_llama(seq[:, :24], attention_mask=m[:, :24], **with_cache(c)).logits for c in caches]
    for i in range(24, 34):
        logits = [tiny_llama(seq[:, i : i + 1], attention_mask=m[:, : i + 1], **with_cache(c)).logits for c in caches]
        assert rel_err(*logits) < 0.02


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_model_dtypes(dtype):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config()).to(dtype).eval()
    x = ids(2, 40)
    tq, dyn = TurboQuantCache("k4v4", residual_length=0), DynamicCache()
    model(x[:, :32], **with_cache(tq))
    model(x[:, :32], **with_cache(dyn))
    a = model(x[:, 32:], **with_cache(tq)).logits
    b = model(x[:, 32:], **with_cache(dyn)).logits
    assert a.dtype == dtype and rel_err(a, b) < 0.12
    assert tq.layers[0].kv.window.keys.dtype == dtype


def test_sliding_window_layers_keep_their_window():
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(**{**tiny_llama_config().to_dict(), "model_type": "mistral", "sliding_window": 16})
    torch.manual_seed(0)
    model = MistralForCausalLM(cfg).eval()
    seq = ids(1, 50, seed=9)
    sliding = TurboQuantCache(key_bits=8, value_bits=8, residual_length=4, config=cfg)
    assert all(isinstance(layer, TurboQuantSlidingLayer) for layer in sliding.layers)
    # a config-less cache keeps everything and lets the mask apply the window: the same math, more memory
    full, dyn = TurboQuantCache(key_bits=8, value_bits=8, residual_length=4), DynamicCache(config=cfg)
    caches = (sliding, full, dyn)
    steps = [slice(0, 20)] + [slice(i, i + 1) for i in range(20, 50)]
    for sl in steps:
        a, b, c = (model(seq[:, sl], **with_cache(cache)).logits for cache in caches)
        assert torch.allclose(a, b, atol=1e-5)
        assert rel_err(a, c) < 0.02
        layer = sliding.layers[0]
        assert layer.quantized_length + layer.residual_tokens == min(sl.stop, 15)  # sliding_window - 1
    assert sliding.get_seq_length() == 50
    assert sliding.layers[0].quantized_length == 11 and full.layers[0].quantized_length == 46
    # a window inside the residual length: nothing would be quantized, so it stays a plain sliding layer
    plain = TurboQuantCache(residual_length=64, config=cfg)
    assert all(layer.is_sliding and not isinstance(layer, TurboQuantLayer) for layer in plain.layers)


def test_sliding_buffer_stays_bounded_over_long_runs():
    from tq_hf_cache.hf.layer import GROW_TOKENS

    window, res = 40, 8
    cache = TurboQuantCache(key_bits=8, value_bits=8, residual_length=res)
    cache.layers.append(cache._tq_layer(TurboQuantSlidingLayer, 0, (8, 8), sliding_window=window))
    g = torch.Generator().manual_seed(1)
    ks = torch.randn(1, 2, 700, 64, generator=g)
    pos = 0
    for n in [100] + [1] * 300 + [7] * 40:
        cache.update(ks[:, :, pos : pos + n], ks[:, :, pos : pos + n] * 2, 0)
        pos += n
    layer = cache.layers[0]
    assert layer.kv.k_buf.capacity <= GROW_TOKENS and cache.get_seq_length() == pos
    k = layer.keys
    assert k.shape[2] == window - 1
    assert torch.equal(k[:, :, -res:], ks[:, :, pos - res : pos])
    assert rel_err(k, ks[:, :, pos - window + 1 : pos]) < 0.01
    with pytest.raises(RuntimeError, match="sliding-window"):
        cache.crop(-1)


def test_layer_policy_keeps_skipped_layers_in_full_precision(tiny_llama):
    cache = TurboQuantCache(skip_first=1, config=tiny_llama.config)
    assert not isinstance(cache.layers[0], TurboQuantLayer) and isinstance(cache.layers[1], TurboQuantLayer)
    tiny_llama(ids(1, 10), **with_cache(cache))
    assert cache.get_seq_length() == 10


def test_bad_inputs_raise_clear_errors():
    layer = TurboQuantCache().layers if False else None  # noqa: F841 (config-less caches grow lazily)
    cache = TurboQuantCache(residual_length=0)
    with pytest.raises(TypeError, match="model dtypes"):
        cache.update(torch.zeros(1, 2, 3, 64, dtype=torch.float64), torch.zeros(1, 2, 3, 64, dtype=torch.float64), 0)
    cache.update(torch.randn(1, 2, 3, 64), torch.randn(1, 2, 3, 64), 0)
    with pytest.raises(ValueError, match=r"do not match the cache's \(batch, heads, head_dim\) = \(1, 2, 64\)"):
        cache.update(torch.randn(1, 3, 1, 64), torch.randn(1, 3, 1, 64), 0)
    with pytest.raises(ValueError, match="float16"):
        cache.update(torch.randn(1, 2, 1, 64).half(), torch.randn(1, 2, 1, 64).half(), 0)


def test_reset_and_reuse(tiny_llama):
    cache = TurboQuantCache(residual_length=2)
    tiny_llama(ids(1, 12), **with_cache(cache))
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.nbytes()["total"] == 0
    tiny_llama(ids(2, 5), **with_cache(cache))
    assert cache.get_seq_length() == 5


def test_attention_sinks_stay_exact_through_quantization_crop_and_batch_ops():
    """The first `sink_tokens` tokens come back exact once quantized (everywhere the history is read: keys/values,
    the workspace update returns); later tokens are dequantized; crop below them and re-feeding refills them; the
    batch operations carry them along; sink_tokens=0 turns them off; sliding layers keep none."""
    torch.manual_seed(0)
    b, h, d = 3, 2, 64
    k = torch.randn(b, h, 40, d)
    v = torch.randn(b, h, 40, d)
    cache = TurboQuantCache("k3v3", residual_length=8)
    assert cache.tq_config.sink_tokens == 4
    cache.update(k[:, :, :2], v[:, :, :2], 0)  # sinks arrive over two updates
    cache.update(k[:, :, 2:30], v[:, :, 2:30], 0)
    layer = cache.layers[0]
    assert layer.quantized_length == 22 and layer.kv.exact_sinks == 4
    ko, vo = cache.update(k[:, :, 30:31], v[:, :, 30:31], 0)  # [history | residual | new], in the workspace
    cache.crop(30)
    for got, want in ((ko, k), (vo, v), (layer.keys, k), (layer.values, v)):
        assert torch.equal(got[:, :, :4], want[:, :, :4])
        assert not torch.equal(got[:, :, 4:22], want[:, :, 4:22])  # quantized
        assert torch.equal(got[:, :, 22:30], want[:, :, 22:30])  # residual window
    plain = TurboQuantCache("k3v3", residual_length=8, sink_tokens=0)
    plain.update(k[:, :, :30], v[:, :, :30], 0)
    assert plain.layers[0].kv.exact_sinks == 0 and plain.nbytes()["sinks"] == 0
    assert not torch.equal(plain.layers[0].keys[:, :, :4], k[:, :, :4])
    assert torch.equal(plain.layers[0].keys[:, :, 4:], layer.keys[:, :, 4:])  # nothing else differs

    cache.crop(2)  # below the sinks: two remain, the next tokens refill the other two
    assert layer.kv.exact_sinks == layer.kv._slen == 2 and torch.equal(layer.keys, k[:, :, :2])
    k2 = torch.randn(b, h, 20, d)
    cache.update(k2, k2, 0)
    assert layer.kv.exact_sinks == 4
    assert torch.equal(layer.keys[:, :, :2], k[:, :, :2]) and torch.equal(layer.keys[:, :, 2:4], k2[:, :, :2])
    keys = layer.keys
    cache.reorder_cache(torch.tensor([2, 0, 0]))
    assert torch.equal(layer.keys, keys[[2, 0, 0]])
    cache.batch_select_indices(torch.tensor([1]))
    assert torch.equal(layer.keys[:, :, :4], keys[[0], :, :4])

    sliding = TurboQuantSlidingLayer(
        sliding_window=16, key_bits=4, value_bits=4, residual_length=4, rotation_for=layer._rotation_for,
        codebook_for=layer._codebook_for, workspace=layer.workspace, sink_tokens=4,
    )
    assert sliding.sink_tokens == 0
    with pytest.raises(ValueError, match="sink_tokens"):
        TurboQuantCache(sink_tokens=-1)


def test_a_decode_steps_lazy_keys_survive_the_layer_settling_before_attention_reads_them():
    """transformers' offloading calls `offload` (which settles the layer: quantizes the residual window's overflow)
    between a layer's update and its attention: the LazyKVs that update returned must still read the same keys."""
    torch.manual_seed(0)
    k, v = torch.randn(2, 2, 30, 64), torch.randn(2, 2, 30, 64)
    caches = [TurboQuantCache("k4v4", residual_length=4) for _ in range(2)]
    outs = []
    for settle, cache in zip((False, True), caches):
        cache.update(k[:, :, :20], v[:, :, :20], 0)
        for t in range(20, 25):  # five decode steps fill the window past its capacity (4 + 4)
            ko, vo = cache.update(k[:, :, t : t + 1], v[:, :, t : t + 1], 0)
        assert cache.layers[0].residual_tokens > cache.layers[0].residual_capacity
        if settle:
            cache.layers[0].kv.settle()
            assert cache.layers[0].residual_tokens == 4
        outs.append((ko + 0, vo + 0))  # the first torch op fills them
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert torch.equal(outs[1][0][:, :, -9:], k[:, :, 16:25])  # the residual window, exact
