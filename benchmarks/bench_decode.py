"""Decode step through the model after a real chunked prefill, on a Llama-3.1-8B-shaped model with random bf16
weights (32 layers, 32 query heads, 8 KV heads, head dim 128), one process, four rows per (batch, context), each
measured by `tq_hf_cache.tools.bench.run_row` (the code behind `tq-hf-cache bench`):

- dynamic:        DynamicCache, sdpa, eager
- static_compiled: StaticCache, sdpa, torch.compile(mode="reduce-overhead", fullgraph=True) (CUDA graphs)
- tq_fused:       TurboQuantCache, attn_implementation="turboquant" (fused kernel), eager
- tq_static_compiled: TurboQuantStaticCache, "turboquant", torch.compile(mode="reduce-overhead", fullgraph=True)

Per row: prefill in chunks of --chunk tokens through the model (eager, timed), then --warmup steps (the compile
and graph capture happen there; timed as warmup_s), then --steps decode steps each timed on the host after a
synchronize (wall ms, median), then a few steps under torch.profiler for the GPU time per step (sum of the
kernels' device time). Peak memory over the model across prefill and decode. A last check runs
`model.generate()` with each static cache (transformers' own compile path) at batch 1 and each of
--generate_contexts prompt lengths, the two measured in turns (--generate_reps), and reports ms per new token.

Usage: python benchmarks/bench_decode.py [--contexts 4096,32768,131072] [--batches 1,8]
       [--generate_contexts 4096] [--out DIR]
Writes DIR/bench_decode.json, bench_decode.png (the rows) and bench_decode_generate.png (the generate() check).

Tensor parallel (`--tp`): the compiled static caches (rows static_compiled and tq_static_compiled, interleaved as
`tq_hf_cache.tools.bench.decode_bench` does) on a checkpoint loaded with `tp_plan="auto"` over the ranks of torchrun, or
on one GPU when the world size is 1; each rank holds its share of the KV heads. Rank 0 writes
DIR/bench_decode_tp{world size}.json (cache MiB of every rank); --plot_tp merges such files (any world sizes,
any contexts) into DIR/bench_decode_tp.json and its PNG:

    python benchmarks/bench_decode.py --save_random /tmp/llama8b            # random bf16 weights, 16 GB
    torchrun --nproc-per-node 1 benchmarks/bench_decode.py --tp --model /tmp/llama8b --contexts 32768,131072
    torchrun --nproc-per-node 2 benchmarks/bench_decode.py --tp --model /tmp/llama8b --contexts 32768,131072
    python benchmarks/bench_decode.py --plot_tp DIR/bench_decode_tp1.json,DIR/bench_decode_tp2.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import transformers  # noqa: E402

import tq_hf_cache  # noqa: E402
import tq_hf_cache.hf.distributed  # noqa: E402
from tq_hf_cache import TurboQuantStaticCache, bench, cache_kwargs  # noqa: E402

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
p.add_argument("--generate_reps", type=int, default=4, help="turns of the generate() check (both caches each turn)")
p.add_argument("--budget_s", type=float, default=560)
p.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
p.add_argument("--tp", action="store_true", help="tensor parallel mode (under torchrun): needs --model")
p.add_argument("--model", help="--tp: the checkpoint folder (see --save_random)")
p.add_argument("--repeats", type=int, default=3, help="--tp: interleaved repetitions per row")
p.add_argument("--plot_tp", help="only merge these bench_decode_tp*.json (comma-separated) into one JSON and a PNG")
p.add_argument("--save_random", metavar="DIR", help="only save a random bf16 Llama-3.1-8B-shaped checkpoint (--layers)")
a = p.parse_args()
T0 = time.time()
DEV = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")  # CPU: --tp's plumbing over gloo


def log(*x):
    print(f"[{time.time() - T0:6.1f}s]", *x, flush=True)


def save_random(folder: str) -> None:
    bench.random_llama_8b(a.layers, DEV).save_pretrained(folder)
    log(f"saved a random {a.layers}-layer Llama-3.1-8B-shaped checkpoint to {folder}")


def plot_tp(runs: list[dict], path: str) -> None:
    """ms per token of each compiled static cache, one bar per world size, grouped by context."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted(runs, key=lambda r: r["env"]["world_size"])
    ctxs = sorted({r["context"] for run in runs for r in run["rows"]})
    bars = [(run["env"]["world_size"], row) for row in ("static_compiled", "tq_static_compiled") for run in runs]
    fig, ax = plt.subplots(figsize=(2 + 2.2 * len(ctxs), 4))
    width = 0.8 / len(bars)
    for i, (ws, row) in enumerate(bars):
        run = next(r for r in runs if r["env"]["world_size"] == ws)
        ys = [next((r["wall_ms"] for r in run["rows"] if r["row"] == row and r["context"] == c), 0) for c in ctxs]
        name = "StaticCache" if row == "static_compiled" else f"TurboQuantStaticCache {tq_hf_cache.DEFAULT_PRESET}"
        ax.bar([x + i * width for x in range(len(ctxs))], ys, width, label=f"{name}, {ws} GPU{'s' * (ws > 1)}")
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(ctxs))], [f"1 x {c // 1024}k" for c in ctxs])
    ax.set_ylabel("ms per token (compiled step, median)")
    ax.set_title(f"{runs[-1]['env']['device']}: tensor parallel, Llama-3.1-8B shape, {runs[-1]['env']['layers']} layers")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_tp() -> None:
    """The --tp mode: every rank runs the same interleaved rows (their collectives pair up); rank 0 writes."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if DEV.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if world > 1:
        model = transformers.AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16, tp_plan="auto")
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16).to(DEV)
    model.eval()
    rows = a.rows if a.rows != ",".join(bench.GPU_ROWS) else "static_compiled,tq_static_compiled"
    contexts = [int(x) for x in a.contexts.split(",")]
    out = bench.decode_bench(model, rows.split(","), contexts, batch=1, steps=a.steps, warmup=a.warmup,
                             repeats=a.repeats, chunk=a.chunk, preset=tq_hf_cache.DEFAULT_PRESET,
                             progress=rank == 0, agree=False,
                             on_row=lambda r: log(f"rank {rank}", r) if rank == 0 else None)
    mine = [r.get("cache_MiB") for r in out]
    every = [None] * world
    if world > 1:
        torch.distributed.all_gather_object(every, mine)
    else:
        every = [mine]
    for i, r in enumerate(out):
        r["cache_MiB_per_rank"] = [e[i] for e in every]
    if rank == 0:
        res = {"env": {"device": torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu", "world_size": world, "torch": torch.__version__,
                       "transformers": transformers.__version__, "layers": model.config.num_hidden_layers,
                       "kv_heads": model.config.num_key_value_heads, "chunk": a.chunk,
                       "preset": tq_hf_cache.DEFAULT_PRESET, "steps": a.steps, "repeats": a.repeats},
               "rows": out}
        path = os.path.join(a.out, f"bench_decode_tp{world}.json")
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
        log("wrote", path)


def merge_tp(paths: list[str]) -> None:
    """One run per world size (rows of the same world size from several files joined), then the plot."""
    runs: dict[int, dict] = {}
    for path in paths:
        with open(path) as f:
            run = json.load(f)
        ws = run["env"]["world_size"]
        if ws in runs:
            if runs[ws]["env"] != run["env"]:
                raise SystemExit(f"{path}: its env {run['env']} differs from another world-size-{ws} file's")
            runs[ws]["rows"] += run["rows"]
        else:
            runs[ws] = run
        seen = [(r["row"], r["context"]) for r in runs[ws]["rows"]]
        if len(seen) != len(set(seen)):
            raise SystemExit(f"{path}: a row and context measured twice for world size {ws}: {sorted(seen)}")
    merged = {"runs": [runs[ws] for ws in sorted(runs)], "files": [os.path.basename(x) for x in paths]}
    with open(os.path.join(a.out, "bench_decode_tp.json"), "w") as f:
        json.dump(merged, f, indent=1)
    plot_tp(merged["runs"], os.path.join(a.out, "bench_decode_tp.png"))
    log("wrote", os.path.join(a.out, "bench_decode_tp.json"), "and .png")


if a.save_random:
    save_random(a.save_random)
    sys.exit(0)
if a.plot_tp:
    merge_tp(a.plot_tp.split(","))
    sys.exit(0)
if a.tp:
    if not a.model:
        p.error("--tp needs --model DIR (a checkpoint; --save_random DIR makes one)")
    try:
        run_tp()
    finally:
        tq_hf_cache.hf.distributed.shutdown()  # the compiled steps' CUDA graphs first: they hold NCCL communicators
    sys.exit(0)

cfg = bench.llama_8b_config(a.layers)
torch.manual_seed(0)
with torch.device(DEV):
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
rows = bench.check_rows(a.rows.split(","), DEV)


def generate_check(ctx: int, reps: int, short: int = 16, long: int = 272) -> dict:
    """transformers' own compile path: generate() with a compileable cache compiles the decode step. ms per new token =
    the time `long - short` more new tokens take (best of two calls each), so the prefill, the same in both, drops
    out. StaticCache (sdpa) and TurboQuantStaticCache ("turboquant") are compiled first (the first call of each,
    compile included, is reported), then measured in turns, `reps` times, so that drift on the shared host hits
    both alike; the ratio is taken per turn."""
    gc.collect()
    torch.cuda.empty_cache()
    torch._dynamo.reset()
    ids = torch.randint(0, cfg.vocab_size, (1, ctx), device=DEV)
    caches = {"StaticCache": (transformers.StaticCache, "sdpa"), "TurboQuantStaticCache": (TurboQuantStaticCache, "turboquant")}

    def run(name, new):
        cls, impl = caches[name]
        model.set_attn_implementation(impl)
        cache = cls(config=cfg, max_cache_len=ctx + long + 8)
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = model.generate(ids, **cache_kwargs(model, cache), max_new_tokens=new, min_new_tokens=new, do_sample=False)
        torch.cuda.synchronize()
        assert out.shape[1] == ctx + new
        return time.perf_counter() - t

    first = {name: round(run(name, short), 2) for name in caches}
    ms = {name: [] for name in caches}
    for _ in range(reps):
        for name in caches:
            t_short = min(run(name, short) for _ in range(2))
            t_long = min(run(name, long) for _ in range(2))
            ms[name].append(round((t_long - t_short) / (long - short) * 1e3, 3))
    ratios = [round(t / s, 3) for t, s in zip(ms["TurboQuantStaticCache"], ms["StaticCache"])]
    return {"context": ctx, "new_tokens": [short, long], "first_call_s": first, "ms_per_new_token": ms,
            "ratio_per_turn": ratios, "ratio_median": sorted(ratios)[len(ratios) // 2],
            "ratio_mean": round(sum(ratios) / len(ratios), 3)}


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
    for ctx in [int(x) for x in a.generate_contexts.split(",")]:
        try:
            r = generate_check(ctx, a.generate_reps)
            results["generate"].append(r)
            log(r)
        except Exception as e:
            results["errors"].append({"generate": ctx, "error": f"{type(e).__name__}: {e}"[:2000]})
            log("generate", ctx, "ERROR", type(e).__name__, str(e)[:2000])
        save()


def plot_generate(rows: list[dict], path: str) -> None:
    """Bars of ms per new token through generate() (median of the turns), one group per prompt length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(5, 2 + 2 * len(rows)), 4))
    for i, name in enumerate(("StaticCache", "TurboQuantStaticCache")):
        ys = [sorted(r["ms_per_new_token"][name])[len(r["ms_per_new_token"][name]) // 2] for r in rows]
        ax.bar([x + i * 0.4 for x in range(len(rows))], ys, 0.4, label=f"{name} + compile")
    ax.set_xticks([x + 0.2 for x in range(len(rows))], [f"{r['context']} tokens" for r in rows])
    ax.set_ylabel("ms per new token, generate() (median)")
    ax.set_title(f"{results['env']['device']}: batch 1, Llama-3.1-8B shape")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if results["rows"]:
    bench.plot(results["rows"], os.path.join(a.out, "bench_decode.png"),
               f"{results['env']['device']}: decode step, Llama-3.1-8B shape")
if results["generate"]:
    plot_generate(results["generate"], os.path.join(a.out, "bench_decode_generate.png"))
