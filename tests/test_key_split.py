"""Split keys (`TurboQuantConfig.key_split`): the format against its definition, the channel calibration, and a split
cache on every path a dynamic layer has (prefill chunks, decode steps, sliding windows, batch ops, crop)."""

import json

import pytest
import torch
import transformers
from transformers import DynamicCache

from conftest import chunked_logits, static_logits, tiny_gemma3_config, tiny_llama_config, with_cache
from tq_hf_cache import TurboQuantCache, TurboQuantConfig, TurboQuantStaticCache, ops, reference
from tq_hf_cache._compat import IS_V5
from tq_hf_cache.quant.codebook import theoretical_codebook
from tq_hf_cache.quant.key_split import calibrate_key_split, check_spec, make_split
from tq_hf_cache.quant.packing import packed_bytes
from tq_hf_cache.quant.rotation import make_rotation
from tq_hf_cache.kernels import select

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 2e-3 if DEV == "cuda" else 2e-4  # attention implementations in float32: CUDA's differ more (TF32, tiling)
EXACT = 2e-4 if DEV == "cuda" else 0  # one batch row vs the same row alone: exact on a CPU, not across CUDA tilings


def _random_spec(g, heads, sizes, bits):
    order = [torch.randperm(sum(sizes), generator=g).tolist() for _ in range(heads)]
    return check_spec({"bits": list(bits), "sizes": list(sizes), "order": order}, 0)


@pytest.mark.parametrize("sizes,bits", [((32, 32), (5, 3)), ((48, 80), (3, 1)), ((6, 34), (8, 2)),
                                        ((16, 16, 32), (7, 4, 3))])
def test_split_keys_are_turboquant_vectors_of_their_channel_sets(sizes, bits):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    g = torch.Generator().manual_seed(seed)
    heads, dim = 3, sum(sizes)
    spec = _random_spec(g, heads, sizes, bits)
    split = make_split(spec, 0, heads, dim, lambda d: make_rotation(d, seed % 1000), theoretical_codebook)
    x = torch.randn(2, heads, 37, dim, generator=g) * torch.rand(dim, generator=g) * 4
    parts = reference.split_quantize(x, split, torch.float16)
    assert [p.shape[-1] for p, _ in parts] == [packed_bytes(n, b) for n, b in zip(sizes, bits)]
    want = torch.empty_like(x)
    for h in range(heads):
        at = 0
        for p, (n, (rot, cb), (packed, norms)) in enumerate(zip(sizes, split.parts, parts)):
            chans = torch.tensor(spec["order"][h][at : at + n])
            at += n
            pk, nm = reference.quantize(x[:, h, :, chans], rot, cb, torch.float16)
            assert torch.equal(packed[:, h], pk), f"packed codes, part {p}, head {h} (seed {seed})"
            assert torch.equal(norms[:, h], nm), f"norms, part {p}, head {h} (seed {seed})"
            want[:, h, :, chans] = reference.dequantize(pk, nm, rot, cb)
    got = reference.split_dequantize(parts, split)
    torch.testing.assert_close(got, want, atol=0, rtol=0, msg=f"split_dequantize (seed {seed})")
    # the cache's entry points (the kernels on CUDA, the reference elsewhere) write into caller-owned buffers
    xd = x.to(DEV)
    split_d = split.to(DEV)
    bufs = [tuple(torch.full_like(t, 7, device=DEV) for t in pair) for pair in parts]  # poisoned
    ops.quantize_split_into(xd, split_d, bufs)
    out = torch.full((2, heads, 37, dim), float("nan"), device=DEV)
    ops.dequantize_split_into(bufs, split_d, out)
    tol = 0 if DEV == "cpu" else 2e-3
    torch.testing.assert_close(out.cpu(), want, atol=tol * x.abs().max(), rtol=tol, msg=f"ops round trip (seed {seed})")


def test_a_bad_split_is_refused_naming_the_value():
    ok = {"bits": [5, 3], "sizes": [4, 4], "order": [[3, 0, 2, 1, 7, 4, 6, 5]]}
    assert check_spec(ok, 2) == ok
    cases = [
        ({**ok, "bits": [9, 3]}, r"key_split\[2\] bits of part 0 must be an integer in \[1, 8\], got 9"),
        ({**ok, "bits": [5]}, "one entry per part, at least 2 parts; got bits=\\[5\\], sizes=\\[4, 4\\]"),
        ({**ok, "sizes": [1, 7]}, r"key_split\[2\] part 0 holds 1 channels; a part must hold an integer >= 3"),
        ({**ok, "sizes": [2, 6]}, r"key_split\[2\] part 0 holds 2 channels; a part must hold an integer >= 3"),
        ({**ok, "order": [[0, 0, 1, 2, 3, 4, 5, 6]]}, r"KV head 0: the order must be a permutation of the channels 0..7"),
        ({**ok, "order": [list(range(8)), [0, 1, 2]]}, r"KV head 1: the order must be a permutation"),
        ({"bits": [5, 3]}, "must be {'bits'"),
    ]
    for spec, msg in cases:
        with pytest.raises(ValueError, match=msg):
            check_spec(spec, 2)
    with pytest.raises(ValueError, match=r"key_split\[0\] gives channel orders for 1 KV heads, the layer has 2"):
        make_split(check_spec(ok, 0), 0, 2, 8, make_rotation, theoretical_codebook)
    with pytest.raises(ValueError, match=r"parts of sizes \[4, 4\] hold 8 channels, the layer's head dim is 32"):
        make_split(check_spec(ok, 0), 0, 1, 32, make_rotation, theoretical_codebook)
    with pytest.raises(ValueError, match="key_split names layers \\[7\\], but the model has 2 layers"):
        TurboQuantCache("k4v2", config=tiny_llama_config(), key_split={7: ok})
    with pytest.raises(ValueError, match="key_split names layer 0, which the config keeps in full precision"):
        TurboQuantCache("k4v2", config=tiny_llama_config(), skip_layers=[0],
                        key_split={0: {"bits": [5, 3], "sizes": [16, 16], "order": [list(range(32))] * 2}})


def _pair_heavy_llama(pairs=(3, 9), head_dim=64, scale=8.0, **kw):
    """A tiny Llama whose queries and keys are large on a few RoPE pairs, as trained models' are."""
    torch.manual_seed(0)
    cfg = tiny_llama_config(head_dim=head_dim, hidden_size=64, **kw)
    model = transformers.LlamaForCausalLM(cfg).eval()
    heavy = torch.ones(head_dim)
    for p in pairs:
        heavy[p] = heavy[p + head_dim // 2] = scale
    for layer in model.model.layers:
        a = layer.self_attn
        for proj, heads in ((a.q_proj, cfg.num_attention_heads), (a.k_proj, cfg.num_key_value_heads)):
            w = proj.weight.data.view(heads, head_dim, -1)
            w.mul_(heavy[None, :, None])
    return model


def test_calibration_picks_the_heavy_rope_pairs_and_the_split_brings_the_logits_closer():
    heavy = tuple(range(0, 32, 2))  # 16 of the 32 RoPE pairs
    model = _pair_heavy_llama(pairs=heavy, scale=3.0)
    ids = torch.randint(3, 128, (1, 300), generator=torch.Generator().manual_seed(4))
    base = TurboQuantConfig(key_bits=4, value_bits=8)  # values near exact: the keys' error shows
    spec = calibrate_key_split(model, ids, [32, 32], [1, -1], base)
    assert set(spec) == {0, 1}
    high = sorted(heavy + tuple(p + 32 for p in heavy))
    for layer_spec in spec.values():
        assert layer_spec["bits"] == [5, 3] and layer_spec["sizes"] == [32, 32]
        assert layer_spec["order"] == [high + [c for c in range(64) if c not in high]] * 2
    cfg = TurboQuantConfig.from_dict({**base.to_dict(), "key_split": spec})
    assert TurboQuantConfig.from_json_string(cfg.to_json_string()) == cfg  # layer keys survive JSON as ints
    model = model.to(DEV)
    err = {}
    ids = ids.to(DEV)
    fp = chunked_logits(model, DynamicCache(config=model.config), ids, 240)
    for name, tq in (("plain", base), ("split", cfg)):
        logits = chunked_logits(model, TurboQuantCache(tq, config=model.config, residual_length=8), ids, 240)
        err[name] = float((logits - fp)[:, 40:].norm() / fp[:, 40:].norm())  # the positions that read the cache
    # a score weighs a key's error in channel c by the query's energy there; the heavy half of the channels holds
    # 90 % of both, and gets 5 bits where the plain format spreads a 4-bit error over every channel (measured 0.70x)
    assert err["split"] < err["plain"] * 0.8, err
    model = model.cpu()
    with pytest.raises(ValueError, match="every part needs an even number of channels >= 4"):
        calibrate_key_split(model, ids, [5, 59], [1, -1])
    with pytest.raises(ValueError, match="every part needs an even number of channels >= 4"):
        calibrate_key_split(model, ids, [2, 62], [1, -1])
    with pytest.raises(ValueError, match="sizes \\[32, 16\\] sum to 48; they must sum to the head dim 64"):
        calibrate_key_split(model, ids, [32, 16], [1, -1])
    with pytest.raises(ValueError, match="key bits 2 \\+ deltas\\[1\\] \\(-2\\) gives 0; the bits must lie in 1..8"):
        calibrate_key_split(model, ids, [32, 32], [1, -2], TurboQuantConfig.from_preset("k2v2"))


def _spec_for(model, sizes, bits):
    cfg = model.config
    g = torch.Generator().manual_seed(5)
    return {i: _random_spec(g, cfg.num_key_value_heads, sizes, bits) for i in range(cfg.num_hidden_layers)}


@pytest.fixture
def fused(monkeypatch):
    """Counts the fused attention's calls (`ops.decode_attention`)."""
    seen = {"calls": 0}
    call = ops.decode_attention

    def counting(*a, **k):
        seen["calls"] += 1
        return call(*a, **k)

    monkeypatch.setattr(ops, "decode_attention", counting)
    return seen


@pytest.mark.parametrize("centred", [False, True])
def test_a_split_cache_gives_the_same_logits_on_every_attention_and_through_batch_ops(centred, fused, monkeypatch):
    # the fused steps' torch math, on every device: the seam is under test here, the kernel (fp16 operands: 0.05
    # off on these heavy uncentred keys, as for whole keys) in test_decode_attention and the test below
    monkeypatch.setenv(select.ENV, "torch")
    model = _pair_heavy_llama().to(DEV)
    ids = torch.randint(3, 128, (2, 236), generator=torch.Generator().manual_seed(6)).to(DEV)
    spec = _spec_for(model, (16, 16, 32), (6, 4, 3))
    out = {}
    for impl in ("sdpa", "eager", "turboquant"):
        model.set_attn_implementation(impl)
        cache = TurboQuantCache("k4v2", config=model.config, residual_length=16, key_split=spec, key_centering=centred)
        out[impl] = chunked_logits(model, cache, ids, 200, step=3)
        lengths = {b.length for layer in cache.layers for b in layer.kv.buffers()}
        assert lengths == {cache.layers[0].quantized_length} and cache.layers[0].quantized_length > 150
    for impl in ("eager", "turboquant"):
        torch.testing.assert_close(out[impl], out["sdpa"], atol=TOL, rtol=TOL, msg=f"{impl} vs sdpa")
    assert fused["calls"] == 2 * (236 - 200) // 3, fused  # every 3-token step of both layers took the fused path
    # keys: the split's codes, dequantized, as the reference gives them
    layer = cache.layers[1]
    pk, _ = layer.kv.k_buf.live()
    want = reference.split_dequantize([b.live() for b in (layer.kv.k_buf, *layer.kv.k_more)], layer.key_split, layer.dtype)
    if centred:
        layer.kv.key_offset(layer.get_seq_length()).add_to(want, 0)
    ns = layer.kv.exact_sinks
    torch.testing.assert_close(layer.keys[:, :, ns : pk.shape[2]], want[:, :, ns:], atol=1e-5, rtol=1e-5,
                               msg="dense keys of the split layer")
    # batch ops and crop move every buffer alike: row 1 alone, then cropped and continued, equals a cache fed that way
    model.set_attn_implementation("sdpa")
    both = TurboQuantCache("k4v2", config=model.config, residual_length=16, key_split=spec, key_centering=centred)
    alone = TurboQuantCache("k4v2", config=model.config, residual_length=16, key_split=spec, key_centering=centred)
    with torch.no_grad():
        model(ids[:, :200], **with_cache(both))
        model(ids[1:, :200], **with_cache(alone))
        both.batch_select_indices(torch.tensor([1], device=DEV))
        both.crop(180)
        alone.crop(180)
        a = model(ids[1:, 180:236], **with_cache(both)).logits
        b = model(ids[1:, 180:236], **with_cache(alone)).logits
    torch.testing.assert_close(a, b, atol=EXACT, rtol=EXACT, msg="row 1 after batch_select_indices + crop vs alone")


def test_a_split_sliding_window_model_matches_its_dense_keys_after_the_window_slides():
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(tiny_gemma3_config()).eval().to(DEV)
    ids = torch.randint(3, 128, (1, 220), generator=torch.Generator().manual_seed(7)).to(DEV)
    spec = calibrate_key_split(model, ids[:, :100], [16, 48], [2, 0], TurboQuantConfig.from_preset("k3v3"))
    assert set(spec) == set(range(6))
    out = {}
    for impl in ("sdpa", "turboquant"):
        model.set_attn_implementation(impl)
        cache = TurboQuantCache("k3v3", config=model.config, residual_length=8, key_split=spec)
        out[impl] = chunked_logits(model, cache, ids, 160, chunk=32)
    torch.testing.assert_close(out["turboquant"], out["sdpa"], atol=TOL, rtol=TOL, msg="gemma3 sliding, split")
    sliding = [layer for layer in cache.layers if getattr(layer, "is_sliding", False)]
    assert sliding and all(len({b.length for b in layer.kv.buffers()}) == 1 for layer in sliding)
    # stored bytes: 16 channels at 5 bits + 48 at 3 bits
    layer = cache.layers[0]
    per_token = sum(b.nbytes_per_vec for b in (layer.kv.k_buf, *layer.kv.k_more))
    assert per_token == packed_bytes(16, 5) + packed_bytes(48, 3) == 28


def test_a_split_config_saves_and_loads_with_the_model(tmp_path):
    model = _pair_heavy_llama()
    ids = torch.randint(3, 128, (1, 64), generator=torch.Generator().manual_seed(8))
    spec = calibrate_key_split(model, ids, [8, 24, 32], [2, 0, -1])
    TurboQuantConfig(key_split=spec, key_centering=True).save_pretrained(tmp_path, model_config=model.config)
    doc = json.loads((tmp_path / "turboquant_config.json").read_text())
    assert doc["tq_config"]["key_split"]["1"]["bits"] == [7, 5, 4]  # the default k5v3's key bits, +2 / 0 / -1
    cache = TurboQuantCache.from_pretrained(tmp_path, config=model.config, residual_length=16)
    assert cache.tq_config.key_split == spec and cache.tq_config.key_centering
    with torch.no_grad():
        model(ids, **with_cache(cache))
        model(ids[:, :1], **with_cache(cache))
    layer = cache.layers[0]
    assert layer.key_split.sizes == [8, 24, 32] and [b.length for b in layer.kv.buffers()] == [64 - 16] * 4


def test_split_keys_cli_writes_a_folder_the_cache_and_the_eval_read(tmp_path, capsys, monkeypatch):
    from tq_hf_cache import cli
    from tq_hf_cache.tools.eval.caches import folder_spec

    model = _pair_heavy_llama()

    def tokenize(text, return_tensors):
        return {"input_ids": torch.randint(3, 128, (1, 400), generator=torch.Generator().manual_seed(9))}

    monkeypatch.setattr(cli, "_load_model", lambda *a, **k: (model, tokenize))
    out = tmp_path / "split"
    assert cli.main(["split-keys", "smollm2", "--sizes", "16,16,32", "--deltas", "2,0,-1", "--base", "k4v2",
                     "--key-centering", "--tokens", "300", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "16x6 + 16x4 + 32x3" in printed and "4.000" in printed
    cfg = TurboQuantConfig.from_pretrained(out)
    assert cfg.key_centering and set(cfg.key_split) == {0, 1} and cfg.key_split[0]["sizes"] == [16, 16, 32]
    assert cli.main(["info", str(out)]) == 0
    assert "split keys (channels x bits) in 2 layers: 16x6 + 16x4 + 32x3" in capsys.readouterr().out
    spec = folder_spec(str(out))
    # per KV head: keys 12 + 8 + 12 code bytes and three float16 norms, values 16 + 2
    assert spec.formula_bytes_per_token_layer(2, 64) == 2 * (12 + 8 + 12 + 3 * 2 + 16 + 2)
    cache = spec.make(model.config)
    with torch.no_grad():
        model(torch.randint(3, 128, (1, 200)), **with_cache(cache))
    assert cache.layers[1].key_split.sizes == [16, 16, 32]


@pytest.mark.parametrize("args,match", [
    (["split-keys", "smollm2", "--sizes", "32,32", "--deltas", "1,-1"], "pass --out DIR"),
    (["split-keys", "smollm2", "--sizes", "32,x", "--deltas", "1,-1", "--out", "X"], "--sizes must be comma-separated"),
    (["split-keys", "smollm2", "--sizes", "32,32", "--deltas", "1,+", "--out", "X"], "--deltas must be comma-separated"),
    (["split-keys", "smollm2", "--sizes", "32,32", "--deltas", "1,-1", "--base", "k9v9", "--out", "X"],
     "--base must be a preset"),
    (["split-keys", "smollm2", "--sizes", "32,32", "--deltas", "1,-1", "--tokens", "8", "--out", "X"],
     "--tokens must be >= 16"),
])
def test_split_keys_cli_refuses_bad_arguments_before_loading_the_model(tmp_path, capsys, monkeypatch, args, match):
    from tq_hf_cache import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "_load_model", lambda *a, **k: pytest.fail("the model must not load"))
    assert cli.main(args) == 2
    assert match in capsys.readouterr().err


@pytest.mark.slow
def test_decode_steps_through_the_fused_kernel_on_split_centred_keys(monkeypatch, fused):
    """The Triton kernel itself (interpreted on a CPU) on a split, centred layer's steps: the logits of SDPA on the
    same cache, the split's parts read by the kernel, the centring added as its scores' bias."""
    if DEV == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    from tq_hf_cache import kernels

    if not kernels.available():
        pytest.skip("no Triton here")
    monkeypatch.setenv(select.ENV, "triton")
    model = _pair_heavy_llama(num_hidden_layers=1).to(DEV)
    ids = torch.randint(3, 128, (2, 60), generator=torch.Generator().manual_seed(9)).to(DEV)
    spec = _spec_for(model, (32, 16, 16), (5, 4, 2))
    out = {}
    for impl in ("sdpa", "turboquant"):
        model.set_attn_implementation(impl)
        cache = TurboQuantCache("k4v2", config=model.config, residual_length=8, key_split=spec, key_centering=True,
                                fused_sdpa=impl != "sdpa")
        out[impl] = chunked_logits(model, cache, ids, 48, chunk=24)
    assert fused["calls"] == 60 - 48  # every decode step
    torch.testing.assert_close(out["turboquant"], out["sdpa"], atol=2e-2, rtol=2e-2,  # the kernel's fp16 operands
                               msg="kernel vs sdpa")


@pytest.mark.skipif(not IS_V5, reason="TurboQuantStaticCache needs transformers >= 5")
def test_a_static_split_cache_holds_the_dynamic_caches_codes_and_attends_alike_on_every_path(monkeypatch):
    """TurboQuantStaticCache with split keys: the same codes as TurboQuantCache for every position both hold
    packed, the same logits through the dense keys (sdpa), the fused op (turboquant) and a compiled step; with 8-bit
    parts, close to transformers' StaticCache with the same greedy tokens. The fused op's torch math on every device
    (the seam is under test; the kernel on split static layers in test_static_attention)."""
    monkeypatch.setenv(select.ENV, "torch")
    model = _pair_heavy_llama().to(DEV)
    ids = torch.randint(3, 128, (2, 60), generator=torch.Generator().manual_seed(10)).to(DEV)
    spec = _spec_for(model, (16, 16, 32), (6, 4, 3))
    kw = dict(config=model.config, residual_length=4, sink_tokens=2, key_split=spec)
    out = {impl: static_logits(model, TurboQuantStaticCache(max_cache_len=64, tq_config="k4v2", **kw), ids, 48, impl)
           for impl in ("sdpa", "turboquant")}
    torch._dynamo.reset()
    compiled = torch.compile(model.forward, backend="aot_eager", fullgraph=True)
    static = TurboQuantStaticCache(max_cache_len=64, tq_config="k4v2", **kw)
    out["compiled"] = static_logits(model, static, ids, 48, "turboquant", compiled)
    for name in ("turboquant", "compiled"):
        torch.testing.assert_close(out[name], out["sdpa"], atol=TOL, rtol=TOL, msg=f"static split: {name} vs sdpa")
    dynamic = TurboQuantCache("k4v2", **kw)
    chunked_logits(model, dynamic, ids, 48, chunk=48)
    for i, (s_layer, d_layer) in enumerate(zip(static.layers, dynamic.layers)):
        # the prompt's keys are the same in both caches (after it, a layer's keys depend on how the layers below
        # attended: to exact or to packed recent keys)
        assert d_layer.quantized_length >= 48
        for p, ((sp, sn), dbuf) in enumerate(zip(s_layer.packed.key_parts, d_layer.kv.key_buffers())):
            dp, dn = dbuf.live()
            torch.testing.assert_close(sp[:, :, :48], dp[:, :, :48], atol=0, rtol=0, msg=f"layer {i} part {p} codes")
            torch.testing.assert_close(sn[:, :, :48], dn[:, :, :48], atol=0, rtol=0, msg=f"layer {i} part {p} norms")
    # through generate (compiled with CUDA graphs on a GPU: the kernel there), on a model of ordinary scale
    monkeypatch.setenv(select.ENV, "auto")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_llama_config(head_dim=64, intermediate_size=128)).eval().to(DEV)
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(0)).to(DEV)
    eight = {i: {**s, "bits": [8, 8, 8]} for i, s in _spec_for(model, (16, 16, 32), (6, 4, 3)).items()}
    want_seq = want = None
    for impl in ("sdpa", "turboquant"):
        model.set_attn_implementation(impl)
        if want is None:
            ref = model.generate(ids, **with_cache(transformers.StaticCache(config=model.config, max_cache_len=64)),
                                 max_new_tokens=12, min_new_tokens=12, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
            want_seq, want = ref.sequences, torch.stack(ref.logits, 1)
        cache = TurboQuantStaticCache(config=model.config, max_cache_len=64, key_bits=8, value_bits=8,
                                      residual_length=4, sink_tokens=2, key_split=eight)
        got = model.generate(ids, **with_cache(cache), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
        torch.testing.assert_close(torch.stack(got.logits, 1), want, atol=0.05, rtol=0,
                                   msg=lambda m, impl=impl: f"8-bit split parts vs StaticCache ({impl}): {m}")
        assert torch.equal(got.sequences, want_seq), f"8-bit split parts ({impl}): greedy tokens differ"
    assert static.nbytes()["packed"] == 2 * 2 * 64 * 2 * (packed_bytes(16, 6) + packed_bytes(16, 4) + packed_bytes(32, 3)
                                                          + packed_bytes(64, 2) + 2 * 4)  # codes and fp16 norms


@pytest.mark.skipif(not IS_V5, reason="TurboQuantStaticCache needs transformers >= 5")
@pytest.mark.parametrize("centred", [False, True])
def test_a_static_split_cache_reorders_crops_and_resets_every_part(centred, monkeypatch):
    """Batch reorder and crop move every part (and a centred layer's key means); with centring too, the fused op
    (its torch math) reads what the dense keys give."""
    monkeypatch.setenv(select.ENV, "torch")
    model = _pair_heavy_llama().to(DEV)
    ids = torch.randint(3, 128, (2, 50), generator=torch.Generator().manual_seed(11)).to(DEV)
    spec = _spec_for(model, (32, 32), (5, 3))
    kw = dict(config=model.config, max_cache_len=64, tq_config="k4v2", residual_length=4, key_split=spec,
              key_centering=centred)
    dense, fused = (static_logits(model, TurboQuantStaticCache(**kw), ids, 40, impl) for impl in ("sdpa", "turboquant"))
    torch.testing.assert_close(fused, dense, atol=TOL, rtol=TOL, msg="static split: turboquant vs sdpa")
    swapped, cache = TurboQuantStaticCache(**kw), TurboQuantStaticCache(**kw)
    static_logits(model, swapped, ids.flip(0)[:, :40], 40, "sdpa")
    static_logits(model, cache, ids[:, :40], 40, "sdpa")
    cache.reorder_cache(torch.tensor([1, 0], device=DEV))
    cache.crop(36)
    swapped.crop(36)
    a = static_logits(model, cache, ids.flip(0)[:, :50], 36, "turboquant", prefilled=True)
    b = static_logits(model, swapped, ids.flip(0)[:, :50], 36, "turboquant", prefilled=True)
    torch.testing.assert_close(a, b, atol=EXACT, rtol=EXACT, msg="reordered + cropped vs fed that way")
    cache.reset()
    assert int(cache.get_seq_length()) == 0 and all(
        (t == 0).all() for layer in cache.layers for part in layer.packed.key_parts for t in part)
    with pytest.raises(ValueError, match="key_split names layer 0, which the config keeps in full precision"):
        TurboQuantStaticCache(config=model.config, max_cache_len=64, key_split=spec, skip_layers=[0])


def test_a_split_that_would_fail_at_the_first_forward_is_refused_up_front(tmp_path):
    """Part sizes a layer cannot build (a 2-channel part, Hadamard on a non-power-of-two part, parts not summing to
    the head dim, orders for another head count) are refused by the config / cache naming key_split and the layer,
    not at the first forward."""
    cfg = tiny_llama_config()  # 2 KV heads, head dim 32
    order = [list(range(32))] * 2
    with pytest.raises(ValueError, match=r"key_split\[1\] part 0 holds 2 channels; a part must hold an integer >= 3"):
        TurboQuantConfig(key_split={1: {"bits": [6, 4], "sizes": [2, 30], "order": order}})
    with pytest.raises(ValueError, match=r"key_split\[0\] has parts of \[12, 20\] channels, but rotation='hadamard'"):
        TurboQuantConfig(rotation="hadamard", key_split={0: {"bits": [6, 4], "sizes": [12, 20], "order": order}})
    wrong_sum = TurboQuantConfig(key_split={0: {"bits": [6, 4], "sizes": [8, 16], "order": [list(range(24))] * 2}})
    wrong_heads = TurboQuantConfig(key_split={0: {"bits": [6, 4], "sizes": [16, 16], "order": order[:1]}})
    for tq, msg in ((wrong_sum, r"key_split\[0\] parts of sizes \[8, 16\] hold 24 channels, but the model's head dim is 32"),
                    (wrong_heads, r"key_split\[0\] gives channel orders for 1 KV heads, but the model has 2 KV heads")):
        with pytest.raises(ValueError, match=msg):
            TurboQuantCache(tq, config=cfg)
        with pytest.raises(ValueError, match=msg):
            tq.save_pretrained(tmp_path / "out", model_config=cfg)
        assert not (tmp_path / "out" / "turboquant_config.json").exists()
    if IS_V5:
        from tq_hf_cache import TurboQuantStaticCache

        with pytest.raises(ValueError, match=r"key_split\[0\] parts of sizes \[8, 16\] hold 24 channels"):
            TurboQuantStaticCache(cfg, max_cache_len=64, tq_config=wrong_sum)
    # a hand-edited file: the stored model facts catch it when the folder is read
    TurboQuantConfig().save_pretrained(tmp_path / "edited", model_config=cfg)
    path = tmp_path / "edited" / "turboquant_config.json"
    doc = json.loads(path.read_text())
    doc["tq_config"]["key_split"] = wrong_sum.to_dict()["key_split"]
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"turboquant_config.json: tq_config: key_split\[0\] parts of sizes \[8, 16\]"):
        TurboQuantConfig.from_pretrained(tmp_path / "edited")
