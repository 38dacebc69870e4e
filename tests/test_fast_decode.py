"""The explicit-layout decode kernel (`tq_hf_cache.kernels.cuda`, CUDA C++ through NVRTC).

Without a GPU: its pair tables, its plan, and its SASS: compiled for sm_90 here, the main loop's instructions per
32-token tile must stay within `SASS_BUDGET` (NVRTC from nvidia-cuda-nvrtc-cu12 and cuobjdump from the triton wheel;
skipped where either is missing). On a GPU: the kernel against the torch oracle on fresh random inputs (poisoned
outputs, every width it takes, head dims 64 / 128 / 256, GQA groups, several queries, masks, sinks, NaN), and against
the Triton kernel on the same state.
"""

import collections
import glob
import os
import re
import subprocess
from dataclasses import replace

import pytest
import torch

from tq_hf_cache import reference
from tq_hf_cache.quant.codebook import Codebook
from tq_hf_cache.kernels import cuda, disk_cache, select, support
from tq_hf_cache.kernels.cuda import jit

from test_decode_attention import TOL, fresh_seed, head_mask, make_query, make_state, padding_mask, rel_err

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")

# Main-loop SASS instructions per 32-token tile (one warp) at head dim 128, one query n-tile, no mask, Llama-3.1-8B's
# group of 4 query heads (4 partial rows) in bf16, as compiled for sm_90 by NVRTC 12.9. The count depends on the whole
# kernel (ptxas rematerializes lane addresses in the loop when registers run short: 1062 for k5v3 in one build whose
# loop alone was unchanged), so the budget is checked for the configuration the benchmarks run. What a 16-token step
# costs: per code pair a shift and a LOP3 (the pair's bits and the lane's table copy; the table base rides in the LDS)
# and an LDS (64); the codes and norms read from the warp's cp.async ring (16-29 LDS); a PRMT per value register (32);
# 24 HMMA; 32 FMUL of the rescale, which runs only when a finite running max moves; about 20 instructions to issue the
# next tile's copies. ncu at 1 x 128k: ALU pipe 52 % of cycles, issue slots 50 %; cutting 6 % of the count gained
# 6-9 %, cutting 8-15 % more (byte-addressed 4-bit tables) gained 0-4 %: past this point a warp's dependent chain per
# tile, not the count, sets the time (docs/performance.md). The aim, 2 thread-instructions per K/V element
# (512 a tile at head dim 128), is not met (854-916 today, 846-908 with QPAIR's query in registers: the shift per
# code pair, the codes' trip through shared memory and the softmax's per-step cost); each budget is a count of its
# time + 5 %.
SASS_BUDGET = {(5, 3): 972, (4, 4): 896, (4, 2): 896, (2, 2): 892, (3, 3): 945}


def _cuobjdump() -> str | None:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return path if os.path.exists(path) else None


def _nvrtc_ok() -> bool:
    try:
        jit.nvrtc()
        return True
    except jit.JitError:
        return False


def sm90_sass(df: dict[str, int], cubin, *flags: str) -> list[str]:
    """The kernel of these defines compiled for sm_90 into the file `cubin`, and cuobjdump's output for each flag."""
    cubin.write_bytes(jit.compile_cubin(cuda.source(), cuda.NAME, df, 90))
    return [subprocess.run([_cuobjdump(), flag, str(cubin)], capture_output=True, text=True, check=True).stdout
            for flag in flags]


def instructions(sass: str, function: str = cuda.NAME) -> list[tuple[int, str]]:
    """(address, text) of each SASS instruction of `function` in cuobjdump's output."""
    sass = sass[re.search(rf"Function : {function}\s", sass).start():]
    nxt = sass.find("Function : ", 1)
    sass = sass if nxt < 0 else sass[:nxt]
    return [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]


def main_loops(sass: str, function: str = cuda.NAME) -> list[collections.Counter]:
    """Opcode counts of each innermost backward-branch loop with HMMA and at least 64 LDS (a step's code pairs) in
    `function`'s SASS: the packed part's loop, once per copy of it that the kernel inlines."""
    ins = instructions(sass, function)
    loops = []
    for addr, text in ins:
        m = re.search(r"\bBRA\b[^;]*?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            loops.append((int(m.group(1), 16), addr))
    found = []
    for lo, hi in loops:
        if any(lo <= a and b <= hi and (a, b) != (lo, hi) for a, b in loops):
            continue  # an outer loop
        body = [t for a, t in ins if lo <= a <= hi]
        if any("HMMA" in t for t in body) and sum("LDS" in t for t in body) >= 64:
            found.append(collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body))
    return found


@pytest.mark.skipif(not _nvrtc_ok() or _cuobjdump() is None, reason="NVRTC or cuobjdump missing")
@pytest.mark.parametrize("fold", [0, 1])
@pytest.mark.parametrize("qpair", [0, 1])
@pytest.mark.parametrize("kb,vb", sorted(SASS_BUDGET))
def test_sm90_main_loop_within_its_instruction_budget(kb, vb, qpair, fold, tmp_path):
    """The loop's SASS within the budget, with the query's fragments loaded a k-step at a time (short splits) or held
    in registers, two k-steps a quad (`cuda.qpair`: long splits; no LDS.128 left in the loop), in the builds of plans
    that fold the exact copies into the last split's CTA and of those that do not (`FOLD`)."""
    df = cuda.defines(128, kb, vb, 1, 0, 0, False, False, False, 16, True)
    df.update(ROWS=4, Q_DT=1, X_DT=1, O_DT=1, HAD=1, QPAIR=qpair, FOLD=fold)  # (head dim 128's default: Hadamard)
    res, sass = sm90_sass(df, tmp_path / "k.cubin", "-res-usage", "-sass")
    assert "LOCAL:0" in res, f"k{kb}v{vb}: the kernel spills to local memory:\n{res}"
    loops = main_loops(sass)
    assert len(loops) == 1 + fold, f"k{kb}v{vb}: {len(loops)} main loops"  # (a folded CTA has its own copy)
    for ops in loops:
        steps = ops["HMMA"] // 24  # 16-token steps in the loop body (24 HMMA each at head dim 128, one query n-tile)
        assert steps >= 1 and ops["HMMA"] == 24 * steps, f"k{kb}v{vb}: {ops['HMMA']} HMMA in the loop: {ops}"
        assert ops["LDS"] >= 64 * steps, f"k{kb}v{vb}: fewer LDS than code pairs (64 a step): {ops}"
        assert ops["LDL"] == ops["STL"] == 0, f"k{kb}v{vb}: local memory in the loop: {ops}"
        per_tile = sum(ops.values()) * 2 // steps
        budget = SASS_BUDGET[(kb, vb)]
        assert per_tile <= budget, f"k{kb}v{vb}: {per_tile} instructions a tile > {budget}"


@pytest.mark.skipif(not _nvrtc_ok() or _cuobjdump() is None, reason="NVRTC or cuobjdump missing")
def test_sm90_a_mask_row_reads_two_words_a_step_within_the_budget(tmp_path):
    """A decode step's mask (one bool row for every head) costs the loop two 16-bit loads a step and a test per
    token, not the general path's per-row loads: the loop stays within the no-mask budget."""
    df = cuda.defines(128, 5, 3, 1, 1, 0, False, False, True, 16, True)
    df.update(ROWS=4, Q_DT=1, X_DT=1, O_DT=1, MASK_ROW=1, HAD=1)
    loops = main_loops(sm90_sass(df, tmp_path / "k.cubin", "-sass")[0])
    assert 1 <= len(loops) <= 2, f"{len(loops)} main loops"
    for ops in loops:
        steps = ops["HMMA"] // 24
        assert ops["LDG"] == 2 * steps, f"{ops['LDG']} global loads in {steps} steps: {ops}"
        assert sum(ops.values()) * 2 // steps <= SASS_BUDGET[(5, 3)], ops


@pytest.mark.skipif(not _nvrtc_ok() or _cuobjdump() is None, reason="NVRTC or cuobjdump missing")
@pytest.mark.parametrize("d,w", [(64, 8), (128, 16), (256, 8)])
def test_sm90_a_build_for_plans_that_never_fold_leaves_the_folded_ctas_code_out(d, w, tmp_path):
    """FOLD=0, the build of every plan but a folding one (`cuda.decode`), holds one copy of the packed part's loop and
    at most 70 % of FOLD=1's instructions: the folded CTA's own copies of the exact and packed parts are gone (inside a
    model the kernel's code comes from memory at every call)."""
    counts = {}
    for fold in (0, 1):
        df = cuda.defines(d, 5, 3, 1, 1, 0, False, False, True, 16, True, w=w)
        df.update(ROWS=4, Q_DT=1, X_DT=1, O_DT=1, HAD=1, MASK_ROW=1, FOLD=fold)
        (sass,) = sm90_sass(df, tmp_path / f"k{fold}.cubin", "-sass")
        if d > 64:  # (at head dim 64 a step has fewer code pairs than `main_loops` looks for)
            loops = len(main_loops(sass))
            assert loops == 1 + fold, f"FOLD={fold}: {loops} main loops"
        counts[fold] = len(instructions(sass))
    assert counts[0] <= 0.7 * counts[1], counts


@pytest.mark.skipif(not _nvrtc_ok(), reason="NVRTC missing")
@pytest.mark.parametrize("xdt,d", [(2, 128), (2, 256), (0, 64), (1, 256)])
def test_sm90_the_exact_parts_compile_with_the_launchers_batch(xdt, d):
    """Each exact part compiles with the batch `exact_batch` gives it: whole 8-token tiles for fp32 copies (the warps'
    path), whole 16-token tiles on tensor cores (a check meant for one must not stop the other from building)."""
    df = cuda.defines(d, 4, 2, 1, 1, 0, False, False, False, 16, True)
    xbytes = 4 if xdt == 2 else 2
    xb = cuda.exact_batch(d, 4, xbytes, cuda.packed_smem(df), df["WARPS"])
    assert xb % (8 if xdt == 2 else 16) == 0, xb
    df.update(ROWS=4, Q_DT=xdt, X_DT=xdt, O_DT=xdt, HAD=1, XB=xb, XVEC=16, QV=1, MSPLITS=8, NXMAX=2)
    assert jit.compile_cubin(cuda.source(), cuda.NAME, df, 90)


@pytest.mark.skipif(not _nvrtc_ok(), reason="NVRTC missing")
def test_sm90_the_timeline_study_instruments_the_kernel():
    """benchmarks/studies/fast_decode_timeline.py edits the kernel's source at anchors: each is there once and the
    instrumented kernel compiles (a kernel change that moves an anchor fails here, not on the GPU)."""
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, "benchmarks", "studies", "fast_decode_timeline.py")
    spec = importlib.util.spec_from_file_location("fast_decode_timeline", path)
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)
    src = study.instrumented(cuda.source())
    assert all(after in src for _, after in study.EDITS)
    df = cuda.defines(128, 5, 3, 1, 1, 0, False, False, True, 16, True)
    df.update(ROWS=4, Q_DT=1, X_DT=1, O_DT=1, MASK_ROW=1, TL_PTR=1 << 20)
    assert jit.compile_cubin(src, cuda.NAME, df, 90)


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
@pytest.mark.parametrize("per_head", [False, True])
def test_pair_table_entries_are_the_fp16_centroid_pairs(bits, per_head):
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    heads = 3
    cb = Codebook.from_centroids(torch.randn((heads, 2**bits) if per_head else (2**bits,), generator=g), bits)
    table, stride = cuda.pair_table(cb, heads, torch.device("cpu"))
    assert table.dtype == torch.int32 and table.shape[-1] == 4**bits and stride == (4**bits if per_head else 0)
    want = cb.centroids.to(torch.float16).reshape(-1, 2**bits)
    key = torch.arange(4**bits)
    t = table.to(torch.int64) & 0xFFFFFFFF
    for half, idx in ((t & 0xFFFF, key & (2**bits - 1)), (t >> 16, key >> bits)):
        got = half.to(torch.int32).to(torch.int16).view(torch.float16)
        torch.testing.assert_close(got, want[:, idx], rtol=0, atol=0, msg=lambda m: f"seed {seed}: {m}")


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("per_head", [False, True])
def test_pair_table_entries_of_a_pair_codebook_are_its_fp16_points(bits, per_head):
    """A pair codebook's point i is what the two codes packed in i mean: entry i holds it (x low, y high)."""
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    heads = 3
    cb = Codebook.from_points(torch.randn((heads, 4**bits, 2) if per_head else (4**bits, 2), generator=g), bits)
    table, stride = cuda.pair_table(cb, heads, torch.device("cpu"))
    assert table.dtype == torch.int32 and table.shape[-1] == 4**bits and stride == (4**bits if per_head else 0)
    want = cb.centroids.to(torch.float16).reshape(-1, 4**bits, 2)
    t = table.to(torch.int64).reshape(-1, 4**bits) & 0xFFFFFFFF
    for half, j in ((t & 0xFFFF, 0), (t >> 16, 1)):
        got = half.to(torch.int32).to(torch.int16).view(torch.float16)
        torch.testing.assert_close(got, want[..., j], rtol=0, atol=0, msg=lambda m: f"seed {seed}: {m}")


def test_the_query_rides_in_registers_two_k_steps_a_quad_over_long_splits_at_head_dim_128():
    assert cuda.qpair(128, 1, 131072, 16, 16)  # Llama 3.1 8B at 1 x 128k: 512 tokens a warp
    assert not cuda.qpair(128, 1, 4096, 15, 16)  # 1 x 4k: 17 a warp
    assert cuda.qpair(128, 1, 128 * 8 * 4, 4, 8) and not cuda.qpair(128, 1, 128 * 8 * 4 - 1, 4, 8)
    assert not cuda.qpair(64, 1, 131072, 4, 16)  # (head dim 64 holds its fragments in registers already)
    assert not cuda.qpair(128, 2, 131072, 16, 16)  # (two query n-tiles: rows g + 8 are live)


def test_splits_cover_the_history_in_whole_tiles(monkeypatch):
    """One wave of split CTAs (as many as an SM holds, `ctas_per_sm`; one CTA an SM where the history limits the
    splits), each split whole 16-token tiles, the splits tiling the history in order and differing by at most a
    tile; where the last split's CTA takes the exact copies, that split is shorter by about the tokens they count as."""
    monkeypatch.setattr(support, "sm_count", lambda d: 132)
    for w, d, nq in ((8, 128, 1), (16, 128, 1), (8, 128, 2), (8, 256, 1)):
        for bh, lq in ((8, 131072), (64, 32768), (1, 100), (256, 4096), (8, 17), (8, 130944), (3, 5000), (1, 40000),
                       (8, 4096), (8, 8192), (4, 8192)):
            splits, fold = cuda.plan(bh, lq, torch.device("cpu"), warps=w, head_dim=d, nq=nq)
            most = -(-lq // (cuda.MIN_TOKENS_PER_SPLIT[w] * 128 // d))
            ctas = 16 // w if (d, nq) == (128, 1) else 1  # (two CTAs of 8 warps fit at 128 registers a thread)
            assert 1 <= splits <= most and (bh * splits <= ctas * 132 or splits == 1), (w, d, nq, bh, lq)
            if splits == most and splits > 1:  # limited by the history
                assert bh * (splits + 1) <= 132, (w, bh, lq, splits)
            assert cuda.plan(bh, lq, torch.device("cpu"), max_splits=2, warps=w, head_dim=d, nq=nq)[0] <= 2
            ranges = [cuda.split_range(s, splits, lq, fold) for s in range(splits)]
            assert ranges[0][0] == 0 and ranges[-1][1] == lq, (w, bh, lq, ranges)
            for (s0, e0), (s1, e1) in zip(ranges, ranges[1:]):  # in order, meeting (or empty past the history)
                assert s0 % 16 == 0 and s0 <= s1 and e0 == min(s1, lq), (w, bh, lq, ranges)
            full, last = max(e - s for s, e in ranges[:-1]) if splits > 1 else lq, max(0, lq - ranges[-1][0])
            if fold:
                assert full - 16 - fold <= last < full, (w, bh, lq, ranges)
            elif splits > 1:
                sizes = [e - s for s, e in ranges[:-1]]
                assert max(sizes) - min(sizes) <= 16 and last <= full + 16, (w, bh, lq, ranges)
    # folded only with 16 warps and long splits: Llama-3.1-8B's 8 KV heads at 1 x 128k and 8 x 32k
    assert cuda.plan(8, 130944, torch.device("cpu"), warps=16) == (16, cuda.EXACT_TOKENS)
    assert cuda.plan(64, 32768, torch.device("cpu"), warps=16) == (2, cuda.EXACT_TOKENS)
    assert cuda.plan(8, 32768, torch.device("cpu"), warps=16) == (15, 0)
    assert cuda.plan(8, 4096, torch.device("cpu"), warps=16) == (15, 0)  # one CTA an SM, exact copies' too
    assert cuda.plan(8, 4096, torch.device("cpu"), warps=8) == (8, 0)
    assert cuda.plan(8, 8192, torch.device("cpu"), warps=8) == (15, 0)  # not 16: 136 CTAs on 132 SMs
    assert cuda.plan(8, 131072, torch.device("cpu"), warps=8) == (32, 0)
    # one CTA an SM (head dim 256, or 16 query rows): one wave of them, not two
    assert cuda.plan(8, 32768, torch.device("cpu"), warps=8, nq=2) == (15, 0)
    assert cuda.plan(8, 131072, torch.device("cpu"), warps=8, head_dim=256) == (15, 0)
    assert cuda.plan(4, 4096, torch.device("cpu"), warps=8, head_dim=256) == (16, 0)  # 256 tokens a split
    # fewer than 8 splits: room for the exact copies' CTAs where the splits are short (SmolLM2's 32 KV heads, head
    # dim 64, at 1 x 4k; Llama's 8 x 4k), not where they are long (1 x 8k; 8 x 8k)
    assert cuda.plan(32, 4096, torch.device("cpu"), warps=16, head_dim=64) == (3, 0)
    assert cuda.plan(32, 8192, torch.device("cpu"), warps=16, head_dim=64) == (4, 0)
    assert cuda.plan(64, 4096, torch.device("cpu"), warps=8) == (3, 0)
    assert cuda.plan(64, 8192, torch.device("cpu"), warps=8) == (4, 0)


def test_sixteen_warps_where_they_fold_the_exact_copies_into_more_of_the_gpu(monkeypatch):
    """`choose` takes one CTA of 16 warps an SM instead of the layout's two of 8 where the 16 fold the exact copies
    into long splits and keep at least 5 % more of the SMs on the history: SmolLM2's 32 KV heads (head dim 64) at
    1 x 32k and 1 x 128k; not where the two CTAs of 8 fill the GPU as well (Llama's 8 KV heads at 1 x 128k, 8 x 16k),
    nor at short histories, nor where one CTA of 8 warps fills an SM (head dim 256)."""
    monkeypatch.setattr(support, "sm_count", lambda d: 132)
    cpu = torch.device("cpu")
    assert cuda.choose(32, 131072, cpu, None, 64, 1, 8) == (16, 4, cuda.EXACT_TOKENS)
    assert cuda.choose(32, 32768, cpu, None, 64, 1, 8) == (16, 4, cuda.EXACT_TOKENS)
    assert cuda.choose(32, 4096, cpu, None, 64, 1, 8) == (8, 7, 0)
    assert cuda.choose(256, 32768, cpu, None, 64, 1, 8) == (8, 1, 0)
    assert cuda.choose(8, 131072, cpu, None, 128, 1, 8) == (8, 32, 0)
    assert cuda.choose(64, 16384, cpu, None, 128, 1, 8) == (8, 4, 0)
    assert cuda.choose(4, 131072, cpu, None, 256, 1, 8) == (8, 32, 0)
    assert cuda.choose(8, 131072, cpu, None, 128, 1, 16) == (16, 16, cuda.EXACT_TOKENS)  # (the layout's 16 stay)
    assert cuda.choose(32, 131072, cpu, 4, 64, 1, 8) == (8, 4, 0)  # (a caller's scratch cuts the splits)
    monkeypatch.setattr(support, "sm_count", lambda d: 20)  # 20 folded splits of 16 warps against 39 of 8: under 5 %
    assert cuda.choose(1, 131072, cpu, None, 64, 1, 8) == (8, 39, 0)
    assert cuda.plan(1, 131072, cpu, None, 16, 64, 1) == (20, cuda.EXACT_TOKENS)


def test_head_dim_64_takes_two_eight_warp_ctas_an_sm_where_the_sms_cut_sixteen_warp_splits(monkeypatch):
    """At head dim 64, where the layout chose one CTA of 16 warps an SM (5-bit keys) and the SMs, not the history, cut
    the unfolded 16-warp splits, `choose` takes two CTAs of 8 warps an SM and the exact copies' CTAs of their own
    (`plan` with 8 warps), where a split an SM would leave each head two or more (SmolLM2's 32 KV heads at 1 x 4k,
    1 x 16k, 1 x 20k, 2 x 4k) or the history is short (8 x 4k), within a caller's scratch; not where the history
    cuts the splits (2 KV heads at 1 x 4k), nor past the long splits `plan` folds itself (1 x 32k), nor over a long
    history with under two splits a head (8 x 32k), nor at head dim 128 (Llama's 8 KV heads)."""
    monkeypatch.setattr(support, "sm_count", lambda d: 132)
    cpu = torch.device("cpu")
    assert cuda.choose(32, 4096, cpu, None, 64, 1, 16) == (8, 7, 0)
    assert cuda.choose(32, 16384, cpu, None, 64, 1, 16) == (8, 7, 0)
    assert cuda.choose(32, 20000, cpu, None, 64, 1, 16) == (8, 7, 0)
    assert cuda.choose(64, 4096, cpu, None, 64, 1, 16) == (8, 3, 0)
    assert cuda.choose(32, 2688, cpu, None, 64, 1, 16) == (8, 3, 0)  # (a split and its exact CTA an SM each)
    assert cuda.choose(256, 4096, cpu, None, 64, 1, 16) == (8, 1, 0)
    assert cuda.choose(2, 4096, cpu, None, 64, 1, 16) == (16, 16, 0)
    assert cuda.choose(32, 32768, cpu, None, 64, 1, 16) == (16, 4, cuda.EXACT_TOKENS)
    assert cuda.choose(256, 32768, cpu, None, 64, 1, 16) == (16, 1, 0)  # (long: the 16 warps' table copies)
    assert cuda.choose(8, 4096, cpu, None, 128, 1, 16) == (16, 15, 0)
    assert cuda.choose(32, 4096, cpu, 3, 64, 1, 16) == (8, 3, 0)  # (a caller's scratch cuts the splits)
    assert cuda.choose(2, 4096, cpu, 8, 64, 1, 16) == (16, 8, 0)  # (the scratch, not the SMs, cuts them)


def test_split_range_counts_the_folded_exact_copies_as_packed_tokens():
    """`split_range` places the splits as the kernel does: the history and the folded exact copies' tokens cut in
    equal parts at multiples of 16, the last split ending at the history's end."""
    fold = cuda.EXACT_TOKENS
    for s in range(4):
        a, e = cuda.split_range(s, 4, 32768, fold)
        assert (a, e) == ((32768 + fold) // 4 * s, 32768 if s == 3 else (32768 + fold) // 4 * (s + 1)), (s, a, e)


def test_eight_warp_ctas_take_256_tokens_a_split_over_short_histories_with_an_sm_each(monkeypatch):
    """`choose`: 8-warp CTAs take at least 256 tokens a split (not 512) over histories up to SHORT_TOKENS at head dim
    128, where every split and one exact copies' CTA a head keep an SM each: Llama's 8 KV heads at 1 x 4k take 15
    splits (not 8), at 1 x 2k 8 (not 4); not at 2 x 4k (15 splits would put two CTAs on an SM: 7 stay), not at head
    dims 256 and 64, not with two query n-tiles (one CTA an SM), not past SHORT_TOKENS, and never past a caller's
    scratch."""
    monkeypatch.setattr(support, "sm_count", lambda d: 132)
    cpu = torch.device("cpu")
    assert cuda.plan(8, 3968, cpu, None, 8, 128, 1) == (8, 0)
    assert cuda.choose(8, 3968, cpu, None, 128, 1, 8) == (8, 15, 0)
    assert cuda.choose(8, 1920, cpu, None, 128, 1, 8) == (8, 8, 0)
    assert cuda.choose(16, 3968, cpu, None, 128, 1, 8) == (8, 7, 0)
    assert cuda.choose(4, 3968, cpu, None, 256, 1, 8) == (8, 16, 0)
    assert cuda.choose(2, 1024, cpu, None, 64, 1, 8) == (8, 2, 0)  # (4 with 256 tokens a split)
    assert cuda.choose(2, 1024, cpu, None, 128, 2, 8) == (8, 2, 0)  # (one CTA an SM: 4 with 256)
    assert cuda.choose(2, 8192, cpu, None, 128, 1, 8) == (8, 32, 0)
    assert cuda.choose(2, 8208, cpu, None, 128, 1, 8) == (8, 17, 0)  # (33 with 256 tokens a split)
    assert cuda.choose(8, 3968, cpu, 4, 128, 1, 8) == (8, 4, 0)
    assert cuda.choose(8, 3968, cpu, None, 128, 1, 16) == (16, 15, 0)  # (the layout's 16 warps stay)


def test_exact_copies_take_the_ctas_the_splits_leave_free(monkeypatch):
    """`exact_parts`: one exact copies' CTA where the splits fill the GPU, the last split's CTA takes them or two CTAs
    share an SM; up to EXACT_PARTS side by side where SMs are free, at least EXACT_PART_TOKENS tokens a part, within
    the caller's scratch."""
    monkeypatch.setattr(support, "sm_count", lambda dev: 132)
    cpu = torch.device("cpu")
    # Gemma 3 4B at 1 x 4k: 4 KV heads x 16 splits of one 8-warp CTA an SM leave 64 SMs; 132 exact tokens
    assert cuda.exact_parts(4, 16, False, 132, cpu, 256, 1, 8) == 3
    assert cuda.exact_parts(4, 16, False, 132, cpu, 256, 1, 8, most=2) == 2
    assert cuda.exact_parts(4, 16, False, 1000, cpu, 256, 1, 8) == cuda.EXACT_PARTS
    assert cuda.exact_parts(4, 16, False, cuda.EXACT_PART_TOKENS, cpu, 256, 1, 8) == 1
    assert cuda.exact_parts(4, 16, True, 132, cpu, 256, 1, 8) == 1  # folded into the last split's CTA
    # Llama at 1 x 4k: 8 KV heads x 15 splits of 16 warps leave 4 SMs, fewer than a CTA a head
    assert cuda.exact_parts(8, 15, False, 132, cpu, 128, 1, 16) == 1
    # two 8-warp CTAs an SM at head dim 128: 8 heads x 8 splits leave 192 slots, but a part would share an SM
    assert cuda.exact_parts(8, 8, False, 132, cpu, 128, 1, 8) == 1
    # one CTA an SM at head dim 128 (16 query rows): 2 heads x 8 splits leave 114 SMs
    assert cuda.exact_parts(2, 8, False, 132, cpu, 128, 2, 8) == 3
    # the last split's CTA takes the exact copies as one part: a launch asking for more is refused before it starts
    with pytest.raises(ValueError, match="one part, not 2"):
        cuda.decode(*[None] * 18, num_splits=4, fold=True, rows=4, out=None, w=16, parts=2)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_prepare_makes_a_rotations_kernel_operands_once(d):
    """`prepare` (outside any CUDA graph) makes what the kernel reads of a rotation, once per rotation and device: a
    Hadamard rotation's signs as bit words (the kernel's butterflies need nothing else), a dense rotation's Pi in the
    query rotation's fragment order and rounded to fp16 for the merge."""
    from tq_hf_cache.quant.codebook import theoretical_codebook
    from tq_hf_cache.quant.rotation import make_rotation

    cbs = theoretical_codebook(4, d), theoretical_codebook(3, d)
    had = make_rotation(d, 3)
    assert cuda.hadamard(had)
    cuda.prepare(had, *cbs, 2, had.signs.device)
    w = had.derived.find(("cuda.signs", had.signs.device))
    neg = [bool((int(w[c // 32]) >> (c % 32)) & 1) for c in range(d)]
    assert w.dtype == torch.int32 and w.shape == (d // 32,) and neg == (had.signs < 0).tolist()
    assert cuda._signs(had, had.signs.device) is w
    assert all((name, had.signs.device) not in had.derived for name in ("cuda.halves", "cuda.fragments"))
    rot = make_rotation(d, 3, "orthogonal")
    assert not cuda.hadamard(rot)
    pi = rot.matrix
    cuda.prepare(rot, *cbs, 2, pi.device)
    h = rot.derived.find(("cuda.halves", pi.device))
    assert h.dtype == torch.float16 and h.is_contiguous() and torch.equal(h, pi.to(torch.float16))
    assert cuda._halves(rot, pi.device) is h
    assert cuda._fragments(rot, pi.device) is rot.derived.find(("cuda.fragments", pi.device))
    assert ("cuda.signs", pi.device) not in rot.derived


def test_sixteen_warps_where_two_ctas_would_hold_fewer_table_copies():
    """One CTA of 16 warps an SM for the 5-bit key tables at head dims up to 128 (two CTAs of 8 fit only 16 copies of
    them, with more bank conflicts), 8 warps elsewhere; each choice's shared memory fits the H100's 227 KB."""
    for d in (64, 128, 256):
        for kb, vb in ((5, 3), (5, 2), (5, 5), (4, 4), (4, 2), (3, 3), (2, 2)):
            for nq in (1, 2):
                w = cuda.warps(d, kb, vb, False, False, nq, (9, 0))
                assert w == (16 if kb == 5 and d <= 128 and nq == 1 else 8), (d, kb, vb, nq, w)
                df = cuda.defines(d, kb, vb, nq, 0, 0, False, False, False, 16, True)
                assert df["WARPS"] == w and cuda.packed_smem(df) <= 227 * 1024, (d, kb, vb, nq, df)


def test_shape_limits():
    assert cuda.shape_ok(128, 5, 3, 4, False, 4096) and cuda.shape_ok(64, 2, 5, 16, False, 16)
    assert not cuda.shape_ok(128, 8, 3, 4, False, 4096)  # an 8-bit pair table is 256 KB
    assert not cuda.shape_ok(128, 4, 4, 17, False, 4096)
    assert not cuda.shape_ok(256, 4, 4, 16, False, 4096)
    assert not cuda.shape_ok(128, 4, 4, 4, True, 4096)
    assert not cuda.shape_ok(128, 4, 4, 4, False, 15)
    assert not cuda.shape_ok(96, 4, 4, 4, False, 4096)


def test_fast_serves_takes_symbolic_sizes_under_compile():
    """Under torch.compile with dynamic shapes the query rows and packed slots are symbolic: the shape check becomes
    guards and only the machine's answer is a traced constant (a symbolic argument to it failed to compile)."""
    from tq_hf_cache.kernels.select import cuda_serves as fast_serves

    def f(x):
        if fast_serves(x.device, 128, 4, 4, 4 * x.shape[1], False, x.shape[0]):
            return x + 1
        return x * 2

    step = torch.compile(f, dynamic=True, fullgraph=True, backend="eager")
    for shape in ((20, 3), (33, 2)):
        torch.testing.assert_close(step(torch.ones(shape)), torch.full(shape, 2.0))


def test_the_launcher_runs_without_a_gpu(monkeypatch):
    """decode_attention's whole fast path on the CPU up to the launch (kernel stubbed): the prepared arguments, the
    grid (the exact copies' CTA beside the packed splits), the shared memory, and the by-value parameter block."""
    import contextlib
    import ctypes

    from tq_hf_cache.kernels import decode_attention as da

    done = []

    class Stub:
        def __init__(self, name, df, smem):
            self.name, self.df, self.smem = name, df, smem

        def launch(self, grid, block, params, stream):
            done.append((self.name, grid, block, self.smem, ctypes.sizeof(params), self.df))

    monkeypatch.setattr(jit, "kernel", lambda src, name, df, device, smem=0: Stub(name, df, smem))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: type("S", (), {"cuda_stream": 0})())
    # (four queries of a GQA group of 4, 16 rows, one CTA an SM: the plan counts 132 CTAs, not 264; on 8 SMs, k4v4 at
    # head dim 64 takes 16 warps where the layout's are 8: `choose`)
    for b, lq, kb, vb, d, n, sms in ((1, 3000, 5, 3, 128, 1, 132), (3, 700, 4, 2, 64, 1, 132),
                                     (2, 900, 3, 3, 256, 1, 132), (40, 300, 4, 4, 128, 1, 132),
                                     (40, 2000, 5, 3, 128, 4, 132), (1, 30000, 4, 4, 64, 1, 8)):
        monkeypatch.setattr(support, "sm_count", lambda dev, s=sms: s)
        state, _, _ = make_state(b, 2, lq, 9, n, d, kb, vb, torch.bfloat16, lq, device="cpu")
        q = torch.randn(b, 8, n, d, dtype=torch.bfloat16)
        done.clear()
        cuda.decode_attention(q, state)  # (the CUDA launcher itself: no selection on a CPU)
        nqt, rows = (1, 4) if n == 1 else (2, 16)
        w = cuda.warps(d, kb, vb, state.k_norms.dtype == torch.float32, state.v_norms.dtype == torch.float32, nqt,
                       (9, 0))
        w, splits, fold = cuda.choose(b * 2, lq, torch.device("cpu"), None, d, nqt, w)
        assert (w, splits, fold) == (16, 4, cuda.EXACT_TOKENS) or sms == 132, (w, splits, fold)
        assert n == 1 or splits < cuda.plan(b * 2, lq, torch.device("cpu"), warps=w, head_dim=d)[0]  # (two CTAs)
        parts = cuda.exact_parts(b * 2, splits, fold, state.sinks + 9, torch.device("cpu"), d, nqt, w)
        assert [x[:3] for x in done] == [(cuda.NAME, (b * 2, splits + (0 if fold else parts), 1), 32 * w)], done
        df = done[0][5]  # (a Hadamard rotation: the butterflies, one channel group in the merge)
        assert df["HAD"] == 1 and df["XB"] % 16 == 0 and df["NXMAX"] == parts and df["MDIRECT"] == (d <= 128), df
        assert df["FOLD"] == int(fold > 0), df  # (the last case folds: its build keeps the folded CTA's code)
        assert done[0][3] >= max(cuda.exact_smem(d, rows, df["XB"], 2, w), cuda.merge_splits(d, rows, 0, w, True)[1],
                                 cuda.query_bytes(d)), done
        assert done[0][4] == ctypes.sizeof(cuda.Params), done


@pytest.mark.parametrize("d", [64, 128, 256])
def test_query_rotation_fragments_land_in_the_score_mma_registers(d):
    """The query rotation's B operand (`pi_fragments`), read as mma.m16n8k16 reads B (lane (g, l4): k-slots 2 l4,
    2 l4 + 1 and + 8 of column g, k-slot 2 l4 + 8 j + h of k-step kk being input channel l4 D/4 + 4 kk + 2 j + h, as
    the kernel's A registers hold the query), gives output n-tiles whose accumulators are, lane by lane, the score
    MMA's A registers of k-step s (n-tiles 2s, 2s + 1: channels l4 D/4 + 4s + {0, 1} and + {2, 3} of rows g, g + 8)."""
    seed = fresh_seed()
    g_ = torch.Generator().manual_seed(seed)
    pi = torch.linalg.qr(torch.randn(d, d, generator=g_))[0]
    q = torch.randn(16, d, generator=g_)
    f = cuda.pi_fragments(pi).view(torch.float16).float().reshape(d // 8, 32, d // 16, 2, 2)  # [nt, lane, kk, j, h]
    b = torch.zeros(d // 8, d, 8)  # B of n-tile nt: (channel in, column)
    for lane in range(32):
        g, l4 = divmod(lane, 4)
        for kk in range(d // 16):
            for j in range(2):
                for h in range(2):
                    b[:, l4 * (d // 4) + 4 * kk + 2 * j + h, g] = f[:, lane, kk, j, h]
    c = torch.einsum("rc,tcn->rtn", q, b)  # (rows, n-tile, column)
    want = q @ pi.t()  # (Pi q_r)[x]
    for s in range(d // 16):
        for l4 in range(4):
            for e in range(2):
                for t, off in ((2 * s, 0), (2 * s + 1, 2)):
                    got, exp = c[:, t, 2 * l4 + e], want[:, l4 * d // 4 + 4 * s + off + e]
                    assert torch.allclose(got, exp, atol=2e-3, rtol=2e-3), (seed, d, s, l4, e, t)


# --------------------------------------------------------------------------------------------------- on a GPU

def _decode(q, state, mask, scale, fast=None, **kw):
    """The kernel `select` picks for the step (the CUDA one where it serves); fast=False: the Triton kernel alone."""
    from tq_hf_cache import ops
    from tq_hf_cache.kernels.decode_attention import decode_attention

    if fast is False:
        return decode_attention(q, state, mask, scale, **kw)
    return ops.decode_attention(q, state, mask, scale, **kw)


@pytest.fixture
def launches(monkeypatch):
    calls = []
    real = cuda.decode

    def spy(*a, **k):
        ok = real(*a, **k)
        calls.append(ok)
        return ok

    monkeypatch.setattr(cuda, "decode", spy)
    return calls


# (kbits, vbits, d, group, n, lq, lr, dtype, mask, sinks, per_head)
GPU_CASES = [
    (5, 3, 128, 4, 1, 4001, 17, torch.bfloat16, None, 4, False),
    (4, 4, 128, 4, 1, 3001, 3, torch.float16, None, 0, True),
    (4, 2, 128, 8, 1, 2500, 128, torch.bfloat16, "bool", 4, False),
    (2, 2, 128, 4, 4, 777, 9, torch.float16, "additive", 2, False),
    (3, 5, 64, 3, 3, 1203, 5, torch.float16, "bool", 0, True),
    (5, 3, 64, 1, 16, 900, 0, torch.bfloat16, None, 1, False),
    (2, 4, 64, 8, 2, 517, 2, torch.float16, "additive", 3, False),
    (3, 3, 128, 2, 7, 64, 1, torch.bfloat16, "bool", 0, False),
    (5, 3, 256, 2, 1, 2049, 7, torch.bfloat16, None, 4, False),
    (4, 4, 256, 4, 2, 1500, 3, torch.float16, "bool", 2, True),
    (3, 2, 256, 8, 1, 700, 0, torch.bfloat16, "additive", 0, False),
    (5, 5, 128, 16, 1, 999, 4, torch.float16, None, 0, False),
    (5, 5, 128, 4, 1, 1500, 6, torch.bfloat16, None, 2, False),  # fewer than 4 table copies: the scalar table fill
    (4, 3, 64, 5, 3, 16, 2, torch.float16, None, 0, False),
    (4, 4, 128, 4, 1, 17, 2, torch.bfloat16, "bool", 17, False),  # every packed token a sink but 0
    (5, 3, 128, 4, 1, 2000, 520, torch.float16, "bool", 3, False),  # exact copies in several staged batches
    (4, 4, 256, 2, 1, 1000, 300, torch.bfloat16, None, 2, False),
    (5, 2, 64, 2, 2, 3333, 40, torch.bfloat16, "additive", 2, True),  # 16 warps at head dim 64
    (4, 4, 128, 2, 1, 2222, 7, torch.float16, None, 0, False),  # 2 rows: four lanes a column in the merge
    (4, 2, 128, 4, 1, 1800, 33, torch.float32, "bool", 2, False),  # fp32 query and copies: the exact copies by warps
    # the exact copies in parts (`cuda.exact_parts`, one CTA an SM): fp32 by warps in 4 parts; 2 parts, the second
    # from the sinks into the window; four causal queries in 3 parts; an additive mask in 2 parts
    (4, 2, 256, 2, 1, 1000, 300, torch.float32, None, 2, False),
    (3, 3, 256, 2, 1, 600, 21, torch.bfloat16, "bool", 40, False),
    (5, 3, 128, 4, 4, 1200, 100, torch.bfloat16, None, 2, False),
    (4, 2, 256, 4, 2, 900, 70, torch.float16, "additive", 3, False),
    # more splits than the merge loads at once (`cuda.merge_direct`): 32 of 8 warps on the H100, two loads a thread
    (4, 4, 128, 4, 1, 20000, 5, torch.bfloat16, None, 2, False),
]


def _gpu_id(c):
    return f"k{c[0]}v{c[1]}-d{c[2]}-g{c[3]}-n{c[4]}-lq{c[5]}-lr{c[6]}-{str(c[7])[6:]}-{c[8]}-sinks{c[9]}" + \
        ("-ph" if c[10] else "") + "".join(f"-{x}" for x in c[11:])


# a dense rotation (rotation="orthogonal"): the query and the merge rotate by Pi, not by butterflies
DENSE_CASES = [
    (5, 3, 128, 4, 1, 3001, 9, torch.bfloat16, "bool", 4, False),
    (4, 4, 64, 2, 3, 1500, 2, torch.float16, None, 0, True),
    (4, 2, 128, 8, 2, 700, 5, torch.float16, "additive", 2, False),
    (5, 3, 256, 2, 1, 2049, 7, torch.bfloat16, None, 4, False),  # two k-steps of Pi a warp, four channel groups
    (4, 4, 256, 2, 1, 1000, 120, torch.bfloat16, None, 2, False),  # the exact copies in 3 parts
]


@gpu
@pytest.mark.parametrize("case", GPU_CASES + [(*c, "orthogonal") for c in DENSE_CASES], ids=_gpu_id)
def test_fast_kernel_matches_the_oracle_and_the_triton_kernel(case, launches):
    kbits, vbits, d, group, n, lq, lr, dtype, mask_kind, sinks, per_head = case[:11]
    rotation = case[11] if len(case) > 11 else "auto"
    seed = fresh_seed()
    b, hkv = 2, 2
    hq = hkv * group
    state, kf, vf = make_state(b, hkv, lq, lr, n, d, kbits, vbits, dtype, seed, per_head, sinks=sinks,
                               rotation=rotation)
    assert cuda.hadamard(state.rotation) == (rotation == "auto"), rotation
    q = make_query(b, hq, n, d, dtype, seed)
    t = lq + lr + n
    mask = None if mask_kind is None else padding_mask(b, 1, n, t, [min(4, lq), 0], mask_kind)
    scale = 0.7 * d**-0.5
    out = torch.full((b, n, hq, d), float("nan"), dtype=dtype, device="cuda")
    _decode(q, state, mask, scale, out=out)
    assert launches == [True], f"seed {seed}: the fast kernel did not serve ({launches})"
    assert torch.isfinite(out).all(), f"seed {seed}: unwritten or non-finite outputs"
    ref = reference.attention(q.cpu(), kf, vf, mask=None if mask is None else mask.cpu(), scale=scale).transpose(1, 2)
    err = rel_err(out, ref)
    assert err < TOL[dtype], f"seed {seed}: relative error {err:.2e} against the oracle"
    from tq_hf_cache import kernels

    if kernels.decode_supports(d, kbits, vbits, n, group):  # (head dim 256 at byte widths: the fast kernel only)
        tri = _decode(q, state, mask, scale, fast=False)
        assert rel_err(out, tri.float().cpu()) < TOL[dtype], f"seed {seed}: fast and Triton kernels differ"


# the query's fragments in registers, two k-steps a quad (`cuda.qpair`, forced here at any split's length): head dim
# 128, one query n-tile
QPAIR_CASES = [c for c in GPU_CASES + [(*c, "orthogonal") for c in DENSE_CASES] if c[2] == 128 and c[3] * c[4] <= 8]


@gpu
@pytest.mark.parametrize("case", QPAIR_CASES, ids=_gpu_id)
def test_fast_kernel_with_two_k_steps_of_the_query_a_register_quad(case, launches, monkeypatch):
    monkeypatch.setattr(cuda, "QPAIR_TOKENS", 0)
    built, real = [], cuda.jit.kernel
    monkeypatch.setattr(cuda.jit, "kernel",
                        lambda src, name, df, *a: built.append(df["QPAIR"]) or real(src, name, df, *a))
    test_fast_kernel_matches_the_oracle_and_the_triton_kernel(case, launches)
    assert built and all(built), built


# 16-warp shapes over long splits on a GPU taken as 8 SMs: the last split's CTA takes the exact copies (none at all in
# the second: no window, no sinks)
FOLD_CASES = [
    (5, 3, 128, 4, 1, 13000, 40, torch.bfloat16, "bool", 3, False),
    (5, 5, 64, 2, 1, 12500, 0, torch.float16, None, 0, True),
    (5, 3, 128, 4, 1, 13000, 40, torch.bfloat16, "bool", 3, False, "orthogonal"),
]


@gpu
@pytest.mark.parametrize("case", FOLD_CASES, ids=_gpu_id)
def test_fast_kernel_with_the_exact_copies_in_the_last_split(case, launches, monkeypatch):
    monkeypatch.setattr(support, "sm_count", lambda d: 8)
    plans, real = [], cuda.plan
    monkeypatch.setattr(cuda, "plan", lambda *a, **k: plans.append(real(*a, **k)) or plans[-1])
    test_fast_kernel_matches_the_oracle_and_the_triton_kernel(case, launches)
    assert plans[0] == (2, cuda.EXACT_TOKENS), plans


@gpu
def test_fast_kernel_in_the_sixteen_warps_choose_takes_over_the_layouts_eight(launches, monkeypatch):
    """k4v4 at head dim 64 (the layout's two CTAs of 8 warps an SM) on a GPU taken as 16 SMs, over a history long
    enough that `choose` takes one CTA of 16 warps, the exact copies folded into the last split."""
    monkeypatch.setattr(support, "sm_count", lambda d: 16)
    plans, real = [], cuda.choose
    monkeypatch.setattr(cuda, "choose", lambda *a, **k: plans.append(real(*a, **k)) or plans[-1])
    case = (4, 4, 64, 2, 1, 25000, 30, torch.bfloat16, "bool", 2, False)
    test_fast_kernel_matches_the_oracle_and_the_triton_kernel(case, launches)
    assert plans[0] == (16, 4, cuda.EXACT_TOKENS), plans


@gpu
@pytest.mark.parametrize("lq", [5000, 12300])
def test_fast_kernel_where_the_sms_cut_sixteen_warp_splits_at_head_dim_64(lq, launches, monkeypatch):
    """k5v3 at head dim 64 (the layout's one CTA of 16 warps an SM) on a GPU taken as 8 SMs, where the SMs cut the
    splits: `choose` takes two CTAs of 8 warps an SM and an exact copies' CTA a head at 5000 tokens, and past the
    long splits `plan` folds itself (12300) one CTA of 16 warps a split, the exact copies in the last of 2."""
    monkeypatch.setattr(support, "sm_count", lambda d: 8)
    plans, real = [], cuda.choose
    monkeypatch.setattr(cuda, "choose", lambda *a, **k: plans.append(real(*a, **k)) or plans[-1])
    case = (5, 3, 64, 1, 1, lq, 30, torch.bfloat16, "bool", 4, False)
    test_fast_kernel_matches_the_oracle_and_the_triton_kernel(case, launches)
    if lq == 5000:
        assert plans[0] == (8, 3, 0), plans
    else:
        assert plans[0] == (16, 2, cuda.EXACT_TOKENS), plans
        assert cuda.split_range(1, 2, lq, plans[0][2])[0] == 7168


@gpu
@pytest.mark.parametrize("d,group,n,mask_kind", [(128, 4, 16, None), (128, 4, 13, "bool"), (256, 2, 9, "additive"),
                                                 (64, 8, 5, None)])
def test_more_query_rows_than_the_kernel_holds_go_in_chunks_of_queries(d, group, n, mask_kind, launches):
    """A step of n queries whose group x n rows pass the kernel's limit: the kernel serves it a few queries a call
    (each with its mask rows, or its own causal mask), matching the oracle."""
    from tq_hf_cache.kernels.select import query_chunk

    seed = fresh_seed()
    b, hkv, lq, lr = 2, 2, 1500, 5
    state, kf, vf = make_state(b, hkv, lq, lr, n, d, 4, 3, torch.bfloat16, seed)
    q = make_query(b, hkv * group, n, d, torch.bfloat16, seed)
    t = lq + lr + n
    mask = None if mask_kind is None else padding_mask(b, 1, n, t, [3, 0], mask_kind)
    per = query_chunk(q, state)
    assert per == cuda.max_rows(d) // group
    out = _decode(q, state, mask, None)
    assert launches == [True] * -(-n // per), f"seed {seed}: {launches}"
    ref = reference.attention(q.cpu(), kf, vf, mask=None if mask is None else mask.cpu()).transpose(1, 2)
    assert rel_err(out, ref) < TOL[torch.bfloat16], f"seed {seed}"


@gpu
@pytest.mark.parametrize("kbits,vbits", [(5, 3), (4, 4)])
@pytest.mark.parametrize("holes", ["none", "scattered", "a_stretch"])
def test_fast_kernel_one_mask_row_for_every_head(kbits, vbits, holes, launches, monkeypatch):
    """A decode step's bool mask, one row per batch row (B, 1, 1, T), read by the packed loop as one row (`holes`:
    none past the causal part, scattered ones in row 1, or a quarter of row 1's history, whole splits among it). The
    first batch row masks none in every case."""
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    b, hkv, group, n, d, lq, lr = 2, 2, 4, 1, 128, 6000, 9
    rows = []
    monkeypatch.setattr(cuda, "_mask_row", lambda *a, f=cuda._mask_row: rows.append(f(*a)) or rows[-1])
    state, kf, vf = make_state(b, hkv, lq, lr, n, d, kbits, vbits, torch.bfloat16, seed, sinks=2)
    q = make_query(b, hkv * group, n, d, torch.bfloat16, seed)
    t = lq + lr + n
    keep = torch.ones(b, 1, 1, t, dtype=torch.bool)
    if holes == "scattered":
        keep[1, 0, 0, :lq] = torch.rand(lq, generator=g) > 0.05
    elif holes == "a_stretch":
        a, e = cuda.split_range(1, 4, lq, False)
        keep[1, 0, 0, a:e] = False
    mask = keep.to("cuda")
    out = _decode(q, state, mask, None)
    assert launches == [True] and rows == [True], f"seed {seed}: {launches} {rows}"
    ref = reference.attention(q.cpu(), kf, vf, mask=keep).transpose(1, 2)
    assert rel_err(out, ref) < TOL[torch.bfloat16], f"seed {seed} ({holes})"


@gpu
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_fast_kernel_mask_that_differs_by_head(kind, launches):
    seed = fresh_seed()
    b, hkv, group, n, d, lq, lr = 2, 2, 3, 2, 128, 1200, 5
    state, kf, vf = make_state(b, hkv, lq, lr, n, d, 4, 3, torch.float16, seed)
    q = make_query(b, hkv * group, n, d, torch.float16, seed)
    t = lq + lr + n
    mask = head_mask(b, hkv * group, n, t, kind, seed)
    out = _decode(q, state, mask, None)
    assert launches == [True]
    ref = reference.attention(q.cpu(), kf, vf, mask=mask.cpu()).transpose(1, 2)
    assert rel_err(out, ref) < TOL[torch.float16], f"seed {seed}"


@gpu
@pytest.mark.parametrize("where", ["packed_norm", "packed_value_norm"])
def test_fast_kernel_propagates_nan_as_sdpa_does(where, launches):
    seed = fresh_seed()
    b, hkv, group, n, d = 1, 2, 2, 1, 128
    state, kf, vf = make_state(b, hkv, 400, 5, n, d, 4, 4, torch.float16, seed)
    norms = state.k_norms if where == "packed_norm" else state.v_norms
    norms[0, 0, 77] = float("nan")
    q = make_query(b, hkv * group, n, d, torch.float16, seed)
    out = _decode(q, state, None, None)
    assert launches == [True]
    assert torch.isnan(out[0, 0, :group].float()).all(), f"seed {seed}: a NaN norm did not give NaN"
    assert torch.isfinite(out[0, 0, group:].float()).all(), f"seed {seed}: the other head is not finite"


@gpu
def test_fast_kernel_is_deterministic_and_graph_capturable():
    seed = fresh_seed()
    state, kf, vf = make_state(2, 4, 20000, 5, 1, 128, 5, 3, torch.bfloat16, seed, sinks=4)
    q = make_query(2, 16, 1, 128, torch.bfloat16, seed)
    first = _decode(q, state, None, None)
    out = torch.empty_like(first)
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _decode(q, state, None, None, out=out)  # warm
        with torch.cuda.graph(graph, stream=s):
            _decode(q, state, None, None, out=out)
    torch.cuda.current_stream().wait_stream(s)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(first, out), f"seed {seed}: the replay differs"


@gpu
def test_fast_kernel_on_two_streams_at_once():
    seed = fresh_seed()
    s1, kf1, vf1 = make_state(1, 2, 30000, 3, 1, 128, 5, 3, torch.float16, seed)
    s2, kf2, vf2 = make_state(1, 2, 20000, 3, 1, 128, 4, 4, torch.float16, seed + 1)
    q1, q2 = make_query(1, 8, 1, 128, torch.float16, seed), make_query(1, 8, 1, 128, torch.float16, seed + 1)
    side = torch.cuda.Stream()
    for _ in range(5):
        o1 = _decode(q1, s1, None, None)
        with torch.cuda.stream(side):
            o2 = _decode(q2, s2, None, None)
        torch.cuda.synchronize()
        assert rel_err(o1, reference.attention(q1.cpu(), kf1, vf1).transpose(1, 2)) < TOL[torch.float16]
        assert rel_err(o2, reference.attention(q2.cpu(), kf2, vf2).transpose(1, 2)) < TOL[torch.float16]


@gpu
def test_turned_off_by_the_environment(monkeypatch, launches):
    seed = fresh_seed()
    state, kf, vf = make_state(1, 2, 300, 3, 1, 128, 4, 4, torch.float16, seed)
    q = make_query(1, 8, 1, 128, torch.float16, seed)
    monkeypatch.setenv(select.ENV, "triton")
    _decode(q, state, None, None)
    assert launches == []
    monkeypatch.delenv(select.ENV)
    _decode(q, replace(state), None, None)
    assert launches == [True]


@pytest.mark.skipif(not _nvrtc_ok(), reason="NVRTC missing")
def test_compile_errors_name_the_defines():
    with pytest.raises(jit.JitError, match=r"(?s)'D': 7.*broken"):
        jit.compile_cubin(cuda.source() + "\n#error broken\n", cuda.NAME, {"D": 7}, 90)


@pytest.mark.skipif(not _nvrtc_ok(), reason="NVRTC missing")
@pytest.mark.parametrize("damage", ["truncated", "flipped", "swapped"])
def test_a_damaged_cached_kernel_is_compiled_again(damage, monkeypatch, tmp_path):
    """The disk cache binds each cubin to its key: a half-written, corrupted or swapped file is refused (with a warning
    naming it) and replaced by a fresh compile, never loaded."""
    monkeypatch.setenv("TQ_HF_CACHE_KERNEL_DIR", str(tmp_path))
    df = cuda.defines(64, 4, 4, 1, 0, 0, False, False, False, 16, True)
    first = jit.cubin(cuda.source(), cuda.NAME, df, 90)
    (path,) = glob.glob(str(tmp_path / "*.cubin"))
    raw = open(path, "rb").read()
    assert raw.endswith(first)
    assert jit.cubin(cuda.source(), cuda.NAME, df, 90) == first  # a sound entry is read back as is
    if damage == "truncated":
        bad = raw[:-100]
    elif damage == "flipped":
        bad = raw[:-1] + bytes([raw[-1] ^ 1])
    else:  # another key's entry under this name
        other = jit.cubin(cuda.source(), cuda.NAME, {**df, "VB": 3}, 90)
        bad = next(open(p, "rb").read() for p in glob.glob(str(tmp_path / "*.cubin")) if p != path)
        assert bad.endswith(other)
    with open(path, "wb") as f:
        f.write(bad)
    with pytest.warns(RuntimeWarning, match="does not match its digest"):
        again = jit.cubin(cuda.source(), cuda.NAME, df, 90)
    assert again == first and open(path, "rb").read() == raw


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("TQ_HF_CACHE_KERNEL_DIR", str(tmp_path))
    assert disk_cache.cache_dir() == str(tmp_path)
    assert not glob.glob(str(tmp_path / "*"))


@gpu
@pytest.mark.parametrize("preset", ["k5v3", "k4v4"])
def test_static_cache_through_the_fast_kernel_matches_the_triton_kernel_eager_and_compiled(preset, monkeypatch):
    """TurboQuantStaticCache through the fast kernel (device lengths, the wrapping window, the fused chunk and the
    steps, teacher-forced): logits equal those of the Triton kernel (TQ_HF_CACHE_DECODE_KERNEL=triton) on the same cache,
    eager and under torch.compile's CUDA graphs."""
    import transformers

    from tq_hf_cache import TurboQuantStaticCache
    from tq_hf_cache._compat import IS_V5

    from conftest import with_cache

    if not IS_V5:
        pytest.skip("TurboQuantStaticCache needs transformers >= 5")
    cfg = transformers.LlamaConfig(num_hidden_layers=2, vocab_size=128, hidden_size=256, intermediate_size=256,
                                   num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                                   max_position_embeddings=8192)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval().to("cuda", torch.bfloat16)
    model.set_attn_implementation("turboquant")
    ids = torch.randint(3, 128, (2, 3006), device="cuda", generator=torch.Generator("cuda").manual_seed(1))

    def run(env, compiled):
        monkeypatch.setenv(select.ENV, {"0": "triton", "1": "auto"}[env])
        cache = TurboQuantStaticCache(config=cfg, max_cache_len=4096, tq_config=preset, residual_length=64)
        step = torch.compile(model, mode="reduce-overhead", fullgraph=True) if compiled else model
        out = []
        with torch.no_grad():
            model(ids[:, :2990], **with_cache(cache))
            out.append(model(ids[:, 2990:3000], **with_cache(cache)).logits[:, -1])
            for i in range(3000, 3006):
                pos = torch.tensor([i], device="cuda")
                out.append(step(ids[:, i:i + 1], **with_cache(cache), cache_position=pos,
                                position_ids=pos[None].expand(2, 1)).logits[:, -1].clone())  # graphs reuse outputs
        return torch.stack(out).float()

    ref = run("0", False)
    for compiled in (False, True):
        got = run("1", compiled)
        torch.testing.assert_close(got, ref, atol=3e-2, rtol=3e-2,
                                   msg=lambda m: f"{preset}, compiled={compiled}: fast vs Triton: {m}")


PAIR_GPU_CASES = [  # (kbits, vbits, d, group, n, lq, lr, dtype, mask, sinks, per_head): pair codes
    (4, 2, 64, 3, 1, 2000, 17, torch.float16, None, 4, False),
    (4, 2, 128, 4, 1, 3001, 9, torch.bfloat16, "bool", 0, True),
    (4, 2, 128, 4, 4, 1200, 100, torch.bfloat16, None, 2, False),
    (3, 3, 128, 8, 1, 700, 5, torch.float16, "additive", 4, False),
    (2, 2, 256, 2, 1, 2049, 7, torch.bfloat16, None, 4, False),
]


@gpu
@pytest.mark.parametrize("case", PAIR_GPU_CASES, ids=_gpu_id)
def test_fast_kernel_reads_pair_codes(case, launches):
    kbits, vbits, d, group, n, lq, lr, dtype, mask_kind, sinks, per_head = case
    seed = fresh_seed()
    b, hkv = 2, 2
    hq = hkv * group
    state, kf, vf = make_state(b, hkv, lq, lr, n, d, kbits, vbits, dtype, seed, per_head, sinks=sinks, codes="pair")
    q = make_query(b, hq, n, d, dtype, seed)
    t = lq + lr + n
    mask = None if mask_kind is None else padding_mask(b, 1, n, t, [min(4, lq), 0], mask_kind)
    scale = 0.7 * d**-0.5
    out = torch.full((b, n, hq, d), float("nan"), dtype=dtype, device="cuda")
    _decode(q, state, mask, scale, out=out)
    assert launches == [True], f"seed {seed}: the fast kernel did not serve ({launches})"
    assert torch.isfinite(out).all(), f"seed {seed}: unwritten or non-finite outputs"
    ref = reference.attention(q.cpu(), kf, vf, mask=None if mask is None else mask.cpu(), scale=scale).transpose(1, 2)
    err = rel_err(out, ref)
    assert err < TOL[dtype], f"seed {seed}: relative error {err:.2e} against the oracle"
