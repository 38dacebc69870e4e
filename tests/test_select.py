"""`kernels.select`: which kernel serves a decode step, for each reason it picks one (device, shapes and widths the
CUDA kernel does not take, split keys, the environment knob and its former names), one warning per reason, the
workspace path's reasons, and its answer under torch.compile. A CUDA device is faked where the machine has none:
`_cuda_ready` (the machine's answer) is patched, the shape rules are the real ones."""

import logging
import os
import warnings

import pytest
import torch

import tq_hf_cache
from tq_hf_cache import ops, reference
from tq_hf_cache.kernels import cpu, select, support

from test_decode_attention import make_query, make_state

CUDA0 = torch.device("cuda", 0)
OLD = ("TQ_FUSED_BACKEND", "TQ_HF_CACHE_FAST_DECODE")


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    """No knob set, nothing warned yet, no device judged yet."""
    for name in (select.ENV, *OLD):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(select, "_WARNED", set())
    monkeypatch.setattr(select, "_CUDA_BROKEN", {})
    monkeypatch.setattr(select, "_CUDA_READY", set())


@pytest.fixture
def gpu(monkeypatch):
    """A device the CUDA kernel runs on (faked where there is none); Triton importable."""
    if not support._triton_ok():
        pytest.skip("no triton")
    monkeypatch.setattr(select, "_cuda_ready", lambda device: True)


def kernel(device=CUDA0, d=128, kb=4, vb=4, group=4, n=1, split=None, slots=4096, static=False):
    return select.kernel(device, d, kb, vb, group, n, split, slots, static)


# ------------------------------------------------------------------------------------------------ by device

def test_a_gpu_takes_the_cuda_kernel_with_the_triton_kernel_behind_it(gpu):
    c = kernel()
    assert (c.kernel, c.chunk, c.fallback) == ("cuda", 0, "triton") and c.fused


def test_a_cpu_takes_the_c_kernels_where_they_build(monkeypatch):
    monkeypatch.setattr(select, "_cpu_builds", lambda: True)
    assert kernel(torch.device("cpu")).kernel == "cpu"
    monkeypatch.setattr(select, "_cpu_builds", lambda: False)
    assert kernel(torch.device("cpu")).kernel == "torch"


def test_a_gpu_without_the_cuda_kernel_takes_the_triton_kernel(monkeypatch):
    if not support._triton_ok():
        pytest.skip("no triton")
    monkeypatch.setattr(select, "_cuda_ready", lambda device: False)
    assert kernel().kernel == "triton"


def test_other_devices_take_the_torch_math():
    assert kernel(torch.device("meta")).kernel == "torch"


# ------------------------------------------------------------------------------------------------ by shape

def test_widths_the_cuda_kernel_does_not_take_go_to_triton(gpu):
    assert kernel(kb=8, vb=8).kernel == "triton"  # (2-5 bits only)
    assert kernel(kb=5, vb=6).kernel == "triton"
    assert kernel(slots=8).kernel == "triton"  # fewer than 16 packed slots


def test_split_keys_go_to_triton_or_the_torch_math(gpu):
    assert kernel(split=((64, 32, 32), (5, 4, 2))).kernel == "triton"
    assert kernel(d=64, split=((24, 40), (3, 3))).kernel == "torch"  # whole 4-byte words per row: not these


def test_head_dim_256_at_byte_widths_is_the_cuda_kernels_alone(gpu):
    c = kernel(d=256, kb=4, vb=4)
    assert (c.kernel, c.fallback) == ("cuda", "torch")  # (the Triton kernel does not take it)
    c = kernel(d=256, kb=4, vb=4, group=4, n=4)  # 16 rows, over the 8 it holds at 256: 2 queries a launch
    assert (c.kernel, c.chunk, c.fallback) == ("cuda", 2, "torch")


def test_more_query_rows_than_the_cuda_kernel_holds_go_in_chunks(gpu):
    c = kernel(group=4, n=7)
    assert (c.kernel, c.chunk) == ("cuda", 4)
    assert kernel(group=4, n=7, static=True).kernel == "triton"  # (a static layer's steps are one launch)
    assert kernel(group=32, n=2).kernel == "triton"  # not one query fits


def test_the_workspace_path_and_its_reasons(gpu, caplog):
    def step(**kw):
        args = dict(device=CUDA0, head_dim=128, key_bits=4, value_bits=4, group=4, n=1, slots=4096, key_rows=10**6)
        return select.step(**{**args, **kw})

    assert step().kernel == "cuda"
    assert step(fused=False).kernel == select.WORKSPACE  # TurboQuantCache(fused_sdpa=False)
    assert step(group=16, n=16).kernel == select.WORKSPACE  # more rows than a tile
    # head dim 256 over a short history on CUDA: the Triton kernel's fixed cost does not pay (k5v3: CUDA takes it)
    assert step(head_dim=256, key_bits=1, value_bits=7, key_rows=100).kernel == select.WORKSPACE
    assert step(head_dim=256, key_bits=5, value_bits=3, key_rows=100).kernel == "cuda"
    with caplog.at_level(logging.WARNING):
        assert step(head_dim=96, quiet=True).kernel == select.WORKSPACE
        assert "no fused decode attention" not in caplog.text
        for _ in range(3):
            assert step(head_dim=96).kernel == select.WORKSPACE
    assert caplog.text.count("no fused decode attention for head dim 96 with k4v4") == 1


def test_on_a_cpu_the_fused_path_always_pays(monkeypatch):
    monkeypatch.setattr(select, "_cpu_builds", lambda: True)
    c = select.step("cpu", 256, 5, 3, 4, 1, slots=4096, key_rows=1)
    assert c.kernel == "cpu"


# ------------------------------------------------------------------------------------------------ the knob

@pytest.mark.parametrize("value,on_gpu,on_cpu", [
    ("auto", "cuda", "cpu"), ("", "cuda", "cpu"), ("cuda", "cuda", "torch"), ("triton", "triton", None),
    ("cpu", "torch", "cpu"), ("torch", "torch", "torch"), (" Torch ", "torch", "torch")])
def test_the_knob(value, on_gpu, on_cpu, gpu, monkeypatch):
    monkeypatch.setattr(select, "_cpu_builds", lambda: True)
    monkeypatch.setenv(select.ENV, value)
    assert kernel().kernel == on_gpu
    want = on_cpu or ("triton" if support.interpreting() else "torch")
    assert kernel(torch.device("cpu")).kernel == want


def test_the_knob_names_a_kernel_that_does_not_take_the_shape_the_torch_math_serves(gpu, monkeypatch):
    monkeypatch.setenv(select.ENV, "cuda")
    assert kernel(kb=8, vb=8).kernel == "torch"
    monkeypatch.setenv(select.ENV, "triton")
    assert kernel(d=256, kb=4, vb=4).kernel == "torch"


def test_a_bad_knob_value_names_the_allowed_ones(monkeypatch):
    monkeypatch.setenv(select.ENV, "fast")
    with pytest.raises(ValueError, match=r"TQ_HF_CACHE_DECODE_KERNEL='fast': expected one of auto, cuda, triton, cpu, "
                                         r"torch"):
        kernel()


@pytest.mark.parametrize("name,value,want", [
    ("TQ_FUSED_BACKEND", "torch", "torch"), ("TQ_FUSED_BACKEND", "triton", "triton"),
    ("TQ_FUSED_BACKEND", "auto", "cuda"), ("TQ_HF_CACHE_FAST_DECODE", "0", "triton"),
    ("TQ_HF_CACHE_FAST_DECODE", "1", "cuda")])
def test_the_former_knobs_still_work_with_one_warning(name, value, want, gpu, monkeypatch):
    monkeypatch.setenv(name, value)
    with pytest.warns(FutureWarning, match=f"{name} is deprecated; set TQ_HF_CACHE_DECODE_KERNEL="):
        assert kernel().kernel == want
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernel().kernel == want  # once a process
    monkeypatch.setenv(select.ENV, "torch")  # the new knob wins
    assert kernel().kernel == "torch"


def test_a_bad_former_knob_value_names_the_new_knob(monkeypatch):
    monkeypatch.setenv("TQ_FUSED_BACKEND", "fast")
    with pytest.raises(ValueError, match=r"TQ_FUSED_BACKEND='fast' \(deprecated: use TQ_HF_CACHE_DECODE_KERNEL\)"):
        kernel()


# ------------------------------------------------------------------------------------------------ warnings

def test_an_old_gpu_is_warned_about_once(monkeypatch):
    if not support._triton_ok():
        pytest.skip("no triton")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (7, 5))
    with pytest.warns(RuntimeWarning, match=r"CUDA decode kernel unavailable \(it needs a GPU of compute capability"):
        assert kernel().kernel == "triton"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernel().kernel == "triton"
        assert kernel(torch.device("cuda", 1)).kernel == "triton"  # another device, the same reason: no warning


def test_a_failed_build_turns_the_cuda_kernel_off_with_one_warning(gpu, monkeypatch):
    """The CUDA launcher raising JitError: ops warns once, the device is off for the process, and the call's fallback
    serves (here on a CPU state: the torch math, against the oracle)."""
    from tq_hf_cache.kernels import cuda

    calls = []

    def broken(*a, **k):
        calls.append(1)
        raise cuda.jit.JitError("no cubin\nsecond line")

    monkeypatch.setattr(cuda, "decode_attention", broken)
    state, _, _ = make_state(1, 2, 40, 3, 1, 64, 4, 4, torch.float32, 5, device="cpu")
    q = make_query(1, 4, 1, 64, torch.float32, 5).cpu()  # (beside the CPU state, on any machine)
    choice = select.Choice("cuda", fallback="torch")
    with pytest.warns(RuntimeWarning, match=r"CUDA decode kernel unavailable \(no cubin\)"):
        out = ops.decode_attention(q, state, None, None, choice)
    torch.testing.assert_close(out, reference.packed_attention(q, state, None, None))
    assert select._CUDA_BROKEN == {0: "no cubin"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ops.decode_attention(q, state, None, None, choice)
    assert calls == [1, 1]


def test_a_launcher_that_declines_leaves_the_call_to_its_fallback(monkeypatch):
    from tq_hf_cache.kernels import cuda

    monkeypatch.setattr(cuda, "decode_attention", lambda *a, **k: None)
    state, _, _ = make_state(1, 2, 40, 3, 1, 64, 4, 4, torch.float32, 6, device="cpu")
    q = make_query(1, 4, 1, 64, torch.float32, 6).cpu()  # (beside the CPU state, on any machine)
    out = torch.full((1, 1, 4, 64), float("nan"))
    got = ops.decode_attention(q, state, None, None, select.Choice("cuda", fallback="torch"), out=out)
    assert got is out
    torch.testing.assert_close(out, reference.packed_attention(q, state, None, None))


def test_c_kernels_that_do_not_build_are_warned_about_once(monkeypatch):
    def fail():
        raise cpu.JitError("no C compiler: 'nope'")

    monkeypatch.setattr(cpu, "library", fail)
    with pytest.warns(RuntimeWarning, match="decodes on the CPU with the torch math.*no C compiler: 'nope'"):
        assert kernel(torch.device("cpu")).kernel == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernel(torch.device("cpu")).kernel == "torch"


# ------------------------------------------------------------------------------------------------ compile, floor

def test_the_answer_is_a_constant_of_a_compiled_step_with_symbolic_sizes():
    def f(x):
        c = select.step(x.device, 128, 4, 4, 4, x.shape[1], slots=x.shape[0], key_rows=4 * x.shape[0])
        return x + 1 if c.fused else x * 2

    step = torch.compile(f, dynamic=True, fullgraph=True, backend="eager")
    for shape in ((20, 3), (33, 2), (40, 200)):
        want = f(torch.ones(shape))
        torch.testing.assert_close(step(torch.ones(shape)), want)


def test_only_the_selector_reads_the_knobs():
    """The one place: no other module of the package names the knobs or asks the CUDA kernel's machine check."""
    root = os.path.dirname(tq_hf_cache.__file__)
    found = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                text = open(os.path.join(dirpath, f)).read()
                for word in (select.ENV, *OLD, "machine_ok", "fast_serves"):
                    if word in text:
                        found.setdefault(word, set()).add(os.path.relpath(os.path.join(dirpath, f), root))
    assert found == {select.ENV: {"kernels/select.py"}, **{name: {"kernels/select.py"} for name in OLD}}, found
