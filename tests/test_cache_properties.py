"""Random sequences of cache operations on TurboQuantCache and on DynamicCache side by side, compared at every step.

With nothing quantized (the residual window longer than anything stored) every step must match exactly; with 8-bit
quantization, lengths and shapes must match exactly and values within the 8-bit error. Hypothesis prints the
failing operation sequence (and the seed to replay it) on failure.

Left out on purpose: a positive `crop(n)`, which transformers 5.x refuses and TurboQuantCache reads as 4.x's "keep
the first n tokens", and on 4.x a reset (which zeroes DynamicCache's tensors and keeps their length) and a crop
of more tokens than are held (which wraps around there); batch operations on a cache that holds no token, where DynamicCache keeps its old batch size; a crop of a sliding
layer before its first update, where DynamicSlidingWindowLayer raises an AttributeError; removing tokens a full
window layer cannot give back (dropped before recording began), which TurboQuantSlidingLayer refuses while
transformers' layer slices what it has and counts on as if its window were whole.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer

from tq_hf_cache import TurboQuantCache, TurboQuantSlidingLayer
from tq_hf_cache._compat import IS_V5

HEADS, DIM, LAYERS = 2, 32, 2
SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True)

op = st.one_of(
    st.tuples(st.just("update"), st.integers(1, 9)),
    st.tuples(st.just("crop"), st.integers(0, 12)),
    st.tuples(st.just("reorder"), st.lists(st.integers(0, 3), min_size=4, max_size=4)),
    st.tuples(st.just("select"), st.lists(st.integers(0, 3), min_size=1, max_size=3, unique=True)),
    st.tuples(st.just("repeat"), st.integers(1, 2)),
    *([st.tuples(st.just("reset"), st.none())] if IS_V5 else []),  # 4.x DynamicCache.reset zeroes, keeps the length
)


def _close(a, b, exact, what):
    if a is None or b is None:
        assert a is None and b is None, what
        return
    assert a.shape == b.shape, f"{what}: {tuple(a.shape)} != {tuple(b.shape)}"
    if exact:
        assert torch.equal(a, b), what
    elif b.numel():
        err = ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-6)).item()
        assert err < 0.02, f"{what}: relative error {err:.4f}"


def _run(ops, tq, exact):
    dyn = DynamicCache()
    g = torch.Generator().manual_seed(0)
    batch = 2
    for step, (name, arg) in enumerate(ops):
        what = f"step {step} {name}({arg})"
        seq = dyn.get_seq_length()
        if name == "update":
            for layer in range(LAYERS):
                k = torch.randn(batch, HEADS, arg, DIM, generator=g)
                v = torch.randn(batch, HEADS, arg, DIM, generator=g)
                a, b = tq.update(k, v, layer), dyn.update(k, v, layer)
                _close(a[0], b[0], exact, f"{what}: returned keys of layer {layer}")
                _close(a[1], b[1], exact, f"{what}: returned values of layer {layer}")
        elif name == "crop":
            if not IS_V5 and arg > seq:
                continue  # 4.x DynamicCache.crop(-n) past the start wraps around: crop(-3) of 2 tokens keeps 1
            tq.crop(-arg)
            dyn.crop(-arg)
        elif name == "reset":
            tq.reset()
            dyn.reset()
            batch = 1 + step % 3  # a new sequence may come with another batch size
        elif seq == 0:
            continue
        elif name == "reorder":
            idx = torch.tensor([i % batch for i in arg][:batch])
            tq.reorder_cache(idx)
            dyn.reorder_cache(idx)
        elif name == "select":
            idx = torch.tensor(sorted({i % batch for i in arg}))
            tq.batch_select_indices(idx)
            dyn.batch_select_indices(idx)
            batch = len(idx)
        elif name == "repeat" and batch * arg <= 4:
            tq.batch_repeat_interleave(arg)
            dyn.batch_repeat_interleave(arg)
            batch *= arg
        assert tq.get_seq_length() == dyn.get_seq_length(), what
        for i, (x, y) in enumerate(zip(tq.layers, dyn.layers)):
            _close(x.keys, y.keys, exact, f"{what}: keys of layer {i}")
            _close(x.values, y.values, exact, f"{what}: values of layer {i}")


@SETTINGS
@given(ops=st.lists(op, min_size=1, max_size=25))
def test_random_operations_match_dynamic_cache_exactly_when_nothing_is_quantized(ops):
    _run(ops, TurboQuantCache(residual_length=10_000), exact=True)


@SETTINGS
@given(ops=st.lists(op, min_size=1, max_size=25), residual=st.integers(0, 6))
def test_random_operations_match_dynamic_cache_within_8_bit_error(ops, residual):
    _run(ops, TurboQuantCache(key_bits=8, value_bits=8, residual_length=residual), exact=False)


sliding_op = st.one_of(
    st.tuples(st.just("update"), st.integers(1, 9)),
    st.tuples(st.just("crop"), st.integers(0, 10)),
    st.tuples(st.just("record"), st.none()),
)


@pytest.mark.skipif(not IS_V5, reason="past recording (assisted decoding's rollback) is transformers 5.x")
@SETTINGS
@given(ops=st.lists(sliding_op, min_size=1, max_size=25), window=st.integers(2, 9), residual=st.sampled_from([2, 100]))
def test_random_operations_on_a_sliding_layer_match_dynamic_sliding_window_layer(ops, window, residual):
    exact = residual >= 100
    tq = TurboQuantCache(key_bits=8, value_bits=8, residual_length=residual)
    layer = tq._tq_layer(TurboQuantSlidingLayer, 0, (8, 8), sliding_window=window)
    ref = DynamicSlidingWindowLayer(sliding_window=window)
    g = torch.Generator().manual_seed(1)
    for step, (name, arg) in enumerate(ops):
        what = f"step {step} {name}({arg})"
        if name == "update":
            k, v = torch.randn(1, HEADS, arg, DIM, generator=g), torch.randn(1, HEADS, arg, DIM, generator=g)
            a, b = layer.update(k, v), ref.update(k, v)
            _close(a[0], b[0], exact, f"{what}: returned keys")
            _close(a[1], b[1], exact, f"{what}: returned values")
            assert layer.get_mask_sizes(1) == ref.get_mask_sizes(1), what
        elif name == "record":
            layer.activate_past_recording()
            ref.activate_past_recording()
        elif ref.is_initialized:  # transformers' layer fails on a crop before its first update (AttributeError)
            held, after = ref.keys.shape[-2], ref.get_seq_length() - arg
            if ref.record_past and ref.get_seq_length() >= window and (arg > held or held - arg < min(after, window - 1)):
                # past what the layer can give back: transformers slices and counts on as if the window were whole
                with pytest.raises(RuntimeError, match="cannot remove"):
                    layer.crop(-arg)
                continue
            errors = []
            for x in (layer, ref):
                try:
                    x.crop(-arg)
                    errors.append(None)
                except (RuntimeError, ValueError):
                    errors.append("refused")
            assert errors[0] == errors[1], f"{what}: TurboQuant raised {errors[0]}, transformers {errors[1]}"
        assert layer.get_seq_length() == ref.get_seq_length(), what
        if ref.is_initialized:
            _close(layer.keys, ref.keys, exact, f"{what}: keys")
            _close(layer.values, ref.values, exact, f"{what}: values")
