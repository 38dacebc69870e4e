"""The CPU decode kernels (`kernels.cpu`: C compiled at first use) against the torch math (`reference`) on random
inputs: every width, odd lengths, strided and poisoned buffers, per-head codebooks, split keys, sinks and masks; the
build's disk cache and the fallback where no compiler works."""

import ctypes
import glob
import mmap
import os
import sys
import warnings
from dataclasses import replace

import pytest
import torch

from tq_hf_cache import ops, reference
from tq_hf_cache.quant.codebook import Codebook
from tq_hf_cache.kernels import cpu
from tq_hf_cache.kernels import select
from tq_hf_cache.kernels.cpu import jit
from tq_hf_cache.quant.packing import pack_indices

from test_static_attention import CASES as STATIC_CASES, SPLIT_CASES as STATIC_SPLIT_CASES
from test_static_attention import make_kv as make_static_kv
from test_decode_attention import (CASES, SPLIT_CASES, _case_id, codebook, fresh_seed, make_split_state, make_state,
                                   padding_mask, head_mask, rel_err)

needs_cc = pytest.mark.skipif(not cpu.available(), reason="no working C compiler")


def _per_head(cb: Codebook, heads: int, g: torch.Generator) -> Codebook:
    return Codebook.from_centroids(cb.centroids * (1 + 0.3 * torch.rand(heads, 1, generator=g)), cb.bits)


def _codes(g, b, h, t, d, bits, spare=3):
    """Random codes as live rows of a bigger buffer whose other rows are random bytes; the codes themselves."""
    idx = torch.randint(0, 2**bits, (b, h, t, d), generator=g)
    buf = torch.randint(0, 256, (b, h, t + 2 * spare, d * bits // 8), dtype=torch.uint8, generator=g)
    buf[:, :, spare: spare + t] = pack_indices(idx, bits)
    return buf[:, :, spare: spare + t], idx


def _centroids(cb: Codebook, idx: torch.Tensor) -> torch.Tensor:
    return reference.centroid_lookup(idx, cb)


@needs_cc
@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("d,tokens,per_head", [(64, 257, False), (128, 1, True), (8, 600, False), (24, 255, True),
                                               (256, 70, False)])
def test_scores_and_values_match_the_torch_math(bits, d, tokens, per_head):
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    b, h, rows = 2, 3, 5
    cb = codebook(bits, d)
    if per_head:
        cb = _per_head(cb, h, g)
    codes, idx = _codes(g, b, h, tokens, d, bits)
    c = _centroids(cb, idx)  # (B, H, T, D)
    norms = torch.rand(b, h, tokens, generator=g) + 0.5
    q = torch.randn(b, h, rows, d, generator=g)
    want = (q @ c.transpose(-1, -2)) * norms[:, :, None]
    out = torch.full((b, h, rows, tokens + 4), float("nan"))[..., 2: 2 + tokens]  # poisoned, strided
    cpu.packed_scores_into(out, codes, norms, q, cb)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"seed {seed}: scores: {m}")
    cpu.packed_scores_into(out, codes, norms, q, cb, accumulate=True)
    torch.testing.assert_close(out, 2 * want, rtol=1e-5, atol=1e-5, msg=lambda m: f"seed {seed}: accumulated: {m}")
    p = torch.softmax(torch.randn(b, h, rows, tokens + 1, generator=g), -1)[..., 1:]  # strided
    got = cpu.packed_values(p, codes, norms, cb, d)
    torch.testing.assert_close(got, (p * norms[:, :, None]) @ c, rtol=1e-5, atol=1e-6,
                               msg=lambda m: f"seed {seed}: values: {m}")


def _before_a_guard_page(nbytes: int):
    """A uint8 tensor of nbytes whose last byte is the last readable one: the page after it faults on any access."""
    page = mmap.PAGESIZE
    m = mmap.mmap(-1, 2 * page)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    assert libc.mprotect(addr + page, page, 0) == 0, ctypes.get_errno()  # PROT_NONE
    return torch.frombuffer(m, dtype=torch.uint8, count=nbytes, offset=page - nbytes), m


@needs_cc
@pytest.mark.skipif(not hasattr(mmap, "PAGESIZE") or sys.platform != "linux", reason="mprotect: Linux")
@pytest.mark.parametrize("bits", range(1, 9))
def test_codes_that_end_at_a_guard_page_are_not_read_past_their_end(bits):
    """A group is read as an 8-byte word only where the bytes past the row belong to later rows; the last rows of a
    head end exactly before an unreadable page here (a read past them would crash the process)."""
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    cb, d, h, tokens = codebook(bits, 8), 8, 2, 9
    idx = torch.randint(0, 2**bits, (1, h, tokens, d), generator=g)
    mem, keep = _before_a_guard_page(h * tokens * bits)
    mem.copy_(pack_indices(idx, bits).reshape(-1))
    codes = mem.view(1, h, tokens, bits)
    norms, q = torch.rand(1, h, tokens, generator=g), torch.randn(1, h, 3, d, generator=g)
    out = cpu.packed_scores_into(torch.empty(1, h, 3, tokens), codes, norms, q, cb)
    c = _centroids(cb, idx)
    torch.testing.assert_close(out, (q @ c.transpose(-1, -2)) * norms[:, :, None], msg=lambda m: f"seed {seed}: {m}")
    p = torch.softmax(torch.randn(1, h, 3, tokens, generator=g), -1)
    torch.testing.assert_close(cpu.packed_values(p, codes, norms, cb, d), (p * norms[:, :, None]) @ c,
                               msg=lambda m: f"seed {seed}: {m}")
    del codes, mem, keep


@pytest.mark.skipif(not cpu.available(), reason="no working C compiler")
@pytest.mark.parametrize("build", ["scalar", "default"])
def test_both_builds_match_the_torch_math(build, monkeypatch):
    """The AVX2 build (permutes and blends on the codes, sums in registers) where torch finds AVX2, and the portable
    scalar build (table entries of 2-4 codes) everywhere: both against the torch math, every width, odd head dims."""
    if build == "scalar":
        lib = jit._load(jit.compile_library(jit.source(), jit.compiler(), ["-O2", "-fopenmp"]))
        jit._declare(lib)
        assert lib.tq_vector_decode() == 0
        monkeypatch.setattr(jit, "_LIBS", {"decode": lib})
    elif jit.arch_flags():
        assert jit.library().tq_vector_decode() == 1  # CI's x86 machines run the AVX2 build by default
    for bits in range(1, 9):
        for d, tokens, per_head in ((64, 300, False), (24, 33, True), (136, 5, False)):
            test_scores_and_values_match_the_torch_math(bits, d, tokens, per_head)


@needs_cc
def test_results_do_not_depend_on_the_thread_count():
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    cb, d, tokens = codebook(5, 64), 64, 1000
    codes, _ = _codes(g, 1, 3, tokens, d, 5)
    norms, q = torch.rand(1, 3, tokens, generator=g), torch.randn(1, 3, 4, d, generator=g)
    p = torch.softmax(torch.randn(1, 3, 4, tokens, generator=g), -1)
    threads = torch.get_num_threads()
    got = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            got.append((cpu.packed_scores_into(torch.empty(1, 3, 4, tokens), codes, norms, q, cb),
                        cpu.packed_values(p, codes, norms, cb, d)))
    finally:
        torch.set_num_threads(threads)
    for s, v in got[1:]:
        assert torch.equal(s, got[0][0]) and torch.equal(v, got[0][1]), f"seed {seed}"


@needs_cc
def test_bad_arguments_are_refused_before_the_c_runs():
    cb = codebook(4, 64)
    codes = torch.zeros(1, 2, 5, 32, dtype=torch.uint8)
    norms, q, out = torch.ones(1, 2, 5), torch.zeros(1, 2, 3, 64), torch.empty(1, 2, 3, 5)
    with pytest.raises(ValueError, match=r"codes: expected a CPU torch.uint8 tensor of shape \(1, 2, 5, 32\)"):
        cpu.packed_scores_into(out, codes[..., :31], norms, q, cb)
    with pytest.raises(ValueError, match="norms: expected a CPU torch.float32"):
        cpu.packed_scores_into(out, codes, norms.half(), q, cb)
    with pytest.raises(ValueError, match=r"out: expected .* shape \(1, 2, 3, 5\)"):
        cpu.packed_scores_into(out[:, :, :2], codes, norms, q, cb)
    with pytest.raises(ValueError, match=r"out: its last dim must be contiguous"):
        cpu.packed_scores_into(torch.empty(1, 2, 5, 3).transpose(-1, -2), codes, norms, q, cb)
    with pytest.raises(ValueError, match=r"out: .*rows and heads apart"):
        cpu.packed_scores_into(torch.empty(1, 1, 3, 5).expand(1, 2, 3, 5), codes, norms, q, cb)
    two = Codebook.from_centroids(torch.stack([cb.centroids] * 3), 4)  # per-head, for 3 heads
    with pytest.raises(ValueError, match="a per-head codebook for 3 heads cannot read codes of 2 KV heads"):
        cpu.packed_scores_into(out, codes, norms, q, two)
    with pytest.raises(ValueError, match="a per-head codebook for 3 heads cannot read codes of 2 KV heads"):
        cpu.packed_values(torch.rand(1, 2, 3, 5), codes, norms, two, 64)
    with pytest.raises(ValueError, match=r"head dims that are multiples of 8 up to 512.*head dim 520"):
        cpu.packed_scores_into(torch.empty(1, 2, 3, 5), torch.zeros(1, 2, 5, 260, dtype=torch.uint8), norms,
                               torch.zeros(1, 2, 3, 520), cb)


@needs_cc
def test_heads_stored_batch_last_read_alike():
    """Codes, norms, probabilities and queries whose batch and head strides disagree (stored head-major, or token-major)
    give what contiguous copies give."""
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    b, h, t, d, rows = 3, 2, 300, 64, 4
    cb = _per_head(codebook(3, d), h, g)
    codes, idx = _codes(g, h, b, t, d, 3)
    codes, idx = codes.transpose(0, 1), idx.transpose(0, 1)  # (B, H, T, bytes) over (H, B, T, bytes) storage
    norms = torch.rand(t, b, h, generator=g).permute(1, 2, 0)  # token-major
    q = torch.randn(h, b, rows, d, generator=g).transpose(0, 1)
    p = torch.rand(h, b, rows, t, generator=g).transpose(0, 1)
    c = _centroids(cb, idx.contiguous())
    out = cpu.packed_scores_into(torch.empty(b, h, rows, t), codes, norms, q, cb)
    torch.testing.assert_close(out, (q @ c.transpose(-1, -2)) * norms[:, :, None], msg=lambda m: f"seed {seed}: {m}")
    torch.testing.assert_close(cpu.packed_values(p, codes, norms, cb, d), (p * norms[:, :, None]) @ c,
                               msg=lambda m: f"seed {seed}: {m}")


def _state_on_cpu(case, seed):
    kbits, vbits, d, group, n, lq, lr, dtype, mask_kind, _, per_head = case
    b, hkv = 2, 2
    state, kf, vf = make_state(b, hkv, lq, lr, n, d, kbits, vbits, dtype, seed, per_head, device="cpu",
                               sinks=min(3, lq))
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(b, n, hkv * group, d, generator=g).to(dtype).transpose(1, 2)
    t = lq + lr + n
    if mask_kind is None:
        mask = None
    elif n == 1:
        mask = head_mask(b, hkv * group, n, t, mask_kind, seed).cpu()
    else:
        mask = padding_mask(b, 1, n, t, [min(4, lq), 0], mask_kind).cpu()
    return state, q, mask


@needs_cc
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_decode_attention_matches_the_torch_math(case):
    """The whole call (sinks, window, masks, query groups, several queries, head dims 64-256, model dtypes) against
    `reference.packed_attention` on the same state."""
    seed = fresh_seed()
    state, q, mask = _state_on_cpu(case, seed)
    assert cpu.serves(q, state)
    scale = 0.9 * q.shape[-1] ** -0.5
    want = reference.packed_attention(q, state, mask, scale)
    got = cpu.decode_attention(q, state, mask, scale)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(torch.isnan(got), torch.isnan(want)), f"seed {seed}"
    assert rel_err(got.float(), want.float()) < (1e-5 if q.dtype == torch.float32 else 1e-2), f"seed {seed}"


@needs_cc
@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: f"{c[0]}x{c[1]}-v{c[2]}-d{c[3]}-g{c[4]}-n{c[5]}")
def test_split_keys_match_the_torch_math(case):
    sizes, bits, vbits, d, group, n, lq, lr, dtype, mask_kind, _, sinks = case
    seed = fresh_seed()
    b, hkv = 2, 2
    state, _, _ = make_split_state(b, hkv, lq, lr, n, d, sizes, bits, vbits, torch.float32, seed, sinks=sinks,
                                   device="cpu")
    q = torch.randn(b, hkv * group, n, d, generator=torch.Generator().manual_seed(seed))
    mask = None if mask_kind is None else padding_mask(b, 1, n, lq + lr + n, [min(4, lq), 0], mask_kind).cpu()
    assert cpu.serves(q, state)
    want = reference.packed_attention(q, state, mask, None)
    got = cpu.decode_attention(q, state, mask, None)
    assert rel_err(got, want) < 1e-5, f"seed {seed}"


YOUNG = [(1, 2, 2, 1, 64, 50, 16, 4, 2, 0, 5, 3, None, False),  # fewer positions than sinks
         (2, 1, 4, 1, 64, 50, 16, 4, 4, 0, 4, 4, "bool", False)]  # exactly the sinks


@needs_cc
@pytest.mark.parametrize("case,split", [(c, None) for c in STATIC_CASES + YOUNG] + STATIC_SPLIT_CASES,
                         ids=[f"s{i}" for i in range(len(STATIC_CASES + YOUNG))]
                         + [f"split{i}" for i in range(len(STATIC_SPLIT_CASES))])
def test_a_static_layer_reads_alike_through_its_dynamic_view(case, split, monkeypatch):
    """A static layer (`TurboQuantStaticCache`) on the CPU: its positions held (not its capacity: slots past the length
    and dead window slots are poisoned) through `dynamic_view`, against `reference.static_attention`, by ops'
    dispatch."""
    b, hkv, group, n, d, cap, window, sinks, length, exact_from, kbits, vbits, mask_kind, per_head = case
    seed = fresh_seed()
    kv, _, _, _, _ = make_static_kv(b, hkv, cap, window, sinks, length, exact_from, d, kbits, vbits, torch.float16,
                                    seed, per_head, split)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(b, hkv * group, n, d, generator=g).to(torch.float16)
    mask = None
    if mask_kind is not None:
        allowed = torch.rand(b, 1, n, cap, generator=g) > 0.3
        allowed[..., 0] = True
        allowed[..., length:] = True  # positions past the length must be ignored all the same
        mask = allowed if mask_kind == "bool" else torch.where(allowed, 0.0, float("-inf")) + torch.randn(
            b, 1, n, cap, generator=g)
    scale = d**-0.5 * 1.3
    view = cpu.dynamic_view(kv)
    assert cpu.serves(q, view) and not cpu.serves(q, kv)
    calls = []
    real = cpu.decode_attention
    monkeypatch.setattr(cpu, "decode_attention", lambda *a: calls.append(1) or real(*a))
    got = ops.decode_attention(q, kv, mask, scale)
    assert calls == [1]
    want = reference.static_attention(q, kv, mask, scale)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert rel_err(got.float(), want.float()) < 1e-2, f"seed {seed}"


@needs_cc
def test_shapes_the_c_does_not_read_are_left_to_the_torch_math():
    seed = fresh_seed()
    state, q, mask = _state_on_cpu(CASES[0], seed)
    assert cpu.serves(q, state)
    assert not cpu.serves(q.to("meta"), state)
    assert not cpu.serves(q, replace(state, v_packed=state.v_packed[..., :-1]))  # not whole groups of 8 codes
    assert not cpu.serves(q[..., :60], state)  # head dim 60
    assert not cpu.serves(q, replace(state, length=torch.tensor(state.length), exact_from=torch.tensor(
        state.exact_from)))  # a static layer's lengths live on the device
    wide = torch.zeros(*q.shape[:-1], 520)
    assert not cpu.serves(wide, replace(state, v_packed=torch.zeros(*state.v_packed.shape[:-1], 520 * 4 // 8,
                                                                    dtype=torch.uint8)))  # head dim 520


@needs_cc
def test_ops_takes_the_c_path_by_default_and_the_torch_math_on_request(monkeypatch):
    seed = fresh_seed()
    state, q, mask = _state_on_cpu(CASES[3], seed)
    calls = []
    real = cpu.decode_attention
    monkeypatch.setattr(cpu, "decode_attention", lambda *a: calls.append(1) or real(*a))
    ops.decode_attention(q, state, mask, None)
    assert calls == [1]
    monkeypatch.setenv(select.ENV, "torch")
    ops.decode_attention(q, state, mask, None)
    assert calls == [1]


def test_without_a_compiler_the_torch_math_decodes_with_one_warning(monkeypatch):
    seed = fresh_seed()
    state, q, mask = _state_on_cpu(CASES[0], seed)
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setattr(jit, "_LIBS", {})
    monkeypatch.setattr(select, "_WARNED", set())
    builds = []
    real_build = jit._build
    monkeypatch.setattr(jit, "_build", lambda: builds.append(1) or real_build())
    with pytest.warns(RuntimeWarning, match="decodes on the CPU with the torch math.*no C compiler: '/nonexistent/cc'"):
        out = ops.decode_attention(q, state, mask, None)
    torch.testing.assert_close(out, reference.packed_attention(q, state, mask, None))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ops.decode_attention(q, state, mask, None)  # no second warning
    assert builds == [1]  # tried once a process: no second build


def _compiler_found() -> bool:
    try:
        jit.compiler()
    except jit.JitError:
        return False
    return True


def test_ci_builds_the_c_kernels():
    """CI must test the C path, not skip it: there a failed build is a failure (with the compiler's message)."""
    if not os.environ.get("CI"):
        pytest.skip("CI only")
    try:
        jit.library()
    except jit.JitError as e:
        pytest.fail(f"the CPU decode kernels do not build on CI: {e}")


@pytest.mark.skipif(not _compiler_found(), reason="no C compiler")
def test_libraries_of_different_images_load_apart():
    """Each image is loaded from its own anonymous file: a second library is never the first one found again by its
    path (dlopen matches paths it has loaded)."""
    cc = jit.compiler()
    libs = [jit._load(jit.compile_library(f"int answer(void) {{ return {k}; }}", cc, ["-O1"])) for k in (1, 2)]
    assert [lib.answer() for lib in libs] == [1, 2]


@pytest.mark.skipif(not _compiler_found(), reason="no C compiler")
def test_a_compile_error_names_the_command_and_the_message(tmp_path):
    with pytest.raises(jit.JitError, match=r"(?s)does not compile.*-shared.*broken"):
        jit.compile_library(jit.source() + "\n#error broken\n", jit.compiler(), ["-O1"])


@needs_cc
@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_a_damaged_cached_library_is_built_again(damage, monkeypatch, tmp_path):
    monkeypatch.setenv("TQ_HF_CACHE_KERNEL_DIR", str(tmp_path))
    monkeypatch.setattr(jit, "_LIBS", {})
    jit.library()
    (path,) = glob.glob(str(tmp_path / "cpu_decode-*.so"))
    raw = open(path, "rb").read()
    bad = raw[:-100] if damage == "truncated" else raw[:-1] + bytes([raw[-1] ^ 1])
    with open(path, "wb") as f:
        f.write(bad)
    monkeypatch.setattr(jit, "_LIBS", {})
    with pytest.warns(RuntimeWarning, match="does not match its digest"):
        jit.library()
    assert open(path, "rb").read() == raw
    test_results_do_not_depend_on_the_thread_count()  # the rebuilt library computes


@needs_cc
@pytest.mark.skipif(not hasattr(os, "geteuid"), reason="POSIX owners and modes")
def test_cache_files_anyone_may_write_are_not_loaded(monkeypatch, tmp_path):
    """The disk cache holds code: an entry others may write is rebuilt (and replaced by an owner-only one), and a
    cache folder others may write is not used at all."""
    monkeypatch.setenv("TQ_HF_CACHE_KERNEL_DIR", str(tmp_path))
    monkeypatch.setattr(jit, "_LIBS", {})
    jit.library()
    (path,) = glob.glob(str(tmp_path / "cpu_decode-*.so"))
    os.chmod(path, 0o666)
    monkeypatch.setattr(jit, "_LIBS", {})
    with pytest.warns(RuntimeWarning, match="writable by group and others .*; not loading it"):
        jit.library()
    assert os.stat(path).st_mode & 0o777 == 0o600
    os.chmod(tmp_path, 0o777)
    monkeypatch.setattr(jit, "_LIBS", {})
    try:
        with pytest.warns(RuntimeWarning, match="not using it .*chmod go-w"):
            jit.library()
    finally:
        os.chmod(tmp_path, 0o700)
