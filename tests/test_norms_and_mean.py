"""Two promises both caches keep alike: a key / value norm past float16's range (65504) never comes back inf from
finite input (`TurboQuantStaticCache` widens on an eager step as `TurboQuantCache` does, and a compiled step that
cannot widen makes the next check raise); and one huge key cannot capture a centred layer's key mean."""

import copy
import pickle
import warnings

import pytest
import torch
import transformers

from conftest import tiny_llama_config, with_cache
from tq_hf_cache import TurboQuantCache, TurboQuantStaticCache, kernels, reference
from tq_hf_cache._compat import IS_V5
from tq_hf_cache.quant.norm_check import FP16_MAX, note_largest, row_norms
from tq_hf_cache.quant.rope import OUTLIER_NORM_RATIO, key_mean, rope_angles

static_only = pytest.mark.skipif(not IS_V5, reason="TurboQuantStaticCache needs transformers >= 5")
CAP, T, BIG = 64, 40, 1e5  # positions held at most; tokens of the first update; the planted norm


def _seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()).item())


def _kv(t=T, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, t, 32, generator=g), torch.randn(1, 2, t, 32, generator=g)


def _big_kv(seed=0):
    """Keys and values of T tokens with a key of norm BIG at position 5 and a value of 3 BIG at 9: positions read
    from the packed codes (the window holds the newest residual_length + 16)."""
    k, v = _kv(seed=seed)
    k[:, :, 5] *= BIG / k[:, :, 5].norm(dim=-1, keepdim=True)
    v[:, :, 9] *= 3 * BIG / v[:, :, 9].norm(dim=-1, keepdim=True)
    return k, v


def _static(**kw):
    kw = dict(key_bits=8, value_bits=8, residual_length=2, sink_tokens=0) | kw
    return TurboQuantStaticCache(config=tiny_llama_config(), max_cache_len=CAP, **kw)


def _dense(layer):
    """A static layer's keys and values over the positions held, read back (dequantized, exact copies over)."""
    empty = torch.zeros(1, 2, 0, 32)
    return layer._full(empty, empty, int(layer.packed.length))


def _attention(k, v, seed=1):
    q = torch.randn(1, 2, 3, 32, generator=torch.Generator().manual_seed(seed))
    return torch.nn.functional.scaled_dot_product_attention(q, k.float(), v.float())


# ---- 1. norms past float16's range in the static cache ------------------------------------------------------------


@static_only
@pytest.mark.parametrize("extra", [{}, {"key_split": {0: {"sizes": [16, 16], "bits": [8, 6],
                                                         "order": [list(range(31, -1, -1))] * 2}}}],
                         ids=["whole", "split"])
@pytest.mark.parametrize("read", ["check_norms", "next_update", "state", "crop", "deepcopy", "pickle"])
def test_an_eager_static_update_widens_past_float16_with_a_warning(read, extra):
    """No host wait at the update: the check is pending until the next use, which widens the layer's norms to float32
    with TurboQuantCache's warning; the big norms then read back exact and the attention over them is finite and
    matches the exact keys' and TurboQuantCache's."""
    k, v = _big_kv()
    cache = _static(**extra)
    layer = cache.layers[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing yet: the update does not read its norms back
        cache.update(k, v, 0)
    assert layer.kv.pending is not None and layer.norm_dtype == torch.float16
    with pytest.warns(RuntimeWarning, match="layer 0 has a key/value norm of 3e\\+05.*norm_dtype='float32'"):
        if read == "check_norms":
            cache.check_norms()
        elif read == "next_update":
            cache.update(*_kv(t=2, seed=5), 0)
        elif read == "state":
            layer.state()
        elif read == "crop":
            cache.crop(T)
        elif read == "deepcopy":
            layer = copy.deepcopy(cache).layers[0]
        else:
            layer = pickle.loads(pickle.dumps(cache)).layers[0]
    assert layer.kv.pending is None and layer.norm_dtype == torch.float32
    assert layer.packed.k_norms.dtype == torch.float32 and layer.state()["v_norms"].dtype == torch.float32
    torch.testing.assert_close(layer.packed.v_norms[:, :, 9], v[:, :, 9].norm(dim=-1), rtol=1e-6, atol=0)
    if not extra:
        torch.testing.assert_close(layer.packed.k_norms[:, :, 5], k[:, :, 5].norm(dim=-1), rtol=1e-6, atol=0)
    keys, values = _dense(layer)
    keys, values = keys[:, :, :T].float(), values[:, :, :T].float()
    assert torch.isfinite(keys).all() and torch.isfinite(values).all()
    for got, want in ((keys, k), (values, v)):
        ratio = got.norm(dim=-1) / want.norm(dim=-1)
        assert torch.allclose(ratio, torch.ones_like(ratio), atol=0.02), ratio
    out = _attention(keys, values)
    assert torch.isfinite(out).all()
    want = _attention(k, v)
    assert float((out - want).norm() / want.norm()) < 0.02
    dyn = TurboQuantCache(key_bits=8, value_bits=8, residual_length=2, sink_tokens=0, **extra)
    with pytest.warns(RuntimeWarning, match="float32"):
        dk, dv = dyn.update(k, v, 0)
        dk, dv = dyn.layers[0].keys, dyn.layers[0].values
    mine = float((out - want).norm() / want.norm())
    theirs = float((_attention(dk, dv) - want).norm() / want.norm())
    assert mine < 2 * theirs + 1e-4, (mine, theirs)


@static_only
def test_float32_norms_up_front_never_warn_and_store_exact_norms():
    k, v = _big_kv()
    cache = _static(norm_dtype="float32")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache.update(k, v, 0)
        cache.check_norms()
        keys, values = _dense(cache.layers[0])
    assert cache.layers[0].kv.pending is None and cache.layers[0].norm_dtype == torch.float32
    torch.testing.assert_close(cache.layers[0].packed.k_norms[:, :, 5], k[:, :, 5].norm(dim=-1), rtol=1e-6, atol=0)
    assert torch.isfinite(_attention(keys[:, :, :T], values[:, :, :T])).all()


@static_only
def test_ordinary_norms_keep_float16_and_settle_silently():
    cache = _static()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache.update(*_kv(), 0)
        cache.check_norms()
        cache.update(*_kv(t=3, seed=1), 0)
    layer = cache.layers[0]
    assert layer.norm_dtype == torch.float16 and layer.packed.k_norms.dtype == torch.float16
    assert layer.kv.pending is not None  # the second update's, to be read at the next use


def _compiling(monkeypatch):
    """Run the static layer's update as a compiled step does (no widening, no host read, `check_norms` in the op)."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)


@static_only
@pytest.mark.parametrize("centred", [False, True])
def test_a_compiled_step_past_float16_makes_the_next_check_raise(monkeypatch, centred):
    """A compiled step cannot widen or raise: its append records the norm in the buffer's guard, and every check
    after it raises naming the layer and norm_dtype='float32' (sticky, until reset)."""
    extra = dict(key_centering=True) if centred else {}
    cache = _static(**extra)
    cache.update(*_kv(), 0)  # an ordinary eager prefill
    cache.check_norms()
    k, v = _kv(t=1, seed=3)
    k *= BIG / k.norm(dim=-1, keepdim=True)
    with monkeypatch.context() as m:
        _compiling(m)
        cache.update(k, v, 0)
    layer = cache.layers[0]
    assert layer.kv.pending is None and layer.norm_dtype == torch.float16
    assert float(layer.kv.norm_guard()[0]) > FP16_MAX
    for check in (cache.check_norms, layer.state, lambda: cache.crop(T), lambda: copy.deepcopy(cache)):
        with pytest.raises(RuntimeError, match="layer 0: a compiled step stored or read a key/value norm of 1e\\+05, "
                                               "above float16's range \\(65504\\).*norm_dtype='float32'"):
            check()
    cache.reset()
    cache.check_norms()  # cleared
    cache.update(*_kv(), 0)
    with monkeypatch.context() as m:  # an ordinary compiled step records nothing past the range
        _compiling(m)
        cache.update(*_kv(t=1, seed=4), 0)
    cache.check_norms()


@static_only
def test_a_compiled_step_after_an_unchecked_eager_overflow_raises(monkeypatch):
    """An eager update past the range whose check no eager use ran before a compiled step (a loop whose compiled
    forward makes its own mask): the step reads inf norms, and the next check says so."""
    cache = _static()
    cache.update(*_big_kv(), 0)
    with monkeypatch.context() as m:
        _compiling(m)
        cache.update(*_kv(t=1, seed=3), 0)
    with pytest.raises(RuntimeError, match="layer 0: a compiled step stored or read a key/value norm of 3e\\+05"):
        cache.check_norms()


@static_only
def test_a_real_compiled_step_records_what_it_cannot_widen():
    """torch.compile(fullgraph=True) decode steps that make their own mask: one whose new key is past the range makes
    the next check raise; an eager prefill past the range that check_norms() settled first widens, and the
    compiled steps after it read finite logits and raise nothing."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_llama_config()).eval()
    scale = torch.ones(())  # the layer-0 keys' factor, changed in place (no recompile)
    model.model.layers[0].self_attn.k_proj.register_forward_hook(lambda m, a, out: out * scale)
    ids = torch.randint(3, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    forward = torch.compile(model.forward, backend="aot_eager", fullgraph=True)

    def steps(cache, factors):
        logits = []
        with torch.no_grad():
            tok = ids[:, -1:]
            for i, f in enumerate(factors):
                scale.fill_(f)
                pos = torch.tensor([ids.shape[1] + i])
                out = forward(tok, **with_cache(cache), cache_position=pos, position_ids=pos[None]).logits
                logits.append(out)
                tok = out.argmax(-1)
        scale.fill_(1.0)
        return torch.cat(logits, 1)

    def prefill(factor):
        cache = TurboQuantStaticCache(config=model.config, max_cache_len=48, residual_length=2, sink_tokens=2)
        scale.fill_(factor)
        with torch.no_grad():
            model(ids, **with_cache(cache))
        scale.fill_(1.0)
        return cache

    cache = prefill(1.0)
    steps(cache, [1.0, 1e6, 1.0])
    with pytest.raises(RuntimeError, match="layer 0: a compiled step stored or read a key/value norm of .*"
                                           "norm_dtype='float32'"):
        cache.check_norms()
    assert cache.layers[1].norm_dtype == torch.float16
    cache = prefill(1e6)
    with pytest.warns(RuntimeWarning, match="layer 0 has a key/value norm"):
        cache.check_norms()
    out = steps(cache, [1.0] * 3)
    assert torch.isfinite(out).all() and cache.layers[0].norm_dtype == torch.float32
    cache.check_norms()
    cache = prefill(1e6)  # no check before the compiled steps: they read the unchecked norms, and the check says so
    steps(cache, [1.0])
    with pytest.raises(RuntimeError, match="layer 0: a compiled step stored or read"):
        cache.check_norms()


@pytest.mark.skipif(not kernels.available(), reason="no Triton here (CUDA, or the interpreter on a CPU)")
def test_the_norm_guard_kernel_matches_the_torch_check():
    """The compiled step's check on CUDA (one launch): the largest finite norm of the vectors given, with the guard's
    unchecked eager value, maxed into guard[0]; NaN and inf vectors are left out."""
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    k = torch.randn(2, 3, 5, 64, generator=g).transpose(1, 2).contiguous().transpose(1, 2)  # (2, 3, 5, 64) strided
    v = torch.randn(2, 3, 5, 64, generator=g).to(torch.bfloat16)
    part = torch.randn(2, 3, 5, 24, generator=g)
    k[1, 2, 3] *= 7e4 / k[1, 2, 3].norm()
    v[0, 1, 4] = float("inf")
    part[0, 0, 0] = float("nan")
    for xs, start in (([k, v], (0.0, 0.0)), ([k, part, v], (5.0, 9e4)), ([part], (1e6, 0.0))):
        xs = [x.to(dev) for x in xs]
        want = torch.tensor(start, device=dev)
        note_largest(want[0], row_norms(*xs))
        torch.maximum(want[0], want[1], out=want[0])
        got = torch.tensor(start, device=dev)
        kernels.note_largest_norm(got, xs)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0, msg=lambda m: f"seed {seed}: {m}")


@static_only
@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_a_cache_with_every_layer_pending_copies_whole(how):
    """After a forward every layer has an unchecked append; a copy runs every check first and holds none pending."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_llama_config(num_hidden_layers=3)).eval()
    cache = TurboQuantStaticCache(config=model.config, max_cache_len=48, residual_length=2, sink_tokens=2)
    with torch.no_grad():
        model(torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(0)), **with_cache(cache))
    assert sorted(cache.layers[0]._bookkeeping.pending) == [0, 1, 2]
    copied = pickle.loads(pickle.dumps(cache)) if how == "pickle" else copy.deepcopy(cache)
    for c in (cache, copied):
        assert not c.layers[0]._bookkeeping.pending and all(layer.kv.pending is None for layer in c.layers)
    for a, b in zip(cache.layers, copied.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.packed.k_norms, b.packed.k_norms)


def _big_key_model(position: int, factor: float):
    """A tiny Llama whose layer-0 keys at `position` of a prompt are scaled by `factor` (a forward hook)."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_llama_config(head_dim=32)).eval()

    def hook(module, args, out):
        if out.shape[1] > position:
            out = out.clone()
            out[:, position] *= factor
        return out

    model.model.layers[0].self_attn.k_proj.register_forward_hook(hook)
    return model


@static_only
@pytest.mark.parametrize("impl", ["sdpa", "turboquant"])
def test_a_model_with_a_key_past_float16_keeps_finite_logits_in_both_caches(impl):
    """Through a model: a prompt token whose key norm is past 65504 (layer 0) widens that layer in both caches; the
    decode steps' logits stay finite and the static cache's track TurboQuantCache's (and are as far from the exact
    DynamicCache's)."""
    model = _big_key_model(position=6, factor=3e5)
    model.set_attn_implementation(impl)
    ids = torch.randint(3, 128, (1, 48), generator=torch.Generator().manual_seed(0))
    out = {}
    for name in ("static", "dynamic", "exact"):
        if name == "static":
            cache = TurboQuantStaticCache(config=model.config, max_cache_len=64, key_bits=8, value_bits=8,
                                          residual_length=4, sink_tokens=2)
        elif name == "dynamic":
            cache = TurboQuantCache(config=model.config, key_bits=8, value_bits=8, residual_length=4, sink_tokens=2)
        else:
            cache = transformers.DynamicCache(config=model.config)
        with torch.no_grad(), warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            logits = [model(ids[:, :40], **with_cache(cache)).logits[:, -1:]]
            for t in range(40, 48):
                logits.append(model(ids[:, t : t + 1], **with_cache(cache)).logits)
        out[name] = torch.cat(logits, 1)
        widened = [w for w in seen if "above float16's range" in str(w.message)]
        assert (len(widened) == 1) == (name != "exact"), (name, [str(w.message) for w in seen])
        if name == "static":
            norm = cache.layers[0].packed.k_norms[0, :, 6]
            assert cache.layers[0].norm_dtype == torch.float32 and (norm > FP16_MAX).all(), norm
            assert cache.layers[1].norm_dtype == torch.float16
    assert torch.isfinite(out["static"]).all()
    scale = out["exact"].abs().max()
    assert float((out["static"] - out["dynamic"]).abs().max() / scale) < 0.01  # (a key this big magnifies the
    err = {name: float((out[name] - out["exact"]).abs().max() / scale) for name in out}  # codes' error in the scores)
    assert err["static"] < 1.1 * err["dynamic"] + 0.01, err


# ---- 2. the centred key mean resists outliers ---------------------------------------------------------------------


def _rope():
    return rope_angles(tiny_llama_config(), ["full_attention"])["full_attention"]


def _centred_keys(seed: int, t: int, outliers=(), factor=300.0):
    """Post-RoPE keys (1, 2, t, 32) whose pre-RoPE vectors have a large mean, the ones at `outliers` scaled by
    `factor` (the same keys otherwise for a seed)."""
    g = torch.Generator().manual_seed(seed)
    pre = 4 * torch.randn(1, 2, 1, 32, generator=g) + torch.randn(1, 2, t, 32, generator=g)
    pre[:, :, list(outliers)] *= factor
    return _rope().apply(pre, torch.arange(t)), pre


def test_key_mean_matches_its_oracle_and_leaves_out_huge_keys():
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    rope = _rope()
    for t in (1, 2, 7, 64):
        pre = 3 * torch.randn(2, 3, 1, 32, generator=g) + torch.randn(2, 3, t, 32, generator=g)
        n_out = int(torch.randint(0, max(1, t // 3), (), generator=g))
        idx = torch.randperm(t, generator=g)[:n_out]
        pre[:, :, idx] *= 10 ** float(torch.empty(()).uniform_(1, 6, generator=g))
        pos = torch.arange(100, 100 + t)
        got = key_mean(rope, rope.apply(pre, pos), pos)
        want = reference.key_mean(pre, OUTLIER_NORM_RATIO)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m: f"t={t} (seed {seed}): {m}")
        if t > 2 and n_out:
            clean = pre[:, :, [i for i in range(t) if i not in set(idx.tolist())]].mean(2, keepdim=True)
            torch.testing.assert_close(got, clean, rtol=1e-4, atol=1e-4, msg=lambda m: f"t={t} (seed {seed}): {m}")
    pre = torch.randn(1, 1, 5, 32, generator=g)
    pre[:, :, 2] = float("nan")
    pre[:, :, 3] = float("inf")
    pos = torch.arange(5)
    got = key_mean(rope, rope.apply(pre, pos), pos)
    torch.testing.assert_close(got, pre[:, :, [0, 1, 4]].mean(2, keepdim=True), rtol=1e-5, atol=1e-5)
    assert torch.equal(key_mean(rope, torch.full((1, 1, 3, 32), float("nan")), pos[:3]), torch.zeros(1, 1, 1, 32))


def _later_key_errors(kind: str, outliers, seed: int) -> torch.Tensor:
    """Relative reconstruction errors ||k_hat - k|| / ||k|| of keys quantized after the mean was taken, in a centred
    cache whose first 48 tokens hold the keys at `outliers` scaled up."""
    cfg = tiny_llama_config()
    kw = dict(key_bits=3, value_bits=3, residual_length=8, sink_tokens=2, key_centering=True)
    first, later = 48, 40
    k, _ = _centred_keys(seed, first + later, outliers)
    v = torch.randn(1, 2, first + later, 32, generator=torch.Generator().manual_seed(seed + 1))
    if kind == "dynamic":
        cache = TurboQuantCache(config=cfg, **kw)
        cache.update(k[:, :, :first], v[:, :, :first], 0)
        cache.update(k[:, :, first:], v[:, :, first:], 0)
        got, stop = cache.layers[0].keys.float(), first + later - kw["residual_length"]
    else:
        cache = TurboQuantStaticCache(config=cfg, max_cache_len=first + later, **kw)
        cache.update(k[:, :, :first], v[:, :, :first], 0)
        cache.update(k[:, :, first:], v[:, :, first:], 0)
        got, stop = _dense(cache.layers[0])[0].float(), first + later - cache.layers[0].window_size
    want = k[:, :, first:stop]
    return ((got[:, :, first:stop] - want).norm(dim=-1) / want.norm(dim=-1)).flatten()


@static_only
@pytest.mark.parametrize("kind", ["dynamic", "static"])
@pytest.mark.parametrize("count", [1, 3])
def test_huge_keys_in_the_mean_block_leave_later_keys_as_accurate(kind, count):
    """One or a few huge keys (300x) past the sinks, in the block the mean is taken from: the keys quantized later
    are reconstructed about as well as without them (a plain mean made their errors tens of times larger)."""
    for _ in range(3):
        seed = _seed()
        g = torch.Generator().manual_seed(seed)
        outliers = (2 + torch.randperm(38, generator=g)[:count]).tolist()  # past the 2 sinks, in both caches' block
        clean = _later_key_errors(kind, (), seed)
        dirty = _later_key_errors(kind, outliers, seed)
        assert float(dirty.max()) < 1.5 * float(clean.max()) + 0.02, (
            f"{kind}, outliers at {outliers} (seed {seed}): worst later-key error {float(dirty.max()):.3f} against "
            f"{float(clean.max()):.3f} without them")


@static_only
def test_both_caches_take_the_same_robust_mean():
    seed = _seed()
    k, pre = _centred_keys(seed, 48, outliers=(5, 17))
    v = torch.randn_like(k)
    cfg = tiny_llama_config()
    kw = dict(key_bits=4, value_bits=4, residual_length=0, sink_tokens=2, key_centering=True)
    dyn = TurboQuantCache(config=cfg, **kw)
    dyn.update(k, v, 0)
    st = TurboQuantStaticCache(config=cfg, max_cache_len=64, **kw)
    st.update(k, v, 0)
    want = reference.key_mean(pre[:, :, 2:], OUTLIER_NORM_RATIO)
    for name, mu in (("dynamic", dyn.layers[0].kv._mu), ("static", st.layers[0].packed.key_offset.mu)):
        torch.testing.assert_close(mu, want, rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"{n} (seed {seed}): {m}")
