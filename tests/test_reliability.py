"""No silent wrong result, nothing half-done: one test (or a few) per finding of the hostile-user review.

Generate modes against DynamicCache are in test_conformance.py, random operation sequences in
test_cache_properties.py.
"""

import json
import os
import pickle

import pytest
import torch
from transformers import DynamicCache, LlamaForCausalLM
from transformers.cache_utils import DynamicSlidingWindowLayer

from conftest import tiny_llama_config, with_cache
from tq_hf_cache import TurboQuantCache, TurboQuantConfig, TurboQuantSlidingLayer, reference
from tq_hf_cache._compat import IS_V5
from tq_hf_cache.calibrate.calibration import CODEBOOKS_NAME, CalibratedCodebooks, calibrate
from tq_hf_cache.quant.codebook import theoretical_codebook
from tq_hf_cache.config import TURBOQUANT_CONFIG_NAME
from tq_hf_cache.quant.packed_kv import PackedKV


def ids(batch, length, seed=0):
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def kv(b=1, h=2, t=5, d=32, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, t, d, generator=g).to(dtype), torch.randn(b, h, t, d, generator=g).to(dtype)


def snapshot(cache):
    """Everything observable of a cache's state, to prove that a refused call changed nothing."""
    out = [cache.get_seq_length()]
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False):
            out += [layer.keys.clone(), layer.values.clone(), getattr(layer, "_slen", None)]
    return out


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


# ---- 1. crop(0) and sliding-window rollback --------------------------------------------------------------------


def test_crop_zero_follows_the_installed_transformers():
    cache = TurboQuantCache(residual_length=1000)
    k, v = kv(t=9)
    cache.update(k, v, 0)
    before = snapshot(cache)
    cache.crop(0)
    if IS_V5:  # "remove 0 tokens": generate calls crop(-rejected) with 0 rejected
        assert same(snapshot(cache), before)
    else:  # 4.x crop takes a length: keep 0 tokens, as DynamicCache does
        assert cache.get_seq_length() == 0


def test_crop_zero_keeps_a_quantized_layer_whole():
    cache = TurboQuantCache("k4v4", residual_length=3)
    k, v = kv(t=20)
    cache.update(k, v, 0)
    before = snapshot(cache)
    cache.crop(-0)
    if IS_V5:
        assert same(snapshot(cache), before)


def _sliding_pair(window=6, residual=100, record=True):
    tq = TurboQuantCache(residual_length=residual)
    layer = tq._tq_layer(TurboQuantSlidingLayer, 0, (8, 8), sliding_window=window)
    ref = DynamicSlidingWindowLayer(sliding_window=window)
    if record:
        layer.activate_past_recording()
        ref.activate_past_recording()
    return layer, ref


@pytest.mark.skipif(not IS_V5, reason="past recording is transformers 5.x")
def test_sliding_layer_rolls_back_like_dynamic_sliding_window_layer():
    layer, ref = _sliding_pair()
    g = torch.Generator().manual_seed(3)
    for step, (n, remove) in enumerate([(9, 0), (4, 2), (4, 4), (1, 0), (5, 3), (3, 1)]):
        k, v = torch.randn(1, 2, n, 32, generator=g), torch.randn(1, 2, n, 32, generator=g)
        a, b = layer.update(k, v), ref.update(k, v)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), f"step {step}: returned states differ"
        assert layer.get_mask_sizes(1) == ref.get_mask_sizes(1)
        layer.crop(-remove)
        ref.crop(-remove)
        assert layer.get_seq_length() == ref.get_seq_length()
        assert torch.equal(layer.keys, ref.keys) and torch.equal(layer.values, ref.values), f"step {step}"


def test_sliding_layer_refuses_a_rollback_it_cannot_do():
    layer, ref = _sliding_pair(record=False)
    k, v = kv(t=9)
    layer.update(k, v)
    ref.update(k, v)
    for cache_layer in (layer, ref):
        with pytest.raises(RuntimeError if IS_V5 else ValueError):  # transformers' own type on each version
            cache_layer.crop(-1)


# ---- 2. calibrated codebooks against the model that uses them ---------------------------------------------------


def _codebooks(layers=2, heads=2, dim=32):
    facts = {"model_type": "llama", "num_hidden_layers": layers, "num_key_value_heads": heads, "head_dim": dim}
    cfg = TurboQuantConfig()
    cbs = {(i, kind, b): theoretical_codebook(b, dim) for i in range(layers) for kind, b in (("key", 5), ("value", 3))}
    entries = {key: {"choice": "shared"} for key in cbs}
    return CalibratedCodebooks(cfg, facts, codebooks=cbs, entries=entries)


@pytest.mark.parametrize("shape, match", [((1, 2, 4, 16), "head dim 32.*head dim 16"), ((1, 4, 4, 32), "2 KV heads.*4 KV heads")])
def test_calibrated_codebooks_refuse_another_models_states(shape, match):
    cache = TurboQuantCache(codebooks=_codebooks())
    with pytest.raises(ValueError, match=match):
        cache.update(torch.randn(shape), torch.randn(shape), 0)
    assert cache.get_seq_length() == 0 and not cache.layers[0].is_initialized



def test_calibrated_codebooks_refuse_a_layer_the_model_did_not_have():
    cache = TurboQuantCache(codebooks=_codebooks(layers=2))
    cache.update(*kv(), 0)
    cache.update(*kv(), 1)
    with pytest.raises(ValueError, match="2-layer model.*layer 2"):
        cache.update(*kv(), 2)


def test_calibrated_codebooks_refuse_another_model_config():
    with pytest.raises(ValueError, match="num_key_value_heads=2, but the model config has num_key_value_heads=4"):
        TurboQuantCache(config=tiny_llama_config(num_key_value_heads=4), codebooks=_codebooks())
    TurboQuantCache(config=tiny_llama_config(), codebooks=_codebooks())  # the calibrated shape is accepted


# ---- 3. norms past float16's range --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_norms_are_stored_not_clamped(dtype):
    cache = TurboQuantCache(key_bits=8, value_bits=8, residual_length=0, sink_tokens=0)
    k, v = kv(t=6, dtype=torch.float32)
    k[:, :, 2] *= 1.1e5 / k[:, :, 2].norm(dim=-1, keepdim=True)
    v[:, :, 4] *= 3e5 / v[:, :, 4].norm(dim=-1, keepdim=True)
    with pytest.warns(RuntimeWarning, match="float32"):
        cache.update(k.to(dtype), v.to(dtype), 0)
        layer = cache.layers[0]
        keys = layer.keys  # a decode-sized step's tokens are quantized at the next update or read
    assert layer.kv.k_buf.norms.dtype == torch.float32
    ratio_k = keys.float().norm(dim=-1) / k.to(dtype).float().norm(dim=-1)
    ratio_v = layer.values.float().norm(dim=-1) / v.to(dtype).float().norm(dim=-1)
    assert torch.allclose(ratio_k, torch.ones_like(ratio_k), atol=0.02), ratio_k
    assert torch.allclose(ratio_v, torch.ones_like(ratio_v), atol=0.02), ratio_v
    cache.reset()  # a new sequence starts with the configured float16 norms again
    cache.update(*kv(t=3), 0)
    assert cache.layers[0].kv.k_buf.norms.dtype == torch.float16


def _big_chunks(split: bool):
    """A cache whose second 20-token chunk (longer than a decode step) holds a key past float16's range (token 28),
    after an ordinary first one."""
    extra = dict(key_split={0: {"sizes": [16, 16], "bits": [6, 3], "order": [list(range(31, -1, -1))] * 2}}) if split else {}
    cache = TurboQuantCache(key_bits=8, value_bits=8, residual_length=2, sink_tokens=0, **extra)
    k, v = kv(t=40, dtype=torch.float32)
    k[:, :, 28] *= 2e5 / k[:, :, 28].norm(dim=-1, keepdim=True)
    return cache, k, v


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
@pytest.mark.parametrize("read", ["keys", "pickle", "deepcopy", "next_chunk", "crop", "crop_below_then_append"])
def test_a_pending_norm_check_settles_before_any_use(split, read):
    """The check of a quantize call waits until the layer's norms are next used (so the host never waits for the
    GPU there); every use settles it first: the big norm then reads back exact, never inf."""
    import copy

    cache, k, v = _big_chunks(split)
    cache.update(k[:, :, :20], v[:, :, :20], 0)
    cache.update(k[:, :, 20:], v[:, :, 20:], 0)  # quantizes tokens 18..37: the check is pending
    layer = cache.layers[0]
    assert all(b.pending is not None for b in layer.kv.buffers())
    assert all(b.raw_norms().dtype == torch.float16 for b in layer.kv.buffers())
    with pytest.warns(RuntimeWarning, match="float32"):
        if read == "keys":
            got = layer.keys
        elif read == "pickle":
            layer = pickle.loads(pickle.dumps(cache)).layers[0]
        elif read == "deepcopy":
            layer = copy.deepcopy(cache).layers[0]
        elif read == "next_chunk":
            cache.update(*kv(t=3, seed=5), 0)
        elif read == "crop":  # a crop moves no norm: the read after it settles
            cache.crop(30)
            layer.keys
        else:  # the big key cropped away, its slot written again: settled before that write
            cache.crop(25)
            cache.update(*kv(t=20, seed=5), 0)
    assert all(b.pending is None and b.norms.dtype == torch.float32 for b in layer.kv.buffers())
    assert layer.norm_dtype == torch.float32  # a copy too: the layer settles before its state is taken
    got = layer.keys.float()
    assert torch.isfinite(got).all()
    if read == "crop_below_then_append":
        return
    ratio = got[:, :, 28].norm(dim=-1) / k[:, :, 28].norm(dim=-1)
    assert torch.allclose(ratio, torch.ones_like(ratio), atol=0.05), ratio
    if read in ("keys", "next_chunk"):  # the stored norm of the big key is its exact float32 norm
        stored = [b.live()[1][:, :, 28] for b in layer.kv.key_buffers()]
        want = [x.norm(dim=-1) for x in (layer.key_split.split(k[:, :, 28:29]) if split else [k[:, :, 28:29]])]
        for s_, w in zip(stored, want):
            torch.testing.assert_close(s_, w[..., 0], rtol=1e-5, atol=0, msg="the big key's stored norm")


def test_a_norm_check_that_fails_to_warn_has_still_widened():
    """With warnings raised as errors the widening warning stops the read that settled the check, but the norms are
    final before it is raised: the next read is exact, never inf."""
    import warnings

    cache, k, v = _big_chunks(False)
    cache.update(k[:, :, :20], v[:, :, :20], 0)
    cache.update(k[:, :, 20:], v[:, :, 20:], 0)
    layer = cache.layers[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeWarning, match="float32"):
            layer.keys
    assert layer.norm_dtype == torch.float32 and all(b.pending is None for b in layer.kv.buffers())
    assert torch.isfinite(layer.keys.float()).all()


def test_a_pending_norm_check_keeps_no_dropped_cache_alive():
    """The check holds its buffers and layer weakly: a cache dropped before anything read its norms is freed at once,
    without the cycle collector."""
    import gc
    import weakref

    cache, k, v = _big_chunks(False)
    cache.update(k[:, :, :20], v[:, :, :20], 0)
    cache.update(k[:, :, 20:], v[:, :, 20:], 0)
    refs = [weakref.ref(b) for b in cache.layers[0].kv.buffers()] + [weakref.ref(cache.layers[0])]
    assert all(r().pending is not None for r in refs[:-1])
    gc.disable()
    try:
        del cache
        assert all(r() is None for r in refs)
    finally:
        gc.enable()


def test_ordinary_norms_keep_float16_storage():
    cache = TurboQuantCache(residual_length=0)
    cache.update(*kv(t=6), 0)
    assert cache.layers[0].kv.k_buf.norms.dtype == torch.float16


def test_reference_never_makes_up_a_finite_norm():
    rot, cb = reference_rot_cb()
    x = torch.randn(1, 1, 2, 32)
    x[0, 0, 1] *= 1e5 / x[0, 0, 1].norm()
    _, norms = reference.quantize(x, rot, cb, torch.float16)
    assert norms[0, 0, 1] == float("inf")


def reference_rot_cb(d=32, bits=4):
    from tq_hf_cache.quant.rotation import make_rotation

    return make_rotation(d, 0), theoretical_codebook(bits, d)


# ---- 4. switching the attention implementation --------------------------------------------------------------------


def _steps(model, cache, x, start):
    return [model(x[:, i : i + 1], **with_cache(cache)).logits for i in range(start, x.shape[1])]


@torch.no_grad()
@pytest.mark.parametrize("other", ["sdpa", "eager"])
def test_switching_attention_mid_generation_gives_the_same_logits(other):
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config()).eval()
    x = ids(1, 40)
    switched, plain = TurboQuantCache("k4v4", residual_length=4), TurboQuantCache("k4v4", residual_length=4)
    model.set_attn_implementation(other)
    model(x[:, :30], **with_cache(plain))
    want = _steps(model, plain, x, 30)
    model.set_attn_implementation("turboquant")
    model(x[:, :30], **with_cache(switched))
    _steps(model, switched, x[:, :33], 30)  # three fused steps arm every layer
    model.set_attn_implementation(other)
    got = _steps(model, switched, x, 33)
    for a, b in zip(got, want[3:]):
        assert ((a - b).norm() / b.norm()).item() < 1e-4


@torch.no_grad()
@pytest.mark.parametrize("other", ["sdpa", "eager"])
def test_a_cache_moves_between_models_and_attention_implementations(other):
    """Nothing in the cache depends on which attention read it last: a cache used by a turboquant model and
    another model (sdpa / eager) on alternate steps gives the other model's logits at every step."""
    torch.manual_seed(0)
    fused = LlamaForCausalLM(tiny_llama_config()).eval()
    plain = LlamaForCausalLM(tiny_llama_config()).eval()
    plain.load_state_dict(fused.state_dict())
    fused.set_attn_implementation("turboquant")
    plain.set_attn_implementation(other)
    x = ids(1, 44)
    cache, ref = TurboQuantCache("k4v4", residual_length=4), TurboQuantCache("k4v4", residual_length=4)
    fused(x[:, :30], **with_cache(cache))
    plain(x[:, :30], **with_cache(ref))
    for i in range(30, 44):
        model = fused if i % 2 else plain
        a = model(x[:, i : i + 1], **with_cache(cache)).logits
        b = plain(x[:, i : i + 1], **with_cache(ref)).logits
        assert ((a - b).norm() / b.norm()).item() < 1e-4, f"step {i} ({'turboquant' if i % 2 else other})"
    assert cache.get_seq_length() == ref.get_seq_length() == 44


# ---- 5. saving a config into a calibrated folder ------------------------------------------------------------------


def test_saving_a_config_keeps_or_refuses_calibrated_codebooks(tmp_path):
    cb = _codebooks()
    cb.save_pretrained(tmp_path)
    with open(tmp_path / TURBOQUANT_CONFIG_NAME) as f:
        index = json.load(f)["codebooks"]
    # a compatible change (the residual window) keeps the codebook index: the folder still loads
    TurboQuantConfig(residual_length=64).save_pretrained(tmp_path)
    with open(tmp_path / TURBOQUANT_CONFIG_NAME) as f:
        doc = json.load(f)
    assert doc["codebooks"] == index and doc["tq_config"]["residual_length"] == 64
    cache = TurboQuantCache.from_pretrained(str(tmp_path), config=tiny_llama_config())
    assert cache.codebooks is not None and cache.tq_config.residual_length == 64
    # bits the codebooks do not cover, or another rotation seed: refused, the folder untouched
    before = (tmp_path / TURBOQUANT_CONFIG_NAME).read_bytes()
    for bad in (TurboQuantConfig.from_preset("k8v4"), TurboQuantConfig(seed=3)):
        with pytest.raises(ValueError, match="orphan"):
            bad.save_pretrained(tmp_path)
        assert (tmp_path / TURBOQUANT_CONFIG_NAME).read_bytes() == before
    assert (tmp_path / CODEBOOKS_NAME).exists()


# ---- 6. calibrating on too few tokens -----------------------------------------------------------------------------


@pytest.mark.parametrize("data", [torch.tensor([5]), torch.randint(3, 128, (1, 32)), torch.randint(3, 128, (3, 20))])
def test_calibration_refuses_too_few_tokens_before_running_the_model(data):
    calls = []

    class Spy(LlamaForCausalLM):
        def forward(self, *a, **k):
            calls.append(1)
            return super().forward(*a, **k)

    torch.manual_seed(0)
    model = Spy(tiny_llama_config()).eval()
    with pytest.raises(ValueError, match="calibration needs at least 64 tokens in sequences longer than 32"):
        calibrate(model, data, TurboQuantConfig(), progress=False)
    assert not calls


# ---- 7. non-finite inputs -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_keys_stay_non_finite(bad):
    cache = TurboQuantCache("k4v4", residual_length=0, sink_tokens=0)
    k, v = kv(t=5)
    k[0, 1, 2, 7] = bad
    cache.update(k, v, 0)
    keys = cache.layers[0].keys
    assert not torch.isfinite(keys[0, 1, 2]).all()  # never a made-up finite vector
    ok = torch.ones_like(keys[..., 0], dtype=torch.bool)
    ok[0, 1, 2] = False
    assert torch.isfinite(keys[ok]).all()


@torch.no_grad()
def test_a_nan_key_gives_nan_attention_as_sdpa_does():
    torch.manual_seed(0)
    # head dim 64: the turboquant attention takes its fused path (the C kernels on a CPU), not dequantize + SDPA
    model = LlamaForCausalLM(tiny_llama_config(num_hidden_layers=1, head_dim=64, hidden_size=256)).eval()
    outs = {}
    for impl in ("sdpa", "turboquant"):
        model.set_attn_implementation(impl)
        cache = TurboQuantCache("k4v4", residual_length=2, sink_tokens=0)
        x = ids(1, 20)
        model(x, **with_cache(cache))  # a prefill (> 16 tokens): what leaves the residual window is quantized
        layer = cache.layers[0]
        layer.kv.k_buf.norms[0, 0, 3] = float("nan")  # one quantized key of KV head 0
        outs[impl] = [model(x[:, i : i + 1], **with_cache(cache)).logits for i in range(3)]
    for impl, logits in outs.items():
        assert all(torch.isnan(x).all() for x in logits), impl


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_fused_torch_math_propagates_non_finite(bad, seed):
    """NaN key: its KV head's queries give NaN. inf key: its score is +inf (NaN output, as SDPA on such a key) or
    -inf (the key gets no weight: the output is that of the other keys), never some other finite number."""
    rot, cb = reference_rot_cb()
    k, v = kv(t=8, seed=seed)
    k[0, 0, 2, 0] = bad
    kp, kn = reference.quantize(k, rot, cb)
    vp, vn = reference.quantize(v, rot, cb)
    state = PackedKV(kp, kn, vp, vn, k[:, :, :0], v[:, :, :0], k[:, :, :1], v[:, :, :1], 9, 8, rot, cb, cb, 0, -1, -1)
    q = torch.randn(1, 4, 1, 32, generator=torch.Generator().manual_seed(seed))
    out = reference.packed_attention(q, state, None, None)  # (B, n, Hq, D); query heads 0, 1 read KV head 0
    assert torch.isfinite(out[0, 0, 2:]).all()
    if bad != bad:  # NaN
        assert torch.isnan(out[0, 0, :2]).all()
        return
    without = torch.ones(1, 1, 1, 9, dtype=torch.bool)
    without[..., 2] = False
    rest = reference.packed_attention(q, state, without, None)
    for h in range(2):
        assert torch.isnan(out[0, 0, h]).all() or torch.allclose(out[0, 0, h], rest[0, 0, h]), f"seed {seed} head {h}"


def test_a_fully_masked_row_still_gives_zero():
    s = torch.tensor([[float("-inf")] * 3, [0.0, float("nan"), 1.0], [0.0, 1.0, float("-inf")]])
    p = reference.softmax_rows(s)
    assert torch.equal(p[0], torch.zeros(3)) and torch.isnan(p[1]).all() and torch.isfinite(p[2]).all()


# ---- 8. validate first, mutate after ------------------------------------------------------------------------------


@pytest.mark.parametrize("filled", [False, True])
@pytest.mark.parametrize(
    "k_shape, v_shape, match",
    [((1, 2, 5, 32), (1, 2, 4, 32), "same"), ((1, 2, 5, 32), (1, 2, 5, 16), "same"), ((1, 2, 5), (1, 2, 5), "head_dim")],
)
def test_bad_updates_raise_before_any_state_changes(filled, k_shape, v_shape, match):
    cache = TurboQuantCache(residual_length=3)
    if filled:
        cache.update(*kv(t=9), 0)
    before = snapshot(cache)
    with pytest.raises(ValueError, match=match):
        cache.update(torch.randn(k_shape), torch.randn(v_shape), 0)
    assert same(snapshot(cache), before)


def test_a_batch_change_is_refused_before_any_state_changes():
    cache = TurboQuantCache(residual_length=3)
    cache.update(*kv(t=9), 0)
    before = snapshot(cache)
    with pytest.raises(ValueError, match="do not match the cache's"):
        cache.update(*kv(b=2, t=1), 0)
    assert same(snapshot(cache), before)


# ---- 9. configuration --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(skip_layer_types="full_attention"), TypeError, r"did you mean \['full_attention'\]"),
        (dict(skip_layers=None), TypeError, "skip_layers must be a list"),
        (dict(skip_layers=3), TypeError, r"did you mean \[3\]"),
        (dict(layer_bits=None), TypeError, "layer_bits must be a dict"),
        (dict(layer_bits={"01": [4, 4], "1": [8, 8]}), ValueError, "names layer 1 twice"),
        (dict(layer_bits={"-1": [4, 4]}), ValueError, "layer indices >= 0"),
        (dict(residual_length=10**12), ValueError, r"residual_length must be an integer in \[0, 2147483647\]"),
        (dict(sink_tokens=10**9), ValueError, "sink_tokens must be an integer in"),
        (dict(seed=2**63 - 1), ValueError, "seed must be an integer in"),
    ],
)
def test_bad_config_values_are_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        TurboQuantConfig(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(skip_layers=[2]), r"skip_layers names layers \[2\], but the model has 2 layers"),
    (dict(layer_bits={5: [4, 4]}), r"layer_bits names layers \[5\]"),
    (dict(skip_first=3), "skip_first=3 is more than the model's 2 layers"),
])
def test_layers_the_model_does_not_have_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TurboQuantCache(config=tiny_llama_config(), **kwargs)


def test_preset_fields_can_be_overridden():
    cfg = TurboQuantConfig.from_preset("k4v4", key_bits=5, residual_length=8)
    assert (cfg.key_bits, cfg.value_bits, cfg.residual_length) == (5, 4, 8)
    with pytest.raises(ValueError, match="unknown TurboQuantConfig fields"):
        TurboQuantConfig.from_preset("k4v4", bits=5)


def test_a_long_residual_window_costs_only_what_the_prompt_holds():
    cache = TurboQuantCache(residual_length=10**6, sink_tokens=4)
    k, v = kv(t=20)
    cache.update(k, v, 0)
    held = cache.nbytes()
    token = 2 * 32 * 4  # one token's K or V over 2 heads, fp32
    assert held["residual"] == 2 * 20 * token and held["sinks"] == 0  # sink copies start when tokens are quantized
    assert torch.equal(cache.layers[0].keys, k)
    cache.update(*kv(t=300, seed=1), 0)  # grows as the sequence does
    assert cache.layers[0].residual_tokens == 320 and cache.nbytes()["residual"] <= 2 * 2 * 320 * token


# ---- 10. loader and command line ----------------------------------------------------------------------------------


def _saved(tmp_path):
    _codebooks().save_pretrained(tmp_path)
    with open(tmp_path / TURBOQUANT_CONFIG_NAME) as f:
        return json.load(f)


def test_all_zero_centroids_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    _saved(tmp_path)
    t = load_file(tmp_path / CODEBOOKS_NAME)
    t["layers.0.key.5bit.centroids"] = torch.zeros(32)
    save_file(t, tmp_path / CODEBOOKS_NAME, metadata={"format_version": "1"})
    with pytest.raises(ValueError, match="strictly ascending"):
        CalibratedCodebooks.from_pretrained(str(tmp_path))


@pytest.mark.parametrize("name", ["../turboquant_codebooks.safetensors", "/etc/passwd", "sub/x.safetensors", ".."])
def test_codebooks_file_must_stay_inside_the_folder(tmp_path, name):
    doc = _saved(tmp_path)
    doc["codebooks"]["file"] = name
    (tmp_path / TURBOQUANT_CONFIG_NAME).write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="must name a file inside the folder"):
        CalibratedCodebooks.from_pretrained(str(tmp_path))


def test_the_largest_seed_saves_and_loads(tmp_path):
    from tq_hf_cache.config import MAX_SEED

    cb = _codebooks()
    cb.config = TurboQuantConfig(seed=MAX_SEED)
    cb.save_pretrained(tmp_path)
    assert CalibratedCodebooks.from_pretrained(str(tmp_path)).config.seed == MAX_SEED


def cli(capsys, *args):
    """(exit code, stderr) of `tq-hf-cache ARGS`; any exception other than an exit is a test failure."""
    from tq_hf_cache.tools.cli import main

    try:
        rc = main(list(args))
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("doc, match", [
    ({"tq_config": {"key_bits": 99}}, "key_bits must be an integer in"),
    ({"tq_config": {"layer_bits": 3}}, "layer_bits must be a dict"),
    ({"tq_config": {}, "codebooks": 5}, "section"),
])
def test_info_names_the_bad_value_without_a_traceback(tmp_path, capsys, doc, match):
    (tmp_path / TURBOQUANT_CONFIG_NAME).write_text(json.dumps({"format": "tq_hf_cache.turboquant", "format_version": 1, **doc}))
    rc, err = cli(capsys, "info", str(tmp_path))
    assert rc == 1 and match in err, err


@pytest.mark.parametrize("args, match", [
    (["eval", "--model", "/nonexistent"], "neither a builtin"),
    (["eval", "--needle-depths", "7"], "needle depths are fractions of the prompt in [0, 1], got 7.0"),
    (["eval", "--ppl-tokens", "0"], "--ppl-tokens: must be >= 2, got 0"),
    (["eval", "--ppl-tokens", "100", "--chunk", "256"], "must exceed --chunk"),
    (["eval", "--needle-lengths", "0"], "--needle-lengths: must be >= 64"),
    (["calibrate", "smollm2", "--out", "/proc/x"], "cannot write the output folder '/proc/x'"),
    (["calibrate", "/nonexistent", "--out", "OUT"], "is not a folder"),
    (["calibrate", "smollm2", "--out", "OUT", "--seq-len", "0"], "--seq-len must be > 32"),
    (["calibrate", "smollm2", "--out", "OUT", "--max-tokens", "10"], "--max-tokens must be >= 64"),
    (["calibrate", "smollm2", "--out", "OUT", "--seed", str(2**63 - 1)], "seed must be an integer in"),
])
def test_cli_refuses_bad_arguments_up_front(tmp_path, capsys, monkeypatch, args, match):
    import tq_hf_cache.tools.cli as cli_module
    import tq_hf_cache.tools.models as models

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(models, "load_smollm2", no_model)
    monkeypatch.setattr(cli_module, "_load_model", no_model)
    args = [str(tmp_path / "out") if a == "OUT" else a for a in args]
    rc, err = cli(capsys, *args)
    assert rc == 2 and match in err, err
    assert not (tmp_path / "out" / TURBOQUANT_CONFIG_NAME).exists()


# ---- 11. pickling and gradients -----------------------------------------------------------------------------------


@pytest.mark.parametrize("fill_with_grad", [False, True])
def test_a_pickled_cache_runs_forward_and_backward_like_dynamic_cache(fill_with_grad):
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config()).eval()
    x = ids(1, 24)
    for make in (DynamicCache, lambda: TurboQuantCache("k4v4", residual_length=4)):
        cache = make()
        with torch.set_grad_enabled(fill_with_grad):
            model(x[:, :20], **with_cache(cache))
        restored = pickle.loads(pickle.dumps(cache))
        model.zero_grad()
        out = model(x[:, 20:22], **with_cache(restored)).logits
        out.float().sum().backward()
        assert model.model.layers[0].self_attn.k_proj.weight.grad is not None
        assert restored.get_seq_length() == 22


def test_gradients_reach_the_current_tokens_through_quantized_history():
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config()).eval()
    x = ids(1, 30)
    cache = TurboQuantCache("k4v4", residual_length=4)
    with torch.no_grad():
        model(x[:, :26], **with_cache(cache))
    for i in range(26, 30):  # several steps with grad: the shared workspace is not what autograd saves
        model.zero_grad()
        model(x[:, i : i + 1], **with_cache(cache)).logits.sum().backward()
        assert torch.isfinite(model.model.layers[1].self_attn.v_proj.weight.grad).all()


# ---- the same findings through the Triton kernels (CUDA only) -----------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the Triton kernels)")


@pytest.mark.gpu
@cuda
def test_large_norms_through_the_kernels():
    cache = TurboQuantCache(key_bits=8, value_bits=8, residual_length=0, sink_tokens=0)
    k, v = (t.cuda() for t in kv(h=2, t=40, d=128))
    k[:, :, 5] *= 2e5 / k[:, :, 5].norm(dim=-1, keepdim=True)
    with pytest.warns(RuntimeWarning, match="float32"):  # settled when the norms are next used
        cache.update(k.bfloat16(), v.bfloat16(), 0)
        keys = cache.layers[0].keys
    ratio = keys.float().norm(dim=-1) / k.bfloat16().float().norm(dim=-1)
    assert cache.layers[0].kv.k_buf.norms.dtype == torch.float32
    assert torch.allclose(ratio, torch.ones_like(ratio), atol=0.03), ratio


@pytest.mark.gpu
@cuda
@torch.no_grad()
def test_attention_switch_and_nan_keys_through_the_fused_kernel(monkeypatch):
    torch.manual_seed(0)
    cfg = tiny_llama_config(head_dim=64, num_attention_heads=4, num_key_value_heads=2, hidden_size=256)
    model = LlamaForCausalLM(cfg).cuda().to(torch.bfloat16).eval()
    x = ids(1, 61).cuda()
    switched, plain = TurboQuantCache(residual_length=8), TurboQuantCache(residual_length=8)
    model.set_attn_implementation("sdpa")
    model(x[:, :40], **with_cache(plain))
    want = _steps(model, plain, x[:, :59], 40)
    model.set_attn_implementation("turboquant")
    model(x[:, :40], **with_cache(switched))
    fused = _steps(model, switched, x[:, :50], 40)
    for a, b in zip(fused, want):
        assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 0.02
    model.set_attn_implementation("sdpa")
    for a, b in zip(_steps(model, switched, x[:, :59], 50), want[10:]):
        assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 0.02
    model.set_attn_implementation("turboquant")
    switched.layers[0].kv.k_buf.norms[0, 0, 10] = float("nan")  # a quantized key past the exact sink copies
    from tq_hf_cache.kernels import decode_attention as da
    from tq_hf_cache.kernels import cuda as cuda_launcher

    calls = []
    for launcher in (da, cuda_launcher):  # (the Triton and the CUDA kernels' launchers: `select` picks one)
        monkeypatch.setattr(launcher, "decode_attention",
                            lambda *a, kernel=launcher.decode_attention, **k: calls.append(1) or kernel(*a, **k))
    assert torch.isnan(model(x[:, 59:60], **with_cache(switched)).logits).all()
    assert calls  # the step ran the fused kernel


def test_eval_default_output_never_overwrites(tmp_path):
    from tq_hf_cache.tools.eval.cli import new_output_name

    first = new_output_name("smollm2", str(tmp_path))
    open(first, "w").close()
    second = new_output_name("smollm2", str(tmp_path))
    assert second != first and not os.path.exists(second) and os.path.basename(second).startswith("tq_eval_smollm2_")
