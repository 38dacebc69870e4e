"""Every `generate` mode against DynamicCache, the oracle of behaviour.

With `residual_length` longer than the whole sequence nothing is quantized, so TurboQuantCache must give the very
tokens and scores of DynamicCache (bit for bit) in every decoding strategy, on full-attention, sliding-window and
hybrid (linear attention + attention) models. With 8-bit quantization on, the same modes must run and stay within
the tolerance of the 8-bit logit tests.

The sliding-window rows run twice: as `TurboQuantCache(config=...)` builds them (a window inside the residual window
stays a transformers layer) and with the window layers forced to `TurboQuantSlidingLayer`, so that its own window,
crop and past-recording logic is held to the oracle too.
"""

import pytest
import torch
import transformers
from transformers import DynamicCache

from tq_hf_cache import TurboQuantCache, TurboQuantSlidingLayer
from tq_hf_cache._compat import IS_V5, layer_types_and_kwargs
from conftest import with_cache

VOCAB = 96
BASE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
EXACT = dict(residual_length=10_000)  # nothing is ever quantized
QUANTIZED = dict(key_bits=8, value_bits=8, residual_length=4)
NEW = 14


def _build(cfg_name, model_name, seed=0, **kw):
    cfg_cls, model_cls = getattr(transformers, cfg_name, None), getattr(transformers, model_name, None)
    if cfg_cls is None or model_cls is None:
        pytest.skip(f"{cfg_name} is not in transformers {transformers.__version__}")
    cfg = cfg_cls(**{**BASE, **kw})
    torch.manual_seed(seed)
    return cfg, model_cls(cfg).eval()


def llama(seed=0, layers=2):
    return _build("LlamaConfig", "LlamaForCausalLM", seed, num_hidden_layers=layers)


def gemma3(seed=0):
    return _build(
        "Gemma3TextConfig", "Gemma3ForCausalLM", seed, num_hidden_layers=4, sliding_window=8, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention"] * 2,
    )


def qwen3_next(seed=0):
    if not IS_V5:
        pytest.skip("linear-attention cache layers exist in transformers 5.x only")
    return _build(
        "Qwen3NextConfig", "Qwen3NextForCausalLM", seed, num_hidden_layers=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, linear_num_value_heads=2,
        linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, full_attention_interval=2,
    )


def falcon_h1(seed=0):
    if not IS_V5:
        pytest.skip("hybrid cache layers exist in transformers 5.x only")
    return _build(
        "FalconH1Config", "FalconH1ForCausalLM", seed, num_hidden_layers=2, mamba_d_ssm=32, mamba_n_heads=4,
        mamba_d_head=8, mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=16,
    )


MODELS = {"llama": llama, "gemma3": gemma3, "gemma3-tq-sliding": gemma3, "qwen3-next": qwen3_next, "falcon-h1": falcon_h1}


def make_cache(name, cfg, **kw):
    cache = TurboQuantCache(config=cfg, **kw)
    if name == "gemma3-tq-sliding":
        types, kwargs = layer_types_and_kwargs(cfg)
        bits = (cache.tq_config.key_bits, cache.tq_config.value_bits)
        for i, (t, k) in enumerate(zip(types, kwargs)):
            if t == "sliding_attention":
                cache.layers[i] = cache._tq_layer(TurboQuantSlidingLayer, i, bits, sliding_window=k["sliding_window"])
        assert any(isinstance(layer, TurboQuantSlidingLayer) for layer in cache.layers)
    return cache


def prompt(batch=1, length=12, seed=0):
    # repeated n-grams give prompt lookup candidates to accept and reject
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(3, VOCAB, (batch, 5), generator=g)
    return base.repeat(1, (length + 4) // 5)[:, :length]


def _assistant(cfg):
    """A separate draft model with the same vocabulary (assisted generation)."""
    _, model = llama(seed=7, layers=1)
    return model


# mode -> (generate kwargs, batch); each run is seeded, so sampling draws the same numbers for both caches
MODES = {
    "greedy": (dict(do_sample=False), 2),
    "sample_num_return_sequences": (dict(do_sample=True, num_return_sequences=3, temperature=0.9), 1),
    "top_p_min_p": (dict(do_sample=True, top_p=0.9, min_p=0.05, top_k=0), 2),
    "beam_search": (dict(num_beams=3, num_return_sequences=2, do_sample=False), 1),
    "beam_sample": (dict(num_beams=2, do_sample=True), 1),
    "assisted": (dict(do_sample=False, assistant=True), 1),
    "prompt_lookup": (dict(do_sample=False, prompt_lookup_num_tokens=3), 1),
    "scores": (dict(do_sample=False, return_dict_in_generate=True, output_scores=True, output_logits=True), 2),
    "left_padding": (dict(do_sample=False, left_pad=True), 2),
    "multi_turn": (dict(do_sample=False, multi_turn=True), 1),
}


def run(model, cfg, cache, mode, **extra):
    kw, batch = MODES[mode]
    kw = {**kw, **extra}
    x = prompt(batch)
    mask = torch.ones_like(x)
    if kw.pop("left_pad", False):
        x[0, :4] = 0
        mask[0, :4] = 0
    if kw.pop("assistant", False):
        kw["assistant_model"] = _assistant(cfg)
    multi_turn = kw.pop("multi_turn", False)
    torch.manual_seed(1234)
    common = dict(max_new_tokens=NEW, min_new_tokens=NEW, pad_token_id=0, **with_cache(cache))
    out = model.generate(x, attention_mask=mask, **common, **kw)
    if not multi_turn:
        return out
    # a second turn on the same cache: the first turn's text plus a user reply
    first = out.sequences if hasattr(out, "sequences") else out
    x2 = torch.cat([first, prompt(batch, 6, seed=3)], dim=1)
    return out, model.generate(x2, attention_mask=torch.ones_like(x2), **common, **kw)


def _tensors(out):
    """Every tensor of a generate result, flattened in a fixed order (sequences, scores, logits, turns)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, tuple):
        return [t for o in out for t in _tensors(o)]
    ts = [out.sequences]
    for name in ("scores", "logits"):
        if getattr(out, name, None) is not None:
            ts.extend(getattr(out, name))
    return ts


def _outcome(model, cfg, cache, mode, **extra):
    """The run's tensors, or the exception when the mode refuses this cache (then both must refuse alike)."""
    try:
        return _tensors(run(model, cfg, cache, mode, **extra))
    except (ValueError, RuntimeError, NotImplementedError) as e:
        return e


def _both_refuse(got, want, what):
    """True when both runs raised, after checking that they raised alike; fails when only one did."""
    if not isinstance(want, Exception) and not isinstance(got, Exception):
        return False
    assert isinstance(got, type(want)), f"{what}: DynamicCache gave {want!r}, TurboQuantCache gave {got!r}"
    return True


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("model_name", list(MODELS))
def test_bit_identical_to_dynamic_cache_when_nothing_is_quantized(model_name, mode):
    cfg, model = MODELS[model_name]()
    want = _outcome(model, cfg, DynamicCache(config=cfg), mode)
    got = _outcome(model, cfg, make_cache(model_name, cfg, **EXACT), mode)
    if _both_refuse(got, want, f"{model_name}/{mode}"):
        return
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape and torch.equal(a, b), f"{model_name}/{mode}: output tensor {i} differs"


# the 8-bit logit tolerance of tests/test_compat.py: relative error of a step's logits
TOL = {"llama": 0.03, "gemma3": 0.06, "gemma3-tq-sliding": 0.06, "qwen3-next": 0.05, "falcon-h1": 0.05}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("model_name", list(MODELS))
def test_quantized_modes_stay_within_the_8_bit_tolerance(model_name, mode):
    """Logits step by step against DynamicCache's, up to the first step at which a chosen token differs (after it
    the two runs condition on different text); the first generated token must agree."""
    cfg, model = MODELS[model_name]()
    extra = dict(return_dict_in_generate=True, output_logits=True)
    want = _outcome(model, cfg, DynamicCache(config=cfg), mode, **extra)
    cache = make_cache(model_name, cfg, **QUANTIZED)
    got = _outcome(model, cfg, cache, mode, **extra)
    if _both_refuse(got, want, f"{model_name}/{mode}"):
        return
    assert any(getattr(layer, "quantized_length", 0) > 0 for layer in cache.layers), "nothing was quantized"
    turns = len(got) // (1 + NEW + (NEW if mode == "scores" else 0))
    per_turn = len(got) // turns
    for turn in range(turns):
        g, w = got[turn * per_turn : (turn + 1) * per_turn], want[turn * per_turn : (turn + 1) * per_turn]
        assert g[0].shape == w[0].shape
        new_g, new_w = g[0][:, -NEW:], w[0][:, -NEW:]
        upto = int((new_g == new_w).all(dim=0).long().cumprod(0).sum())
        if mode.startswith("beam"):
            upto = 0  # logits are per live beam, and live beams may differ even where the returned ones agree
        assert upto >= 1 or mode.startswith("beam"), f"{model_name}/{mode}: the first generated token differs"
        for s in range(min(upto + 1, NEW)):
            a, b = g[-NEW + s], w[-NEW + s]
            err = ((a - b).norm() / b.norm()).item()
            assert err < TOL[model_name], f"{model_name}/{mode}: step {s} logits relative error {err:.4f}"
        if upto < NEW:
            break  # a later turn's prompt holds the diverged text
