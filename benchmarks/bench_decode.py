"""Decode step through the model after a real chunked prefill, on a Llama-3.1-8B-shaped model with random bf16
weights (32 layers, 32 query heads, 8 KV heads, head dim 128), one process, four rows per (batch, context), each
measured by `tq_hf_cache.bench.run_row` (the code behind `tq-hf-cache bench`):

- dynamic:        DynamicCache, sdpa, eager
- static_compiled: StaticCache, sdpa, torch.compile(mode="reduce-overhead", fullgraph=True) (CUDA graphs)
- tq_fused:       TurboQuantCache, attn_implementation="turboquant" (fused kernel), eager
- tq_static_compiled: TurboQuantStaticCache, "turboquant", torch.compile(mode="reduce-overhead", fullgraph=True)

Per row: prefill in chunks of --chunk tokens through the model (eager, timed), then --warmup steps (the compile
and graph capture happen there; timed as warmup_s), then --steps decode steps each timed on the host after a
synchronize (wall ms, median), then a few steps under torch.profiler for the GPU time per step (sum of the
kernels' device time). Peak memory over the model across prefill and decode. A last check runs
`model.generate()` with each static cache (transformers' own compile path) at batch 1 and each of
--generate_contexts prompt lengths, and reports ms per new token.

Usage: python benchmarks/bench_decode.py [--contexts 4096,32768,131072] [--batches 1,8]
       [--generate_contexts 4096] [--out DIR]
Writes DIR/bench_decode.json and .png.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import transformers  # noqa: E402

import tq_hf_cache  # noqa: E402
from tq_hf_cache import TurboQuantStaticCache, bench  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--contexts", default="4096,32768,131072")
p.add_argument("--batches", default="1,8")
p.add_argument("--rows", default=",".join(bench.GPU_ROWS))
p.add_argument("--layers", type=int, default=32)
p.add_argument("--chunk", type=int, default=8192)
p.add_argument("--steps", type=int, default=20)
p.add_argument("--warmup", type=int, default=4)
p.add_argument("--max_tokens", type=int, default=8 * 32768, help="skip (batch, context) beyond batch * context")
p.add_argument("--generate_check", type=int, default=1)
p.add_argument("--generate_contexts", default="4096", help="prompt lengths of the generate() check")
p.add_argument("--budget_s", type=float, default=560)
p.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
a = p.parse_args()
T0 = time.time()
DEV = torch.device("cuda")


def log(*x):
    print(f"[{time.time() - T0:6.1f}s]", *x, flush=True)


cfg = bench.llama_8b_config(a.layers)
torch.manual_seed(0)
with torch.device(DEV):
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
rows = bench.check_rows(a.rows.split(","), DEV)


def generate_check(static_cls, impl, ctx=4096, short=32, long=160):
    """transformers' own compile path: generate() with a compileable cache compiles the decode step. ms per new
    token = the time `long - short` more new tokens take (best of two calls each, after a first call that compiles),
    so the prefill, the same in both, drops out."""
    gc.collect()
    torch.cuda.empty_cache()
    torch._dynamo.reset()
    model.set_attn_implementation(impl)
    ids = torch.randint(0, cfg.vocab_size, (1, ctx), device=DEV)

    def run(new):
        cache = static_cls(config=cfg, max_cache_len=ctx + long + 8)
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = model.generate(ids, past_key_values=cache, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        torch.cuda.synchronize()
        assert out.shape[1] == ctx + new
        return time.perf_counter() - t

    first = run(short)
    t_short = min(run(short) for _ in range(2))
    t_long = min(run(long) for _ in range(2))
    return {"cache": static_cls.__name__, "attn": impl, "context": ctx, "new_tokens": [short, long],
            "first_call_s": round(first, 2), "short_call_s": round(t_short, 3), "long_call_s": round(t_long, 3),
            "ms_per_new_token": round((t_long - t_short) / (long - short) * 1e3, 3)}


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
        for row in rows:
            if time.time() - T0 > a.budget_s:
                log("budget reached; stopping")
                break
            try:
                r = bench.run_row(model, row, b, ctx, steps=a.steps, warmup=a.warmup, chunk=a.chunk,
                                  preset=tq_hf_cache.DEFAULT_PRESET)
                r.pop("_tokens")
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
    for ctx, (cls, impl) in itertools.product([int(x) for x in a.generate_contexts.split(",")],
                                              ((transformers.StaticCache, "sdpa"), (TurboQuantStaticCache, "turboquant"))):
        try:
            r = generate_check(cls, impl, ctx)
            results["generate"].append(r)
            log(r)
        except Exception as e:
            results["errors"].append({"generate": cls.__name__, "error": f"{type(e).__name__}: {e}"[:2000]})
            log("generate", cls.__name__, "ERROR", type(e).__name__, str(e)[:2000])
        save()

try:
    bench.plot(results["rows"], os.path.join(a.out, "bench_decode.png"),
               f"Llama-3.1-8B shape, bf16, {results['env']['device']}")
except Exception as e:
    log("plot failed:", e)
save()
log("wrote", out_json)
