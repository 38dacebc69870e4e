"""A cache's life outside one forward: pickled, deep-copied or saved with torch.save and used in another process,
deleted (everything it made is released), cropped all or nothing, and offloading refused where it cannot work."""

import copy
import gc
import io
import os
import pickle
import subprocess
import sys
import weakref

import pytest
import torch

from conftest import static_logits, tiny_gemma3_config, tiny_llama_config, with_cache
from tq_hf_cache import TurboQuantCache, ops
from tq_hf_cache._compat import IS_V5

pytestmark = pytest.mark.skipif(not IS_V5, reason="TurboQuantStaticCache needs transformers >= 5")

PROMPT, STEPS, CAP = 40, 4, 64
# (name, config builder, TurboQuantConfig overrides): plain keys, split keys, centred keys
KINDS = [
    ("plain", "llama", dict(residual_length=8)),
    ("split", "llama", dict(residual_length=8, key_split={0: {"sizes": [16, 16], "bits": [6, 3],
                                                              "order": [list(range(31, -1, -1))] * 2}})),
    ("centred", "gemma3", dict(residual_length=8, key_centering=True)),
]


def _model(family: str, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    if family == "llama":
        model = transformers.LlamaForCausalLM(tiny_llama_config()).eval()
    else:
        cfg = tiny_gemma3_config(num_hidden_layers=2, layer_types=["full_attention", "sliding_attention"])
        model = transformers.Gemma3ForCausalLM(cfg).eval()
    model.set_attn_implementation("turboquant")  # before any cache: a pickled cache keeps its config's setting
    return model


def _static(model, overrides, seed_offset: int = 0):
    from tq_hf_cache import TurboQuantStaticCache

    return TurboQuantStaticCache(config=model.config, max_cache_len=CAP, seed=overrides.get("seed", 0) + seed_offset,
                                 **{k: v for k, v in overrides.items() if k != "seed"})


def _ids(seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (1, PROMPT + STEPS), generator=g)


@pytest.mark.parametrize("name, family, overrides", KINDS, ids=[k[0] for k in KINDS])
@pytest.mark.parametrize("how", ["pickle", "deepcopy", "torch.save"])
def test_a_copied_static_cache_continues_exactly_in_a_process_with_other_caches(name, family, overrides, how):
    """The copy decodes the saved cache's logits although another static cache (another seed: other quantizers,
    registered first) lives in the process; a copy must name its own quantizers, not the ids it was made with."""
    model = _model(family)
    ids = _ids()
    other = _static(model, overrides, seed_offset=7)  # registered before the copy is made
    static_logits(model, other, ids, PROMPT, "turboquant")
    cache = _static(model, overrides)
    with torch.no_grad():
        model(ids[:, :PROMPT], **with_cache(cache))
    if how == "pickle":
        clone = pickle.loads(pickle.dumps(cache))
    elif how == "deepcopy":
        clone = copy.deepcopy(cache)
    else:
        buf = io.BytesIO()
        torch.save(cache, buf)
        buf.seek(0)
        clone = torch.load(buf, weights_only=False)
    del cache
    gc.collect()
    third = _static(model, overrides, seed_offset=3)  # made after: ids of the copy must stay its own
    static_logits(model, third, ids, PROMPT, "turboquant")
    want = static_logits(model, _prefilled(model, overrides, ids), ids, PROMPT, "turboquant", prefilled=True)
    got = static_logits(model, clone, ids, PROMPT, "turboquant", prefilled=True)
    torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{name} / {how}: logits after the copy")


def _prefilled(model, overrides, ids):
    cache = _static(model, overrides)
    with torch.no_grad():
        model(ids[:, :PROMPT], **with_cache(cache))
    return cache


def _make(model, overrides, kind: str, seed_offset: int = 0):
    if kind == "static":
        return _static(model, overrides, seed_offset)
    return TurboQuantCache(config=model.config, seed=seed_offset, **overrides)


def _continue(model, cache, ids) -> torch.Tensor:
    """Logits of ids[:, PROMPT:] one token at a time through a cache holding ids[:, :PROMPT]."""
    if type(cache).__name__ == "TurboQuantStaticCache":
        return static_logits(model, cache, ids, PROMPT, "turboquant", prefilled=True)
    with torch.no_grad():
        return torch.cat([model(ids[:, t : t + 1], **with_cache(cache)).logits for t in range(PROMPT, ids.shape[1])], 1)


_CASES = [(name, kind, how) for name, _, _ in KINDS for kind in ("static", "dynamic") for how in ("pickle", "torch")]

_CHILD = r"""
import pickle, sys, torch
sys.path.insert(0, {tests!r})
from test_cache_lifecycle import KINDS, _CASES, PROMPT, _continue, _make, _model, _ids
ids = _ids()
for i, (name, kind, how) in enumerate(_CASES):
    _, family, overrides = next(k for k in KINDS if k[0] == name)
    model = _model(family)
    _continue(model, _make(model, overrides, kind, seed_offset=11), ids)  # this process's own ids first
    with open({folder!r} + f"/{{i}}.bin", "rb") as f:
        cache = pickle.load(f) if how == "pickle" else torch.load(f, weights_only=False)
    torch.save(_continue(model, cache, ids), {folder!r} + f"/{{i}}.out")
"""


def test_copied_caches_continue_exactly_in_a_fresh_process(tmp_path):
    """Each cache kind (static and dynamic; plain, split and centred keys), pickled or torch.save'd, continues with
    the saved cache's exact logits in a new interpreter that has built caches of other quantizers first."""
    ids, want = _ids(), []
    for i, (name, kind, how) in enumerate(_CASES):
        _, family, overrides = next(k for k in KINDS if k[0] == name)
        model = _model(family)
        cache = _make(model, overrides, kind)
        with torch.no_grad():
            model(ids[:, :PROMPT], **with_cache(cache))
        with open(tmp_path / f"{i}.bin", "wb") as f:
            pickle.dump(cache, f) if how == "pickle" else torch.save(cache, f)
        want.append(_continue(model, cache, ids))
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    code = _CHILD.format(tests=tests, folder=str(tmp_path))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    for i, case in enumerate(_CASES):
        torch.testing.assert_close(torch.load(tmp_path / f"{i}.out"), want[i], rtol=0, atol=0,
                                   msg=f"{case}: logits in a fresh process")


def test_the_dynamic_cache_round_trips_through_pickle():
    model = _model("llama")
    ids = _ids()
    cache = TurboQuantCache(config=model.config, residual_length=8)
    with torch.no_grad():
        model(ids[:, :PROMPT], **with_cache(cache))
        clone = pickle.loads(pickle.dumps(cache))
        want = model(ids[:, PROMPT:], **with_cache(cache)).logits
        got = model(ids[:, PROMPT:], **with_cache(clone)).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("name, family, overrides", KINDS, ids=[k[0] for k in KINDS])
def test_deleting_a_static_cache_releases_what_it_registered(name, family, overrides):
    """Ids hold their objects weakly: after `del cache` its key split, RoPE angles, codebooks and buffers are freed
    and the registry is back to its size before the caches."""
    model = _model(family)
    ids = _ids()
    gc.collect()
    before = getattr(ops, "live_ids", lambda: {"q": len(ops._QUANTIZERS), "o": len(ops._OBJECTS)})()
    refs = []
    for _ in range(5):
        cache = _static(model, overrides)
        static_logits(model, cache, ids[:, : PROMPT + 1], PROMPT, "turboquant")
        layer = next(layer for layer in cache.layers if type(layer).__name__ == "TurboQuantStaticLayer")
        # (the rotation is shared by every cache of its dim and seed: made once per process, not per cache)
        refs += [weakref.ref(o) for o in (cache, layer, layer.keys, layer.kv.k_codebook, layer.kv.v_codebook)]
        refs += [weakref.ref(o) for o in (layer.key_split, layer.rope) if o is not None]
        during = getattr(ops, "live_ids", lambda: {"q": len(ops._QUANTIZERS), "o": len(ops._OBJECTS)})()
        assert during["quantizers"] > before["quantizers"] or before["quantizers"] > 0
        del cache, layer
    gc.collect()
    alive = [r() for r in refs if r() is not None]
    assert not alive, f"{name}: still alive after del: {[type(o).__name__ for o in alive]}"
    assert getattr(ops, "live_ids", lambda: {"q": len(ops._QUANTIZERS), "o": len(ops._OBJECTS)})() == before, f"{name}: registry entries left behind: {ops.live_ids()} vs {before}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name, family, overrides", KINDS, ids=[k[0] for k in KINDS])
def test_deleting_a_static_cache_frees_its_gpu_memory(name, family, overrides):
    model = _model(family).cuda()
    ids = _ids().cuda()
    warm = _static(model, overrides)
    static_logits(model, warm, ids, PROMPT, "turboquant")
    del warm
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(20):
        cache = _static(model, overrides)
        static_logits(model, cache, ids, PROMPT, "turboquant")
        del cache
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= before, f"{name}: {torch.cuda.memory_allocated() - before} bytes kept"


def test_an_id_of_a_deleted_cache_is_refused_by_name():
    model = _model("llama")
    cache = _static(model, {})
    static_logits(model, cache, _ids()[:, : PROMPT + 1], PROMPT, "turboquant")
    split = _static(model, KINDS[1][2])
    static_logits(model, split, _ids()[:, : PROMPT + 1], PROMPT, "turboquant")
    oid = split.layers[0].keys.turboquant_packed.key_split
    assert ops.object_of(oid) is split.layers[0].key_split
    del split
    gc.collect()
    with pytest.raises(ValueError, match=f"unknown object id {oid}"):
        ops.object_of(oid)


def _qwen2_full_then_sliding():
    import transformers

    cfg = transformers.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                                   sliding_window=16, max_window_layers=1,
                                   layer_types=["full_attention", "sliding_attention"])
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(cfg).eval()


@pytest.mark.parametrize("kind", ["dynamic", "static"])
@pytest.mark.parametrize("amount", [30, -5])
def test_a_crop_that_one_layer_refuses_changes_no_layer(kind, amount):
    """A full-attention layer before a sliding one past its window: DynamicCache / StaticCache refuse a positive
    crop at their first layer; ours must refuse before cutting any layer, for every amount a layer refuses."""
    from tq_hf_cache import TurboQuantStaticCache

    model = _qwen2_full_then_sliding()
    cache = (TurboQuantCache(config=model.config, residual_length=8) if kind == "dynamic"
             else TurboQuantStaticCache(config=model.config, max_cache_len=CAP, residual_length=8))
    with torch.no_grad():
        model(torch.randint(3, 128, (1, 40)), **with_cache(cache))
    before = [int(layer.get_seq_length()) for layer in cache.layers]
    from transformers.cache_utils import StaticSlidingWindowLayer

    # static layers take a negative crop where transformers' static sliding layer has one (5.24, not 5.17)
    if kind == "static" and amount < 0 and hasattr(StaticSlidingWindowLayer, "crop"):
        cache.crop(amount)
        assert [int(layer.get_seq_length()) for layer in cache.layers] == [b + amount for b in before]
        return
    with pytest.raises((RuntimeError, ValueError), match="no layer was cropped"):
        cache.crop(amount)
    assert [int(layer.get_seq_length()) for layer in cache.layers] == before


def test_a_crop_every_layer_takes_is_applied_to_every_layer():
    model = _qwen2_full_then_sliding()
    cache = TurboQuantCache(config=model.config, residual_length=8)
    with torch.no_grad():
        model(torch.randint(3, 128, (1, 12)), **with_cache(cache))  # inside the window: any crop is exact
    cache.crop(-3)
    assert [int(layer.get_seq_length()) for layer in cache.layers] == [9, 9]


def test_static_offloading_is_refused_up_front():
    from tq_hf_cache import TurboQuantStaticCache

    model = _model("llama")
    with pytest.raises(ValueError, match="does not offload"):
        TurboQuantStaticCache(config=model.config, max_cache_len=CAP, offloading=True)
