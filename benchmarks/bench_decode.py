"""Decode step through the model after a real chunked prefill, on a Llama-3.1-8B-shaped model with random bf16
weights (32 layers, 32 query heads, 8 KV heads, head dim 128), one process, four rows per (batch, context):

- dynamic:        DynamicCache, sdpa, eager
- static_compiled: StaticCache, sdpa, torch.compile(mode="reduce-overhead", fullgraph=True) (CUDA graphs)
- tq_eager:       TurboQuantCache, attn_implementation="turboquant" (fused kernel), eager
- tq_static_compiled: TurboQuantStaticCache, "turboquant", torch.compile(mode="reduce-overhead", fullgraph=True)

Per row: prefill in chunks of --chunk tokens through the model (eager, timed), then --warmup steps (the compile
and graph capture happen there; timed as compile_s), then --steps decode steps each timed on the host after a
synchronize (wall ms, median), then a few steps under torch.profiler for the GPU time per step (sum of the
kernels' device time). Peak memory over the weights across prefill and decode. A last check runs
`model.generate()` with each static cache (transformers' own compile path) and reports ms per new token.

Usage: python benchmarks/bench_decode.py [--contexts 4096,32768,131072] [--batches 1,8] [--out DIR]
Writes DIR/bench_decode.json and .png.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import transformers  # noqa: E402

import tq_hf_cache  # noqa: E402
from tq_hf_cache import TurboQuantCache, TurboQuantStaticCache  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--contexts", default="4096,32768,131072")
p.add_argument("--batches", default="1,8")
p.add_argument("--rows", default="dynamic,static_compiled,tq_eager,tq_static_compiled")
p.add_argument("--layers", type=int, default=32)
p.add_argument("--chunk", type=int, default=8192)
p.add_argument("--steps", type=int, default=20)
p.add_argument("--warmup", type=int, default=4)
p.add_argument("--max_tokens", type=int, default=8 * 32768, help="skip (batch, context) beyond batch * context")
p.add_argument("--generate_check", type=int, default=1)
p.add_argument("--budget_s", type=float, default=560)
p.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
a = p.parse_args()
T0 = time.time()
DEV = torch.device("cuda")
GiB = 2**30


def log(*x):
    print(f"[{time.time() - T0:6.1f}s]", *x, flush=True)


cfg = transformers.LlamaConfig(
    vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=a.layers, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=140_000, rope_theta=500000.0,
)
torch.manual_seed(0)
with torch.device(DEV):
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
weights = torch.cuda.memory_allocated()
NEW = a.warmup + a.steps + 6  # decode steps per row (warm-up, timed, profiled)


def make_cache(row, b, ctx):
    cap = ctx + NEW + 8
    if row == "dynamic":
        return transformers.DynamicCache(config=cfg), "sdpa", False
    if row == "static_compiled":
        return transformers.StaticCache(config=cfg, max_cache_len=cap), "sdpa", True
    if row == "tq_eager":
        return TurboQuantCache(config=cfg), "turboquant", False
    return TurboQuantStaticCache(cfg, max_cache_len=cap), "turboquant", True


def gpu_ms_per_step(step, n=4):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    total_us = sum(e.device_time for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return total_us / n / 1e3


def run_row(row, b, ctx):
    gc.collect()
    torch.cuda.empty_cache()
    torch._dynamo.reset()
    torch.cuda.reset_peak_memory_stats()
    cache, impl, compiled = make_cache(row, b, ctx)
    model.set_attn_implementation(impl)
    g = torch.Generator(device=DEV).manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (b, ctx), device=DEV, generator=g)
    torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.no_grad():
        for s in range(0, ctx, a.chunk):
            out = model(ids[:, s : s + a.chunk], past_key_values=cache, use_cache=True, logits_to_keep=1)
    torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t
    tok = out.logits[:, -1:].argmax(-1)
    del out
    fwd = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True) if compiled else model.forward
    state = {"pos": ctx, "tok": tok}

    def step():
        pos = torch.full((1,), state["pos"], device=DEV, dtype=torch.long)
        with torch.no_grad():
            o = fwd(state["tok"], past_key_values=cache, cache_position=pos, position_ids=pos.expand(b, 1),
                    use_cache=True)
        state["tok"] = o.logits[:, -1:].argmax(-1).clone()
        state["pos"] += 1

    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(a.warmup):
        step()
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - t
    walls = []
    for _ in range(a.steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t) * 1e3)
    gpu = gpu_ms_per_step(step)
    res = {
        "row": row, "batch": b, "context": ctx, "prefill_s": round(prefill_s, 3), "warmup_s": round(warm_s, 2),
        "wall_ms": round(statistics.median(walls), 3), "wall_ms_min": round(min(walls), 3),
        "gpu_ms": round(gpu, 3), "peak_GiB_over_weights": round((torch.cuda.max_memory_allocated() - weights) / GiB, 2),
    }
    res["wall_over_gpu"] = round(res["wall_ms"] / res["gpu_ms"], 3) if gpu else None
    if hasattr(cache, "nbytes"):
        res["cache_GiB"] = round(cache.nbytes()["total"] / GiB, 3)
    del cache, fwd
    return res


def generate_check(static_cls, impl, ctx=4096, new=64):
    """transformers' own compile path: generate() with a compileable cache compiles the decode step."""
    gc.collect()
    torch.cuda.empty_cache()
    torch._dynamo.reset()
    model.set_attn_implementation(impl)
    ids = torch.randint(0, cfg.vocab_size, (1, ctx), device=DEV)
    times = []
    for _ in range(2):
        cache = static_cls(config=cfg, max_cache_len=ctx + new + 8)
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = model.generate(ids, past_key_values=cache, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    # the prefill alone, to subtract
    cache = static_cls(config=cfg, max_cache_len=ctx + new + 8)
    torch.cuda.synchronize()
    t = time.perf_counter()
    model.generate(ids, past_key_values=cache, max_new_tokens=1, do_sample=False)
    torch.cuda.synchronize()
    pre = time.perf_counter() - t
    return {"cache": static_cls.__name__, "attn": impl, "context": ctx, "new_tokens": new,
            "first_call_s": round(times[0], 2), "second_call_s": round(times[1], 3),
            "ms_per_new_token": round((times[1] - pre) / (new - 1) * 1e3, 3), "tokens": out.shape[1] - ctx}


results = {"env": {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "transformers": transformers.__version__, "layers": a.layers, "chunk": a.chunk,
                   "preset": tq_hf_cache.DEFAULT_PRESET}, "rows": [], "generate": [], "errors": []}
out_json = os.path.join(a.out, "bench_decode.json")


def save():
    with open(out_json, "w") as f:
        json.dump(results, f, indent=1)


for b in [int(x) for x in a.batches.split(",")]:
    for ctx in [int(x) for x in a.contexts.split(",")]:
        if b * ctx > a.max_tokens:
            continue
        for row in a.rows.split(","):
            if time.time() - T0 > a.budget_s:
                log("budget reached; stopping")
                break
            try:
                r = run_row(row, b, ctx)
                results["rows"].append(r)
                log(r)
            except torch.cuda.OutOfMemoryError as e:
                results["errors"].append({"row": row, "batch": b, "context": ctx, "error": "OOM"})
                log(row, b, ctx, "OOM", str(e)[:200])
            except Exception as e:  # keep the other rows
                results["errors"].append({"row": row, "batch": b, "context": ctx, "error": f"{type(e).__name__}: {e}"[:2000]})
                log(row, b, ctx, "ERROR", type(e).__name__, str(e)[:2000])
            save()

if a.generate_check and time.time() - T0 < a.budget_s:
    for cls, impl in ((transformers.StaticCache, "sdpa"), (TurboQuantStaticCache, "turboquant")):
        try:
            r = generate_check(cls, impl)
            results["generate"].append(r)
            log(r)
        except Exception as e:
            results["errors"].append({"generate": cls.__name__, "error": f"{type(e).__name__}: {e}"[:2000]})
            log("generate", cls.__name__, "ERROR", type(e).__name__, str(e)[:2000])
        save()

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    keys = sorted({(r["batch"], r["context"]) for r in rows})
    names = a.rows.split(",")
    fig, ax = plt.subplots(figsize=(9, 4))
    w = 0.8 / len(names)
    for i, n in enumerate(names):
        ys = [next((r["wall_ms"] for r in rows if r["row"] == n and (r["batch"], r["context"]) == k), 0) for k in keys]
        ax.bar([x + i * w for x in range(len(keys))], ys, w, label=n)
    ax.set_xticks([x + 0.4 - w / 2 for x in range(len(keys))], [f"b{b} / {c // 1024}k" for b, c in keys])
    ax.set_ylabel("wall ms per decode step")
    ax.set_title(f"Llama-3.1-8B shape, bf16, {results['env']['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(a.out, "bench_decode.png"), dpi=120)
except Exception as e:
    log("plot failed:", e)
save()
log("wrote", out_json)
