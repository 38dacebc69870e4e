"""The decode benchmark behind `tq-hf-cache bench` and `benchmarks/bench_decode.py`: milliseconds per decode step
through a model after a real chunked prefill, for each cache and attention, and the ratio to the fastest
full-precision row of the same run.

Rows (a row = cache x attention x execution):

| row                  | cache                   | attention    | execution                                   |
|----------------------|-------------------------|--------------|---------------------------------------------|
| `dynamic`            | DynamicCache            | sdpa         | eager                                       |
| `static_compiled`    | StaticCache             | sdpa         | compile(reduce-overhead, fullgraph): CUDA graphs |
| `tq_sdpa`            | TurboQuantCache         | sdpa         | eager (dequantize into the workspace + SDPA) |
| `tq_fused`           | TurboQuantCache         | turboquant   | eager (fused kernel on CUDA, torch math elsewhere) |
| `tq_static_compiled` | TurboQuantStaticCache   | turboquant   | compile(reduce-overhead, fullgraph): CUDA graphs |

Compiled rows need CUDA and transformers >= 5. Each row: prefill `context` random tokens in chunks, `warmup` steps
(compilation and graph capture happen there, reported as `warmup_s`), then `steps` timed steps (median wall ms,
synchronized on CUDA), then on CUDA a few steps under the profiler for the GPU time of a step. `agree` is the
fraction of greedy tokens equal to the `dynamic` row's (same prompt), a sanity check, not a quality measure.
"""

from __future__ import annotations

import gc
import statistics
import time

import torch

from ._compat import cache_kwargs

GPU_ROWS = ("dynamic", "static_compiled", "tq_fused", "tq_static_compiled")
CPU_ROWS = ("dynamic", "tq_sdpa", "tq_fused")
ALL_ROWS = ("dynamic", "static_compiled", "tq_sdpa", "tq_fused", "tq_static_compiled")
BASELINES = ("dynamic", "static_compiled")
_COMPILED = ("static_compiled", "tq_static_compiled")
_GiB = 2**30


def llama_8b_config(layers: int = 32, max_position_embeddings: int = 140_000):
    """A LlamaConfig of the Llama-3.1-8B shape (32 query heads, 8 KV heads, head dim 128; vocabulary 32000) with
    `layers` layers: the model of the GPU benchmarks, with random weights."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=max_position_embeddings, rope_theta=500000.0,
    )


def check_rows(rows, device: torch.device) -> list[str]:
    """The rows as a list; unknown names, or compiled rows off CUDA / on transformers 4.x, are refused by name."""
    from ._compat import IS_V5

    rows = list(rows)
    bad = [r for r in rows if r not in ALL_ROWS]
    if bad:
        raise ValueError(f"unknown bench rows {bad}; choose from {list(ALL_ROWS)}")
    compiled = [r for r in rows if r in _COMPILED]
    if compiled and (device.type != "cuda" or not IS_V5):
        raise ValueError(f"rows {compiled} need CUDA and transformers >= 5 (CUDA graphs); on {device.type} use {list(CPU_ROWS)}")
    if not rows:
        raise ValueError(f"no rows given; choose from {list(ALL_ROWS)}")
    return rows


def _make_cache(row: str, config, capacity: int, preset: str):
    import transformers

    from . import TurboQuantCache

    if row == "dynamic":
        return transformers.DynamicCache(config=config), "sdpa"
    if row == "static_compiled":
        return transformers.StaticCache(config=config, max_cache_len=capacity), "sdpa"
    if row == "tq_sdpa":
        return TurboQuantCache(preset, config=config), "sdpa"
    if row == "tq_fused":
        return TurboQuantCache(preset, config=config), "turboquant"
    from .static_cache import TurboQuantStaticCache

    return TurboQuantStaticCache(config, max_cache_len=capacity, tq_config=preset), "turboquant"


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gpu_ms_per_step(step, n: int = 4) -> float:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    total_us = sum(e.device_time for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return total_us / n / 1e3


def cache_bytes(cache) -> int:
    """Bytes a cache holds: `nbytes()["total"]` for ours, the K/V tensors of transformers' layers."""
    if hasattr(cache, "nbytes"):
        return int(cache.nbytes()["total"])
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def prompt(batch: int, context: int, vocab_size: int, text_ids: torch.Tensor | None = None) -> torch.Tensor:
    """(batch, context) token ids: `text_ids` repeated to length (a real text makes `agree` meaningful), else random
    ids from a fixed seed."""
    if text_ids is None or text_ids.numel() == 0:
        return torch.randint(0, vocab_size, (batch, context), generator=torch.Generator().manual_seed(0))
    flat = text_ids.reshape(-1)
    reps = -(-context // flat.numel())
    return flat.repeat(reps)[:context].expand(batch, context).contiguous()


def run_row(model, row: str, batch: int, context: int, *, steps: int = 20, warmup: int = 3, chunk: int = 8192,
            preset: str = "k5v3", text_ids: torch.Tensor | None = None) -> dict:
    """One row at one (batch, context): prefill, warm up, time; returns the row's figures and its greedy tokens."""
    device = model.device
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    if row in _COMPILED:
        torch._dynamo.reset()
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    cache, attn = _make_cache(row, model.config, context + warmup + steps + 8, preset)
    model.set_attn_implementation(attn)
    ids = prompt(batch, context, model.config.vocab_size, text_ids).to(device)
    _sync(device)
    t = time.perf_counter()
    with torch.no_grad():
        for s in range(0, context, chunk):
            out = model(ids[:, s: s + chunk], **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
    _sync(device)
    prefill_s = time.perf_counter() - t
    state = {"pos": context, "tok": out.logits[:, -1:].argmax(-1)}
    del out
    fwd = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True) if row in _COMPILED else model.forward
    tokens = [state["tok"].cpu()]

    def step():
        pos = torch.full((1,), state["pos"], device=device, dtype=torch.long)
        with torch.no_grad():
            o = fwd(state["tok"], **cache_kwargs(model, cache), cache_position=pos, position_ids=pos.expand(batch, 1),
                    use_cache=True)
        state["tok"] = o.logits[:, -1:].argmax(-1).clone()
        state["pos"] += 1

    t = time.perf_counter()
    for _ in range(warmup):
        step()
        tokens.append(state["tok"].cpu())
    _sync(device)
    warmup_s = time.perf_counter() - t
    walls = []
    for _ in range(steps):
        _sync(device)
        t = time.perf_counter()
        step()
        _sync(device)
        walls.append((time.perf_counter() - t) * 1e3)
        tokens.append(state["tok"].cpu())
    res = {
        "row": row, "cache": type(cache).__name__, "attn": attn, "batch": batch, "context": context,
        "prefill_s": round(prefill_s, 3), "warmup_s": round(warmup_s, 2),
        "wall_ms": round(statistics.median(walls), 3), "wall_ms_min": round(min(walls), 3),
        "cache_MiB": round(cache_bytes(cache) / 2**20, 2),
    }
    if device.type == "cuda":
        res["gpu_ms"] = round(_gpu_ms_per_step(step), 3)
        res["wall_over_gpu"] = round(res["wall_ms"] / res["gpu_ms"], 3) if res["gpu_ms"] else None
        res["peak_GiB_over_model"] = round((torch.cuda.max_memory_allocated(device) - base) / _GiB, 3)
    res["_tokens"] = torch.cat(tokens, dim=1)
    return res


def decode_bench(model, rows, contexts, batch: int = 1, *, steps: int = 20, warmup: int = 3, chunk: int = 8192,
                 preset: str = "k5v3", text_ids: torch.Tensor | None = None, progress: bool = True,
                 on_row=None, agree: bool = True) -> list[dict]:
    """Every row at every context (one process, one model). Each row gets `vs_best_baseline`: its wall ms over the
    fastest full-precision row (`dynamic`, `static_compiled`) at that context, and, with `agree`, the fraction of
    its greedy tokens equal to `dynamic`'s (meaningless for random weights, whose logits are nearly flat)."""
    from tqdm.auto import tqdm

    rows = check_rows(rows, model.device)
    jobs = [(ctx, row) for ctx in contexts for row in rows]
    results = []
    for ctx, row in tqdm(jobs, desc="tq-hf-cache bench", disable=not progress, unit="row"):
        try:
            r = run_row(model, row, batch, ctx, steps=steps, warmup=warmup, chunk=chunk, preset=preset,
                        text_ids=text_ids)
        except torch.cuda.OutOfMemoryError:
            r = {"row": row, "batch": batch, "context": ctx, "error": "out of memory"}
        results.append(r)
        if on_row is not None:
            on_row(r)
    for ctx in contexts:
        here = [r for r in results if r["context"] == ctx and "error" not in r]
        base = [r["wall_ms"] for r in here if r["row"] in BASELINES]
        ref = next((r["_tokens"] for r in here if r["row"] == "dynamic"), None)
        for r in here:
            if base:
                r["vs_best_baseline"] = round(r["wall_ms"] / min(base), 3)
            if agree and ref is not None and r["_tokens"].shape == ref.shape:
                r["agree"] = round(float((r["_tokens"] == ref).float().mean()), 3)
    for r in results:
        r.pop("_tokens", None)
    return results


def plot(results: list[dict], path: str, title: str) -> None:
    """Bars of wall ms per step, one group per (batch, context); needs matplotlib (the `bench` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if "error" not in r]
    keys = sorted({(r["batch"], r["context"]) for r in ok})
    names = list(dict.fromkeys(r["row"] for r in ok))
    fig, ax = plt.subplots(figsize=(max(6, 2 + 1.6 * len(keys)), 4))
    w = 0.8 / max(len(names), 1)
    for i, n in enumerate(names):
        ys = [next((r["wall_ms"] for r in ok if r["row"] == n and (r["batch"], r["context"]) == k), 0) for k in keys]
        ax.bar([x + i * w for x in range(len(keys))], ys, w, label=n)
    ax.set_xticks([x + 0.4 - w / 2 for x in range(len(keys))], [f"batch {b} / {c} tokens" for b, c in keys])
    ax.set_ylabel("wall ms per decode step (median)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    from .eval.report import save_figure

    save_figure(fig, path)
