"""Capacity and time to first token, measured by allocation and by the clock on a Llama-3.1-8B-shaped model (random
bf16 weights, 32 layers) on one GPU.

- Capacity: at --context tokens, the largest batch whose chunked prefill (--chunk tokens per row per forward) and
  --new greedy decode steps run without running out of memory, per cache. The search measures the memory one row
  takes (a batch-1 and a batch-2 run, by `torch.cuda.max_memory_allocated`), runs the predicted largest batch (or
  --start's), gallops up or down from there by 1, 2, 4, ... until a batch that ran and one that did not bracket the
  answer, then bisects: every reported batch ran, and (when "confirmed") the next one up did not. Every cache runs
  under the same allocator settings (--alloc_conf, PYTORCH_CUDA_ALLOC_CONF).
- TTFT: batch 1, chunked prefill of each --ttft_contexts prompt plus the first token, per cache. The first call in the
  process (Triton compiles and autotunes; with --cold_triton 1 into an empty Triton cache) is reported apart from the
  warm calls (median of --repeats).

Caches: "dynamic" (DynamicCache, sdpa) and TurboQuant presets (TurboQuantCache, attn_implementation="turboquant":
the fused kernel for decode steps, dequantize + SDPA for prefill chunks).

Usage: python benchmarks/bench_capacity.py [--context 32768] [--caches dynamic,k5v3,k4v2] [--chunk 2048]
       [--ttft_contexts 32768,131072] [--start k5v3=48,...] [--known_oom k5v3=60,...] [--out DIR]
                                                       writes DIR/bench_capacity.json and .png
       python benchmarks/bench_capacity.py --replot FILE.json     redraws FILE.png
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

p = argparse.ArgumentParser()
p.add_argument("--context", type=int, default=32768)
p.add_argument("--caches", default="dynamic,k5v3,k4v2")
p.add_argument("--chunk", type=int, default=2048)
p.add_argument("--new", type=int, default=16)
p.add_argument("--ttft_contexts", default="32768,131072")
p.add_argument("--ttft_chunk", type=int, default=8192)
p.add_argument("--repeats", type=int, default=2)
p.add_argument("--capacity", type=int, default=1)
p.add_argument("--cold_triton", type=int, default=1, help="start with an empty Triton cache")
p.add_argument("--start", default="", help="CACHE=BATCH,...: the first batch to try instead of the prediction")
p.add_argument("--known_oom", default="", help="CACHE=BATCH,...: a batch already seen to run out of memory")
p.add_argument("--alloc_conf", default="expandable_segments:True",
               help="PYTORCH_CUDA_ALLOC_CONF for every cache of the run ('' = the allocator's defaults)")
p.add_argument("--budget_s", type=float, default=560)
p.add_argument("--out", default=os.environ.get("OUT", "."))
p.add_argument("--replot", default=None, help="redraw the PNG beside this JSON and exit")
a = p.parse_args()


def plot(results, path):
    """Largest batch per cache, and warm TTFT per context and cache."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    caps = [c for c in results["capacity"] if c["largest_batch"]]
    axes[0].bar([c["cache"] for c in caps], [c["largest_batch"] for c in caps], color="tab:blue")
    ctx = caps[0]["context"] // 1024 if caps else 0
    axes[0].set_title(f"largest batch at {ctx}k (chunked prefill + decode)")
    ctxs = sorted({r["context"] for r in results["ttft"]})
    kinds = list(dict.fromkeys(r["cache"] for r in results["ttft"]))
    w = 0.8 / max(1, len(kinds))
    for i, kind in enumerate(kinds):
        ys = [next((r["warm_s"] for r in results["ttft"] if r["cache"] == kind and r["context"] == c), 0) for c in ctxs]
        axes[1].bar([j + i * w for j in range(len(ctxs))], ys, w, label=kind)
    axes[1].set_xticks([j + w * (len(kinds) - 1) / 2 for j in range(len(ctxs))], [f"{c // 1024}k" for c in ctxs])
    axes[1].set_ylabel("s")
    axes[1].set_title("warm time to first token, batch 1")
    axes[1].legend()
    fig.suptitle(f"Llama-3.1-8B shape, bf16, {results['env']['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if a.replot:  # only redraw the plot of a JSON (e.g. one merged from several runs)
    with open(a.replot) as f:
        plot(json.load(f), os.path.splitext(a.replot)[0] + ".png")
    sys.exit(0)
if a.cold_triton:
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton_cold_")
if a.alloc_conf:
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = a.alloc_conf


def per_cache(spec: str) -> dict:
    """'k5v3=48,dynamic=13' -> {'k5v3': 48, 'dynamic': 13}."""
    out = {}
    for item in filter(None, spec.split(",")):
        kind, _, batch = item.partition("=")
        if not batch.isdigit() or int(batch) < 3:
            raise SystemExit(f"expected CACHE=BATCH with BATCH >= 3 (1 and 2 always run), got {item!r}")
        out[kind] = int(batch)
    return out


START, KNOWN_OOM = per_cache(a.start), per_cache(a.known_oom)

import torch  # noqa: E402
import transformers  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tq_hf_cache import bench, cache_kwargs  # noqa: E402

T0 = time.time()
DEV = torch.device("cuda")
GiB = 2**30


def log(*x):
    print(f"[{time.time() - T0:6.1f}s]", *x, flush=True)


cfg = bench.llama_8b_config(32)
torch.manual_seed(0)
with torch.device(DEV):
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
WEIGHTS = torch.cuda.memory_allocated()


def make_cache(kind: str):
    """DynamicCache under sdpa, or TurboQuantCache with preset `kind` under turboquant (bench's `tq_fused` row)."""
    cache, impl = bench._make_cache("dynamic" if kind == "dynamic" else "tq_fused", cfg, a.context, kind)
    model.set_attn_implementation(impl)
    return cache


@torch.no_grad()
def prefill_and_decode(kind: str, batch: int, context: int, chunk: int, new: int) -> dict:
    """One real run: chunked prefill, then `new` greedy steps; times and the peak over the weights."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    ids = torch.randint(0, cfg.vocab_size, (batch, context), device=DEV)
    cache = make_cache(kind)
    try:
        torch.cuda.synchronize()
        t = time.perf_counter()
        for s in range(0, context, chunk):
            logits = model(ids[:, s:s + chunk], **cache_kwargs(model, cache), logits_to_keep=1).logits
        tok = logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        ttft = time.perf_counter() - t
        for _ in range(new):
            tok = model(tok, **cache_kwargs(model, cache)).logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        return {"ttft_s": round(ttft, 3), "peak_GiB": round((torch.cuda.max_memory_allocated() - WEIGHTS) / GiB, 3)}
    finally:
        del cache, ids


TRIALS: dict = {}  # (cache, batch) -> the run's ttft_s and peak_GiB, or "OOM"


def fits(kind: str, batch: int) -> bool:
    try:
        r = prefill_and_decode(kind, batch, a.context, a.chunk, a.new)
    except torch.cuda.OutOfMemoryError:
        log(kind, "batch", batch, "OOM")
        TRIALS[kind, batch] = "OOM"
        return False
    log(kind, "batch", batch, r)
    TRIALS[kind, batch] = r
    return True


def capacity(kind: str) -> dict:
    free = torch.cuda.mem_get_info()[1] - WEIGHTS  # what the weights leave of the whole device
    p1 = prefill_and_decode(kind, 1, a.context, a.chunk, a.new)["peak_GiB"]
    p2 = prefill_and_decode(kind, 2, a.context, a.chunk, a.new)["peak_GiB"]
    per_row = p2 - p1
    guess = max(1, int((free / GiB - (p1 - per_row)) / per_row))
    log(kind, f"per row {per_row:.3f} GiB, fixed {p1 - per_row:.3f} GiB, predicted largest batch {guess}")
    tried = {1: True, 2: True}
    lo, hi = 2, KNOWN_OOM.get(kind)  # the largest batch seen to fit, the smallest seen not to
    if hi is not None:
        tried[hi] = False
    b, step, bracketed = max(START.get(kind, guess), 3), 1, False
    if hi is not None:
        b = min(b, hi - 1)
    while (hi is None or hi - lo > 1) and time.time() - T0 < a.budget_s:
        tried[b] = fits(kind, b)
        if tried[b]:
            lo = b
        else:
            hi = b
        bracketed = bracketed or (tried[b] and hi is not None) or (not tried[b] and lo > 2)
        if hi is None:  # every try so far ran: gallop up
            b = lo + step
        elif not bracketed:  # every try so far ran out of memory: gallop down
            b = max(lo + 1, hi - step)
        else:
            b = (lo + hi) // 2
        step *= 2
    ok = [k for k, v in tried.items() if v]
    largest = max(ok) if ok else None
    return {"cache": kind, "context": a.context, "chunk": a.chunk, "new_tokens": a.new,
            "per_row_GiB": round(per_row, 3),
            "predicted": guess, "tried": {str(k): v for k, v in sorted(tried.items())},
            "trials": {str(b): r for (k, b), r in sorted(TRIALS.items()) if k == kind},
            "largest_batch": largest, "confirmed": largest is not None and tried.get(largest + 1) is False}


results = {"env": {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "transformers": transformers.__version__, "weights_GiB": round(WEIGHTS / GiB, 2),
                   "cold_triton_cache": bool(a.cold_triton), "alloc_conf": a.alloc_conf},
           "ttft": [], "capacity": []}
out_json = os.path.join(a.out, "bench_capacity.json")


def save():
    os.makedirs(a.out, exist_ok=True)
    with open(out_json, "w") as f:
        json.dump(results, f, indent=1)


kinds = a.caches.split(",")
for ctx in [int(x) for x in a.ttft_contexts.split(",") if x]:
    for kind in kinds:
        first = prefill_and_decode(kind, 1, ctx, a.ttft_chunk, 1)["ttft_s"]
        warm = [prefill_and_decode(kind, 1, ctx, a.ttft_chunk, 1)["ttft_s"] for _ in range(a.repeats)]
        r = {"cache": kind, "context": ctx, "chunk": a.ttft_chunk, "first_call_s": first,
             "warm_s": statistics.median(warm), "warm_runs_s": warm}
        results["ttft"].append(r)
        log(r)
        save()
base = {r["context"]: r["warm_s"] for r in results["ttft"] if r["cache"] == "dynamic"}
for r in results["ttft"]:
    if r["context"] in base:
        r["vs_dynamic"] = round(r["warm_s"] / base[r["context"]], 3)
if a.capacity:
    for kind in kinds:
        if time.time() - T0 > a.budget_s:
            log("budget reached; stopping")
            break
        results["capacity"].append(capacity(kind))
        log(results["capacity"][-1])
        save()
    dyn = next((c["largest_batch"] for c in results["capacity"] if c["cache"] == "dynamic"), None)
    for c in results["capacity"]:
        if dyn and c["largest_batch"]:
            c["vs_dynamic"] = round(c["largest_batch"] / dyn, 2)
save()


try:
    plot(results, os.path.join(a.out, "bench_capacity.png"))
except Exception as e:  # noqa: BLE001  (the JSON is the result; a plot failure is reported)
    log("plot failed:", e)
log("wrote", out_json)
for r in results["ttft"]:
    log(r)
for c in results["capacity"]:
    log(c)
