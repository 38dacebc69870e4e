"""TurboQuantStaticCache against transformers' StaticCache on tiny Llama / Qwen3 / Gemma3 (sliding) models: 8-bit
logits close at every step and the same greedy tokens; torch.compile(fullgraph=True) equal to eager; crop, reset,
reuse; switching the attention implementation mid-generation; bad arguments refused."""

import os
import re

import pytest
import torch
import transformers

from tq_hf_cache import TurboQuantStaticCache, TurboQuantStaticLayer, kernels
from tq_hf_cache._compat import IS_V5
from tq_hf_cache.quant.packed_kv import MAX_FUSED_QUERIES
from tq_hf_cache.kernels import select
from conftest import with_cache

pytestmark = pytest.mark.skipif(not IS_V5, reason="TurboQuantStaticCache needs transformers >= 5")

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

BASE = dict(vocab_size=128, hidden_size=128, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
EIGHT_BIT = dict(key_bits=8, value_bits=8, residual_length=6, sink_tokens=2)
PROMPT, NEW, CAP = 40, 12, 64


def build(name, seed=0):
    kw = dict(BASE)
    if name == "llama":
        cfg, cls = transformers.LlamaConfig(num_hidden_layers=2, **kw), transformers.LlamaForCausalLM
    elif name == "qwen3":
        cfg, cls = transformers.Qwen3Config(num_hidden_layers=2, **kw), transformers.Qwen3ForCausalLM
    else:  # "gemma3", or "gemma3-256": Gemma 3's own head dim
        if name == "gemma3-256":
            kw["head_dim"] = 256
        cfg = transformers.Gemma3TextConfig(num_hidden_layers=4, sliding_window=16, query_pre_attn_scalar=64,
                                            layer_types=["sliding_attention", "full_attention"] * 2, **kw)
        cls = transformers.Gemma3ForCausalLM
    torch.manual_seed(seed)
    return cfg, cls(cfg).eval()


def prompt(batch=1, length=PROMPT, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (batch, length), generator=g)


def greedy(model, cache, ids, new=NEW):
    out = model.generate(ids, **with_cache(cache), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits, 1)


@pytest.mark.parametrize("impl", ["sdpa", "turboquant"])
@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3", "gemma3-256"])
def test_eight_bit_static_cache_tracks_static_cache(name, impl, monkeypatch):
    monkeypatch.setattr(kernels.support, "WIDE_MIN_KEY_ROWS", 0)  # head dim 256: the fused kernel at this small capacity too
    cfg, model = build(name)
    model.set_attn_implementation(impl)
    ids = prompt(batch=2)
    want_seq, want = greedy(model, transformers.StaticCache(config=cfg, max_cache_len=CAP), ids)
    bits = dict(key_bits=7, value_bits=7) if name == "gemma3-256" else {}  # the kernel's widths at head dim 256
    cache = TurboQuantStaticCache(cfg, max_cache_len=CAP, **{**EIGHT_BIT, **bits})
    got_seq, got = greedy(model, cache, ids)
    assert any(isinstance(l, TurboQuantStaticLayer) and l.is_initialized for l in cache.layers)
    if impl == "turboquant":  # the fused op serves every quantized layer, head dim 256 included
        assert all(l._fused(1) for l in cache.layers if isinstance(l, TurboQuantStaticLayer))
    torch.testing.assert_close(got, want, atol=0.05, rtol=0, msg=lambda m: f"{name}/{impl} logits per step: {m}")
    assert torch.equal(got_seq, want_seq), f"{name}/{impl}: greedy tokens differ"


def test_fewer_bits_drift_further_from_static_cache():
    """At 2 bits the cache must differ from StaticCache (else the test above could not fail), and the same
    layer quantizes: more bits, closer logits."""
    cfg, model = build("llama")
    ids = prompt()
    _, want = greedy(model, transformers.StaticCache(config=cfg, max_cache_len=CAP), ids)
    err = {}
    for bits in (2, 8):
        cache = TurboQuantStaticCache(cfg, max_cache_len=CAP, key_bits=bits, value_bits=bits, residual_length=4)
        err[bits] = (greedy(model, cache, ids)[1] - want).abs().max().item()
    assert err[2] > 4 * err[8] > 0, err


@pytest.mark.parametrize("impl", ["sdpa", "turboquant"])
def test_compiled_fullgraph_decode_equals_eager(impl):
    cfg, model = build("gemma3")
    model.set_attn_implementation(impl)
    ids = prompt(batch=2)
    steps = []
    for compiled in (False, True):
        torch._dynamo.reset()
        cache = TurboQuantStaticCache(cfg, max_cache_len=CAP, residual_length=4, sink_tokens=2)
        forward = torch.compile(model.forward, backend="aot_eager", fullgraph=True) if compiled else model.forward
        logits = []
        with torch.no_grad():
            tok = model(ids, **with_cache(cache)).logits[:, -1:].argmax(-1)
            for i in range(5):
                pos = torch.tensor([PROMPT + i])
                out = forward(tok, **with_cache(cache), cache_position=pos, position_ids=pos.expand(2, 1))
                logits.append(out.logits)
                tok = out.logits[:, -1:].argmax(-1)
        steps.append(torch.cat(logits, 1))
    torch.testing.assert_close(steps[1], steps[0], atol=1e-4, rtol=0, msg=lambda m: f"compiled vs eager ({impl}): {m}")


def test_switching_attention_mid_generation_changes_nothing():
    cfg, model = build("llama")
    ids = prompt()
    runs = []
    for schedule in (["turboquant"] * 6, ["turboquant", "sdpa", "turboquant", "eager", "sdpa", "turboquant"]):
        cache = TurboQuantStaticCache(cfg, max_cache_len=CAP, residual_length=4, sink_tokens=2)
        logits = []
        with torch.no_grad():
            model.set_attn_implementation(schedule[0])
            tok = model(ids, **with_cache(cache)).logits[:, -1:].argmax(-1)
            for i, impl in enumerate(schedule):
                model.set_attn_implementation(impl)
                out = model(tok, **with_cache(cache), position_ids=torch.tensor([[PROMPT + i]]))
                logits.append(out.logits)
                tok = out.logits[:, -1:].argmax(-1)
        runs.append(torch.cat(logits, 1))
    model.set_attn_implementation("sdpa")
    torch.testing.assert_close(runs[1], runs[0], atol=1e-4, rtol=0, msg=lambda m: f"switched vs not: {m}")


def test_reset_reuse_and_crop():
    cfg, model = build("llama")
    ids = prompt(length=30)
    cache = TurboQuantStaticCache(cfg, max_cache_len=CAP, residual_length=4, sink_tokens=2)
    first = greedy(model, cache, ids)[1]
    cache.reset()
    assert int(cache.get_seq_length()) == 0
    torch.testing.assert_close(greedy(model, cache, ids)[1], first, atol=0, rtol=0, msg=lambda m: f"after reset: {m}")

    # crop back to the prompt, then continue: equal to a fresh cache fed the prompt (within 8-bit error: the
    # cropped cache keeps fewer tokens exact, as its window lost the cropped ones' slots)
    fresh = TurboQuantStaticCache(cfg, max_cache_len=CAP, **EIGHT_BIT)
    with torch.no_grad():
        want = model(ids, **with_cache(fresh)).logits
        tail = prompt(length=8, seed=1)
        want_next = model(tail, **with_cache(fresh)).logits
        cache = TurboQuantStaticCache(cfg, max_cache_len=CAP, **EIGHT_BIT)
        model(ids, **with_cache(cache))
        model(prompt(length=10, seed=2), **with_cache(cache))
        assert int(cache.get_seq_length()) == 40
        cache.crop(-10)
        assert int(cache.get_seq_length()) == 30
        got_next = model(tail, **with_cache(cache)).logits
    torch.testing.assert_close(got_next, want_next, atol=0.05, rtol=0, msg=lambda m: f"after crop(-10): {m}")
    assert want.shape[1] == 30


def test_memory_is_a_fraction_of_static_cache():
    cfg, model = build("llama")
    cap = 2048
    cache = TurboQuantStaticCache(cfg, max_cache_len=cap)
    with torch.no_grad():
        model(prompt(length=8), **with_cache(cache))
    static = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cap * cfg.head_dim * 4  # float32 model
    nb = cache.nbytes()
    assert nb["packed"] + nb["residual"] + nb["sinks"] == nb["total"]
    assert nb["total"] < 0.5 * static, (nb, static)


def test_bad_arguments_are_refused_before_anything_changes():
    cfg, model = build("llama")
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="max_cache_len must be a positive integer"):
            TurboQuantStaticCache(cfg, max_cache_len=bad)
    with pytest.raises(ValueError, match="max_batch_size"):
        TurboQuantStaticCache(cfg, max_cache_len=8, max_batch_size=0)
    cache = TurboQuantStaticCache(cfg, max_cache_len=CAP, max_batch_size=1)
    with pytest.raises(ValueError, match="batch 2 exceeds max_batch_size=1"):
        model(prompt(batch=2), **with_cache(cache))
    assert not any(getattr(l, "is_initialized", False) for l in cache.layers)
    with pytest.raises(ValueError, match="key_bits"):
        TurboQuantStaticCache(cfg, max_cache_len=CAP, key_bits=9)


def test_overflowing_the_capacity_is_refused_in_eager_mode():
    cfg, model = build("llama")
    cache = TurboQuantStaticCache(cfg, max_cache_len=20)
    with torch.no_grad():
        model(prompt(length=15), **with_cache(cache))
        with pytest.raises(ValueError, match="6 new tokens after 15 exceed max_cache_len=20"):
            model(prompt(length=6), **with_cache(cache))
        assert int(cache.get_seq_length()) == 15


def _cache_tensor_guards(cache_cls, **kw) -> int:
    """Tensor guards a compiled decode step installs on the cache (dynamo's guard tree, printed)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    cfg, model = build("llama")
    torch._dynamo.reset()
    cache = cache_cls(config=cfg, max_cache_len=CAP, **kw)
    forward = torch.compile(model.forward, backend="eager", fullgraph=True)
    with torch.no_grad():
        tok = model(prompt(), **with_cache(cache)).logits[:, -1:].argmax(-1)
        pos = torch.tensor([PROMPT])
        forward(tok, **with_cache(cache), cache_position=pos, position_ids=pos[None])
    f, entries = model.forward.__func__, []
    while not entries and f is not None:
        entries = _debug_get_cache_entry_list(f.__code__)
        f = getattr(f, "__wrapped__", None)
    assert len(entries) == 1, f"expected one compiled frame, found {len(entries)}"
    guards = str(entries[0].guard_manager).splitlines()
    arg = f"['{next(iter(with_cache(cache)))}']"  # the cache as the step's argument, under this release's name
    return sum("TENSOR_MATCH" in g and arg in g for g in guards)


def test_a_compiled_step_checks_few_tensors_per_layer():
    """Every tensor a compiled step reads from the cache is guarded (and, under CUDA graphs, checked as an input) at
    every step: a static layer must stay near StaticCache's two (its one buffer and two windows), not one per part."""
    ours = _cache_tensor_guards(TurboQuantStaticCache, residual_length=4, sink_tokens=2)
    theirs = _cache_tensor_guards(transformers.StaticCache)
    layers = build("llama")[0].num_hidden_layers
    assert theirs >= 2 * layers, theirs  # the count works: StaticCache's keys and values per layer
    assert ours <= theirs + layers + 3, (ours, theirs)  # + the buffer per layer, the shared scratch and counters


def test_a_compiled_step_appends_into_each_buffer_in_place():
    """The step's mask reads the length held (a view of layer 0's buffer) before layer 0's append; where that read
    is left to run after the append, inductor copies the whole buffer (hundreds of MB at long context) twice a step
    to keep the old value. The generated code allocates no buffer of a layer's size, and its steps equal eager's."""
    from torch._inductor.utils import run_and_get_code

    from tq_hf_cache.quant.packed_kv import PACKED_ATTR

    cfg, model = build("llama")
    model.set_attn_implementation("turboquant")
    ids, steps, codes = prompt(), [], []
    for compiled in (False, True):
        torch._dynamo.reset()
        cache = TurboQuantStaticCache(cfg, max_cache_len=CAP, residual_length=4, sink_tokens=2)
        forward = torch.compile(model.forward, backend="inductor", fullgraph=True) if compiled else model.forward
        with torch.no_grad():
            tok = model(ids, **with_cache(cache)).logits[:, -1:].argmax(-1)
            logits = []
            for i in range(3):
                pos = torch.tensor([PROMPT + i])
                kw = dict(**with_cache(cache), cache_position=pos, position_ids=pos[None])
                if compiled:  # (the generated code of the step that compiles; none after)
                    out, code = run_and_get_code(forward, tok, **kw)
                    codes += code
                else:
                    out = forward(tok, **kw)
                logits.append(out.logits)
                tok = out.logits[:, -1:].argmax(-1)
        steps.append(torch.cat(logits, 1))
    sizes = {getattr(l.keys, PACKED_ATTR).store.numel() for l in cache.layers}
    code = "\n".join(codes)
    assert "static_append" in code, "the compiled step has no append: the check below would not see a copy"
    copies = [n for n in sizes if re.search(rf"empty_strided_\w+\(\({n}, \)", code)]
    assert not copies, f"the compiled step allocates a copy of a layer's {copies[0]}-byte buffer"
    torch.testing.assert_close(steps[1], steps[0], atol=1e-4, rtol=0, msg=lambda m: f"compiled vs eager: {m}")


@pytest.mark.parametrize("head_dim, preset", [(64, "k5v3"), (64, "k8v4"), (128, "k5v3"), (128, "k4v4"), (128, "k8v4")])
def test_the_kernel_runs_on_a_long_static_cache_with_its_own_plan(head_dim, preset, monkeypatch):
    """The fused kernel itself (interpreted on a CPU) on a static cache whose capacity allows many splits: the cache's
    scratch must hold what the launcher's plan (`kernels.decode_plan`: stages and programs per SM, per head dim and
    widths) asks for at the most queries it serves at once (a chunk of MAX_FUSED_QUERIES), and the chunk's and the
    steps' logits are those of SDPA on the same cache."""
    from tq_hf_cache import ops

    if not kernels.available():
        pytest.skip("no Triton here")
    monkeypatch.setenv(select.ENV, "triton")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = transformers.LlamaConfig(num_hidden_layers=1, **{**BASE, "head_dim": head_dim})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval().to(dev)
    cap = 65536  # 2 heads x 64k rows: the plans of many key rows (6-8 programs per SM ask for more splits than 4)
    ids = prompt(length=20 + MAX_FUSED_QUERIES).to(dev)
    logits = {}
    for impl in ("sdpa", "turboquant"):
        model.set_attn_implementation(impl)
        cache = TurboQuantStaticCache(config=cfg, max_cache_len=cap, tq_config=preset, residual_length=4)
        with torch.no_grad():
            model(ids[:, :20], **with_cache(cache))
            out = [model(ids[:, 20:], **with_cache(cache)).logits[0]]  # the fused path's widest chunk
            for i in range(2):
                pos = torch.tensor([ids.shape[1] + i], device=dev)
                tok = out[-1][-1:].argmax(-1, keepdim=True)
                out.append(model(tok, **with_cache(cache), cache_position=pos, position_ids=pos[None]).logits[0])
        logits[impl] = torch.cat(out)
    torch.testing.assert_close(logits["turboquant"], logits["sdpa"], atol=2e-2, rtol=2e-2,
                               msg=lambda m: f"kernel vs sdpa, head dim {head_dim}, {preset}: {m}")


@pytest.mark.parametrize("skip", [[], [0]], ids=["quantized", "first-layer-exact"])
def test_an_eager_prefill_attends_over_the_positions_held(skip, monkeypatch):
    """A prefill chunk (or an eager step under another attention) sees the positions held, not max_cache_len: its
    keys are that long, one mask fits every full-attention layer (quantized or kept exact), and the logits are
    those of the max_cache_len path, which a compiled step keeps."""
    from tq_hf_cache import static_cache

    cfg, model = build("llama")
    model.set_attn_implementation("sdpa")
    ids = prompt(length=PROMPT + 4)
    seen = []
    real_full = TurboQuantStaticLayer._full

    def recording(self, k, v, *rest):
        out = real_full(self, k, v, *rest)
        seen.append(out[0].shape[2])
        return out

    monkeypatch.setattr(TurboQuantStaticLayer, "_full", recording)

    def run(held: bool):
        monkeypatch.setattr(static_cache, "held_only", lambda cfg, n: held)  # eager either way: the rule's choice
        cache = TurboQuantStaticCache(config=cfg, max_cache_len=4 * CAP, skip_layers=skip, **EIGHT_BIT)
        with torch.no_grad():
            chunks = [model(ids[:, s: min(s + 16, PROMPT)], **with_cache(cache)).logits for s in range(0, PROMPT, 16)]
            steps = [model(ids[:, t: t + 1], **with_cache(cache)).logits for t in range(PROMPT, ids.shape[1])]
        return torch.cat(chunks + steps, 1)

    capacity = run(False)
    assert set(seen) == {4 * CAP}
    seen.clear()
    held = run(True)
    want = [min(s + 16, PROMPT) for s in range(0, PROMPT, 16)] + list(range(PROMPT + 1, ids.shape[1] + 1))
    assert seen == [n for n in want for _ in range(2 - len(skip))], seen
    torch.testing.assert_close(held, capacity, rtol=1e-5, atol=1e-5, msg="logits, held positions vs max_cache_len")


@pytest.mark.parametrize("attn", ["sdpa", "turboquant"])
def test_chunked_prefill_logits_equal_dynamic_cache_at_every_chunk(attn):
    """The prefill path, chunk by chunk (odd chunk sizes, a chunk wider than the fused attention takes): with nothing
    quantized (exact windows longer than the prompt) TurboQuantCache gives DynamicCache's logits bit for bit at every
    chunk and the steps after it; TurboQuantStaticCache gives them to rounding (its keys come from a slice of its
    buffers and its mask is always explicit: another SDPA path, as transformers' StaticCache's own)."""
    from transformers import DynamicCache

    from tq_hf_cache import TurboQuantCache

    cfg, model = build("llama")
    ids = prompt(batch=2, length=PROMPT + 3)
    cuts = [0, 7, 8, 8 + MAX_FUSED_QUERIES + 5, PROMPT]

    def run(cache, impl):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            out = [model(ids[:, a:b], **with_cache(cache)).logits for a, b in zip(cuts, cuts[1:])]
            out += [model(ids[:, t: t + 1], **with_cache(cache)).logits for t in range(PROMPT, ids.shape[1])]
        return out

    want = run(DynamicCache(config=cfg), "sdpa")
    for cache in (TurboQuantCache(config=cfg, residual_length=1000),
                  TurboQuantStaticCache(config=cfg, max_cache_len=CAP, residual_length=CAP)):
        got = run(cache, attn)
        exact = isinstance(cache, TurboQuantCache)
        for i, (g, w) in enumerate(zip(got, want)):
            what = f"{type(cache).__name__} ({attn}): logits of call {i} against DynamicCache's"
            if exact:
                assert torch.equal(g, w), what
            else:
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


def test_an_eager_chunk_reads_the_device_length_once_per_forward(monkeypatch):
    """A read of a device tensor's value stops the host until the GPU has caught up; an eager prefill chunk reads
    the static layers' length once (for the mask) and every layer takes it from there, not once or twice a layer.
    Direct updates without a mask still read their own length, and the logits stay those of the per-layer reads."""
    import traceback

    cfg, model = build("llama")
    ids = prompt(length=PROMPT)
    model.set_attn_implementation("sdpa")

    def run(count: bool, skip=()):
        cache = TurboQuantStaticCache(config=cfg, max_cache_len=CAP, skip_layers=list(skip), **EIGHT_BIT)
        reads = []
        real = torch.Tensor.__int__

        def probe(self):
            if traceback.extract_stack(limit=2)[0].filename.endswith("static_cache.py"):  # its own reads
                reads.append(1)
            return real(self)

        with torch.no_grad():
            model(ids[:, :16], **with_cache(cache))
            if count:
                monkeypatch.setattr(torch.Tensor, "__int__", probe)
            out = model(ids[:, 16:], **with_cache(cache)).logits
            monkeypatch.setattr(torch.Tensor, "__int__", real)
        return out, len(reads), cache

    for skip in ((), (0,)):
        want, _, _ = run(False, skip)
        got, reads, cache = run(True, skip)
        assert cfg.num_hidden_layers > 1 and reads == 1, f"{reads} device reads in one forward (skip {skip})"
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # updates without a mask (no note): each layer reads its own length, and slices by it
    layer = cache.layers[1]
    k = torch.randn(1, cfg.num_key_value_heads, 3, cfg.head_dim)
    keys, _ = layer.update(k, k.clone())
    assert keys.shape[2] == PROMPT + 3
    keys, _ = layer.update(k, k.clone())
    assert keys.shape[2] == PROMPT + 6
