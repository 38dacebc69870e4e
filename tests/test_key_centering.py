"""Pre-RoPE key centring (`TurboQuantConfig.key_centering`): the RoPE the cache takes from the model, the offset math,
and a centred cache read on every path (workspace + SDPA, the fused op's C kernels and torch math, the Triton kernel)."""

import pytest
import torch
import transformers
from transformers import DynamicCache

from conftest import chunked_logits, static_logits, tiny_gemma3_config, tiny_llama_config, with_cache
from tq_hf_cache import TurboQuantCache, TurboQuantConfig, TurboQuantStaticCache, ops
from tq_hf_cache._compat import IS_V5
from tq_hf_cache.quant.rope import KeyOffset, RopeAngles, rope_angles
from tq_hf_cache.kernels import select

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # on a CPU the kernel runs in the interpreter (conftest)
TOL = 2e-3 if DEV == "cuda" else 1e-4  # "turboquant" on CUDA is the kernel (fp16 tiles), on a CPU the fp32 math


@pytest.mark.parametrize("which", ["llama3", "qwen3", "gemma3"])
def test_rope_angles_match_the_models_own_rotary_embedding(which):
    if which == "llama3":
        cfg = tiny_llama_config(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        model = transformers.LlamaForCausalLM(cfg)
    elif which == "qwen3":
        cfg = transformers.Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=32)
        model = transformers.Qwen3ForCausalLM(cfg)
    else:
        cfg = tiny_gemma3_config()
        model = transformers.Gemma3ForCausalLM(cfg)
    types = getattr(cfg, "layer_types", None) or ["full_attention"]
    angles = rope_angles(cfg, types)
    assert set(angles) == set(types)
    pos = torch.arange(0, 5000, 7)
    for lt, a in angles.items():
        if which == "gemma3" and hasattr(model.model, "rotary_emb_local"):  # transformers 4.x
            rot = model.model.rotary_emb_local if lt == "sliding_attention" else model.model.rotary_emb
            cos, sin = rot(torch.zeros(1), pos[None])
        elif which == "gemma3":
            cos, sin = model.model.rotary_emb(torch.zeros(1), pos[None], lt)
        else:
            cos, sin = model.model.rotary_emb(torch.zeros(1), pos[None])
        c, s = a.cos_sin(pos)
        # the model rounds position * frequency in float32: ~3e-4 rad at position 5000
        torch.testing.assert_close(c, cos[0].float(), atol=1e-3, rtol=0, msg=f"{which} {lt} cos")
        torch.testing.assert_close(s, sin[0].float(), atol=1e-3, rtol=0, msg=f"{which} {lt} sin")
    if which == "gemma3":  # its local and global layers rotate at different rates
        assert not torch.equal(angles["sliding_attention"].theta, angles["full_attention"].theta)


def test_key_offset_scores_equal_the_query_dotted_with_the_rotated_mean():
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    g = torch.Generator().manual_seed(seed)
    d = 32
    rope = RopeAngles(1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)), 1.25)
    off = KeyOffset(torch.randn(2, 2, 1, d, generator=g), rope, pos0=1234)
    q = torch.randn(2, 6, 3, d, generator=g)
    start, stop = 5, 5 + 777  # not a multiple of the angle-addition block
    keys = off.keys(start, stop)  # (2, 2, 777, d)
    want = torch.einsum("bhgnd,bhtd->bhgnt", q.reshape(2, 2, 3, 3, d), keys).reshape(2, 6, 3, stop - start)
    torch.testing.assert_close(off.scores(q, start, stop), want, atol=2e-4, rtol=1e-5, msg=f"scores (seed {seed})")
    x = torch.randn(2, 2, 9, d, generator=g)
    p = torch.arange(4000, 4009)
    torch.testing.assert_close(rope.invert(rope.apply(x, p), p), x, atol=1e-5, rtol=1e-5, msg=f"invert (seed {seed})")


def _biased_llama():
    """A tiny Llama whose keys have a large pre-RoPE mean (a k_proj bias), as trained models' keys often do."""
    torch.manual_seed(0)
    cfg = tiny_llama_config(head_dim=64, hidden_size=64, attention_bias=True)
    model = transformers.LlamaForCausalLM(cfg).eval()
    for layer in model.model.layers:
        torch.nn.init.normal_(layer.self_attn.k_proj.bias, std=3.0)
    return model.to(DEV)


@pytest.mark.slow
def test_a_centred_cache_reads_the_same_on_every_path_and_holds_its_keys_closer(monkeypatch):
    model = _biased_llama()
    cfg = model.config
    ids = torch.randint(3, 128, (2, 304), generator=torch.Generator().manual_seed(1)).to(DEV)
    model.set_attn_implementation("sdpa")
    fp_cache = DynamicCache(config=cfg)
    fp = chunked_logits(model, fp_cache, ids, 280, step=3)
    logits, err, triton_len = {}, {}, 292  # (the Triton kernel interpreted on a CPU: 4 steps, not 8)
    for centred in (False, True):
        for impl, backend in (("turboquant", "triton"), ("turboquant", "auto"), ("turboquant", "torch"),
                              ("sdpa", "auto")):
            monkeypatch.setenv(select.ENV, backend)
            model.set_attn_implementation(impl)
            cache = TurboQuantCache("k4v4", config=cfg, residual_length=16, key_centering=centred)
            n = triton_len if backend == "triton" else ids.shape[1]
            logits[centred, impl, backend] = chunked_logits(model, cache, ids[:, :n], 280, step=3)  # causal bias rows
        k, k_fp = cache.layers[1].keys, fp_cache.layers[1].keys  # (the sdpa run's cache)
        err[centred] = float((k - k_fp).norm() / k_fp.norm())
    assert err[True] < err[False] / 5, err  # the mean no longer takes the quantizer's range
    for centred in (False, True):
        ref = logits[centred, "sdpa", "auto"]
        torch.testing.assert_close(logits[centred, "turboquant", "auto"], ref, atol=TOL, rtol=TOL,
                                   msg=f"fused op (the C kernels on a CPU) vs workspace, centred={centred}")
        torch.testing.assert_close(logits[centred, "turboquant", "torch"], ref, atol=TOL, rtol=TOL,
                                   msg=f"fused op's torch math vs workspace, centred={centred}")
        torch.testing.assert_close(logits[centred, "turboquant", "triton"], ref[:, :triton_len], atol=2e-3, rtol=2e-3,
                                   msg=f"Triton kernel vs workspace, centred={centred}")
    assert (logits[True, "sdpa", "auto"] - fp).abs().max() < (logits[False, "sdpa", "auto"] - fp).abs().max()


def test_a_centred_cache_keeps_each_rows_mean_through_batch_selection():
    model = _biased_llama()
    ids = torch.randint(3, 128, (2, 200), generator=torch.Generator().manual_seed(2)).to(DEV)
    model.set_attn_implementation("turboquant")
    both = TurboQuantCache("k4v4", config=model.config, residual_length=16, key_centering=True)
    alone = TurboQuantCache("k4v4", config=model.config, residual_length=16, key_centering=True)
    with torch.no_grad():
        model(ids[:, :160], **with_cache(both))
        model(ids[1:, :160], **with_cache(alone))
        both.batch_select_indices(torch.tensor([1], device=DEV))
        a = model(ids[1:, 160:], **with_cache(both)).logits
        b = model(ids[1:, 160:], **with_cache(alone)).logits
    torch.testing.assert_close(a, b, atol=TOL / 10, rtol=TOL / 10, msg="row 1 after batch_select_indices vs alone")


def test_a_centred_sliding_window_model_matches_its_own_workspace_path_after_the_window_slides():
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(tiny_gemma3_config(attention_bias=True)).eval()
    for layer in model.model.layers:
        torch.nn.init.normal_(layer.self_attn.k_proj.bias, std=3.0)
    model.to(DEV)
    ids = torch.randint(3, 128, (1, 220), generator=torch.Generator().manual_seed(3)).to(DEV)
    out = {}
    for impl in ("sdpa", "turboquant"):
        model.set_attn_implementation(impl)
        cache = TurboQuantCache("k4v4", config=model.config, residual_length=8, key_centering=True)
        out[impl] = chunked_logits(model, cache, ids, 160, chunk=32)
    torch.testing.assert_close(out["turboquant"], out["sdpa"], atol=TOL, rtol=TOL, msg="gemma3 sliding, centred")
    sliding = [layer for layer in cache.layers if getattr(layer, "is_sliding", False)]
    assert sliding and all(layer.kv._mu is not None and layer.rope is not None for layer in sliding)


def test_key_centering_is_refused_where_it_cannot_work():
    with pytest.raises(ValueError, match="key_centering must be True or False, got 1"):
        TurboQuantConfig(key_centering=1)
    with pytest.raises(ValueError, match="needs the model's config"):
        TurboQuantCache("k4v4", key_centering=True)
    cfg = TurboQuantConfig(key_centering=True)
    assert TurboQuantConfig.from_dict(cfg.to_dict()).key_centering is True
    assert TurboQuantConfig.from_dict({k: v for k, v in cfg.to_dict().items() if k != "key_centering"}).key_centering is False


@pytest.mark.skipif(not IS_V5, reason="TurboQuantStaticCache needs transformers >= 5")
def test_a_centred_static_cache_reads_alike_on_every_path_holds_its_keys_closer_and_tracks_static_cache(monkeypatch):
    """TurboQuantStaticCache(key_centering=True): the dense keys (sdpa), the fused op (its torch math here; the kernel
    on a GPU) and a compiled step agree; centring brings 3-bit keys closer to fp on keys with a large mean; the codes
    are those of k - R(t) mu; reset recomputes mu; at 8 bits it tracks StaticCache through generate."""
    from tq_hf_cache import reference

    monkeypatch.setenv(select.ENV, "torch")
    model = _biased_llama()
    cfg = model.config
    ids = torch.randint(3, 128, (2, 72), generator=torch.Generator().manual_seed(2)).to(DEV)
    kw = dict(config=cfg, max_cache_len=80, key_bits=3, value_bits=8, residual_length=4, sink_tokens=2)
    fp = static_logits(model, transformers.StaticCache(config=cfg, max_cache_len=80), ids, 56, "sdpa")
    out = {impl: static_logits(model, TurboQuantStaticCache(key_centering=True, **kw), ids, 56, impl)
           for impl in ("sdpa", "turboquant")}
    torch._dynamo.reset()
    compiled = torch.compile(model.forward, backend="aot_eager", fullgraph=True)
    cache = TurboQuantStaticCache(key_centering=True, **kw)
    out["compiled"] = static_logits(model, cache, ids, 56, "turboquant", compiled)
    for name in ("turboquant", "compiled"):
        torch.testing.assert_close(out[name], out["sdpa"], atol=TOL, rtol=TOL, msg=f"centred static: {name} vs sdpa")
    plain = static_logits(model, TurboQuantStaticCache(**kw), ids, 56, "sdpa")
    err = {name: float((x - fp)[:, 56:].norm() / fp[:, 56:].norm()) for name, x in (("centred", out["sdpa"]),
                                                                                    ("plain", plain))}
    assert err["centred"] < 0.7 * err["plain"], err
    # the stored codes: k - R(t) mu quantized, mu the mean of the prefill's keys past the sinks (pre-RoPE)
    layer = cache.layers[0]
    p = layer.packed
    with torch.no_grad():
        k = []
        hook = model.model.layers[0].self_attn.k_proj.register_forward_hook(lambda m, i, o: k.append(o))
        model(ids[:, :56])
        hook.remove()
    assert torch.count_nonzero(p.key_offset.mu) > 0
    mu = p.key_offset.mu
    held = int(p.exact_from)  # 72 - the window (20): the positions read packed are [2 sinks, held)
    keys = reference.dequantize(p.k_packed[:, :, 2:held], p.k_norms[:, :, 2:held], p.rotation, p.k_codebook)
    dense = layer._full(torch.zeros(2, 2, 0, 64, device=DEV), torch.zeros(2, 2, 0, 64, device=DEV))[0]
    torch.testing.assert_close(dense[:, :, 2:held].float(), p.key_offset.keys(2, held) + keys, atol=1e-5, rtol=1e-5,
                               msg="dense keys = codes + R(t) mu")
    k_pre = k[0].view(2, 56, 2, 64).transpose(1, 2)  # (B, H, T, D) before RoPE
    torch.testing.assert_close(mu, k_pre[:, :, 2:].mean(2, keepdim=True), atol=1e-4, rtol=1e-4, msg="mu")
    want, _ = reference.quantize(p.key_offset.rope.apply(k_pre - mu, torch.arange(56, device=DEV))[:, :, 2:held],
                                 p.rotation, p.k_codebook)
    same = (want == p.k_packed[:, :, 2:held]).float().mean()
    assert same > 0.99, f"codes of k - R(t) mu: {same:.4f} of the bytes equal"  # rounding may flip a boundary case
    cache.reset()
    assert layer.kv.mean_pending and torch.count_nonzero(layer.packed.key_offset.mu) == 0
    again = static_logits(model, cache, ids, 56, "sdpa")
    torch.testing.assert_close(again, out["sdpa"], atol=TOL, rtol=TOL, msg="after reset: mu recomputed")
    torch.testing.assert_close(layer.packed.key_offset.mu, mu, atol=0, rtol=0, msg="the same mu after reset")
    # 8 bits through generate (compiled with CUDA graphs on a GPU), on a model of ordinary scale
    monkeypatch.setenv(select.ENV, "auto")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_llama_config(head_dim=64, intermediate_size=128)).eval().to(DEV)
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(0)).to(DEV)
    for impl in ("sdpa", "turboquant"):
        model.set_attn_implementation(impl)
        res = {}
        for name, cache in (("static", transformers.StaticCache(config=model.config, max_cache_len=64)),
                            ("tq", TurboQuantStaticCache(config=model.config, max_cache_len=64, key_bits=8, value_bits=8,
                                                         residual_length=4, sink_tokens=2, key_centering=True))):
            res[name] = model.generate(ids, **with_cache(cache), max_new_tokens=12, min_new_tokens=12,
                                       do_sample=False, output_logits=True, return_dict_in_generate=True)
        torch.testing.assert_close(torch.stack(res["tq"].logits, 1), torch.stack(res["static"].logits, 1), atol=0.05,
                                   rtol=0, msg=lambda m, impl=impl: f"8-bit centred static vs StaticCache ({impl}): {m}")
        assert torch.equal(res["tq"].sequences, res["static"].sequences), f"8-bit centred ({impl}): tokens differ"
