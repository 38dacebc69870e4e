"""The decode benchmark behind `tq-hf-cache bench` and `benchmarks/bench_decode.py`: milliseconds per decode step
through a model after a real chunked prefill, for each cache and attention, and the ratio to the fastest
full-precision row of the same run.

Rows (a row = cache x attention x execution):

| row                  | cache                   | attention    | execution                                   |
|----------------------|-------------------------|--------------|---------------------------------------------|
| `dynamic`            | DynamicCache            | sdpa         | eager                                       |
| `static_compiled`    | StaticCache             | sdpa         | compile(reduce-overhead, fullgraph): CUDA graphs |
| `tq_sdpa`            | TurboQuantCache(fused_sdpa=False) | sdpa | eager (dequantize into the workspace + SDPA) |
| `tq_fused`           | TurboQuantCache         | turboquant   | eager (fused kernel on CUDA, C kernels on a CPU) |
| `tq_static_compiled` | TurboQuantStaticCache   | turboquant   | compile(reduce-overhead, fullgraph): CUDA graphs |

Compiled rows need CUDA and transformers >= 5. At each context every row is prefilled (`context` tokens in chunks)
and warmed up (`warmup` steps: compilation and graph capture happen there, reported as `warmup_s`); then `repeats`
repetitions each time `steps` steps of every row (wall ms, synchronized on CUDA), the rows in an order rotated per
repetition, so that a slower or faster stretch of the machine lands on every row alike. A row's figure is the median
over repetitions of each repetition's median step, its ratio to the fastest full-precision row is taken within each
repetition; on CUDA a few more steps run under the profiler for the GPU time of a step. `agree` is the fraction of
greedy tokens equal to the `dynamic` row's (same prompt), a sanity check, not a quality measure.
"""

from __future__ import annotations

import gc
import statistics
import time

import torch

from .._compat import cache_kwargs

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


def random_llama_8b(layers: int = 32, device="cpu", dtype: torch.dtype = torch.bfloat16, **config):
    """A LlamaForCausalLM of `llama_8b_config(layers, **config)` with random weights (torch seed 0), built on
    `device` (a GPU: random init of 8B weights takes minutes on a CPU) in `dtype`."""
    import transformers

    torch.manual_seed(0)
    with torch.device(device):
        return transformers.LlamaForCausalLM(llama_8b_config(layers, **config)).to(dtype)


def check_rows(rows, device: torch.device) -> list[str]:
    """The rows as a list; unknown names, or compiled rows off CUDA / on transformers 4.x, are refused by name."""
    from .._compat import IS_V5

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

    from .. import TurboQuantCache

    if row == "dynamic":
        return transformers.DynamicCache(config=config), "sdpa"
    if row == "static_compiled":
        return transformers.StaticCache(config=config, max_cache_len=capacity), "sdpa"
    if row == "tq_sdpa":  # the workspace path: SDPA on the dequantized history
        return TurboQuantCache(preset, config=config, fused_sdpa=False), "sdpa"
    if row == "tq_fused":
        return TurboQuantCache(preset, config=config), "turboquant"
    from ..hf.static_cache import TurboQuantStaticCache

    return TurboQuantStaticCache(config, max_cache_len=capacity, tq_config=preset), "turboquant"


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kernel_events(step, n: int = 4) -> list:
    """The CUDA kernel events of n calls of `step` under torch.profiler, in the order they started."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sorted(ev, key=lambda e: e.time_range.start)


def kernel_times(step, n: int = 4) -> tuple[dict[str, float], dict[str, float]]:
    """(device us, calls) per step of each CUDA kernel name, over n calls of `step` under torch.profiler."""
    import collections

    us, calls = collections.Counter(), collections.Counter()
    for e in kernel_events(step, n):
        us[e.name] += e.device_time / n
        calls[e.name] += 1 / n
    return us, calls


def _gpu_ms_per_step(step, n: int = 4) -> float:
    return sum(kernel_times(step, n)[0].values()) / 1e3


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


def text_prompt_ids(tokenizer, context: int) -> tuple[torch.Tensor, str]:
    """(1, n) token ids of the package text (`tq_hf_cache.tools.texts`) for prompts of up to `context` tokens, and what the
    prompt is. The text holds ~55k SmolLM2 tokens; a longer context repeats it (see `prompt`), as the note says:
    the timings need only the token count, `agree` a real text."""
    from .texts import TEXT_SOURCE, package_text, total_chars

    ids = tokenizer(package_text(min(8 * context, total_chars())), return_tensors="pt")["input_ids"]
    n = ids.shape[-1]
    note = f"{n} tokens of {TEXT_SOURCE}"
    return ids, note + (f", repeated to fill contexts above {n} tokens" if context > n else "")


MIN_STEPS = 3  # timed steps of a repetition: its figure is their median, which needs three samples to mean anything
MIN_REPEATS = 3  # repetitions per row: the row's figure is their median, its spread their range
MIN_WARMUP = 1  # the first decode step allocates the cache's decode buffers
MIN_WARMUP_COMPILED = 3  # compiled rows: compilation, then CUDA graph warm-up and recording, before replays


def check_counts(steps: int, warmup: int, repeats: int, rows) -> None:
    """Refuse step counts that cannot give a meaningful median, naming the option and the allowed range."""
    least_warmup = MIN_WARMUP_COMPILED if any(r in _COMPILED for r in rows) else MIN_WARMUP
    why_warmup = "compiled rows compile and record CUDA graphs there" if least_warmup > MIN_WARMUP else \
        "the first step allocates the decode buffers"
    for option, value, least, why in (
        ("--steps", steps, MIN_STEPS, "a repetition's figure is the median of its steps"),
        ("--repeats", repeats, MIN_REPEATS, "a row's figure is the median of its repetitions"),
        ("--warmup", warmup, least_warmup, why_warmup),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{option} must be an integer >= {least} ({why}), got {value!r}")


def row_label(row: str, preset: str) -> str:
    """The row in user terms: cache class (with its preset), attention, execution."""
    cache, attn = {"dynamic": ("DynamicCache", "sdpa"), "static_compiled": ("StaticCache", "sdpa"),
                   "tq_sdpa": (f"TurboQuantCache {preset} (fused_sdpa=False)", "sdpa"),
                   "tq_fused": (f"TurboQuantCache {preset}", "turboquant attention"),
                   "tq_static_compiled": (f"TurboQuantStaticCache {preset}", "turboquant attention")}[row]
    return f"{cache} + {attn}" + (", compiled" if row in _COMPILED else "")


class _Prepared:
    """One row at one (batch, context), prefilled and warmed up, ready to time more decode steps."""

    def __init__(self, model, row: str, batch: int, context: int, capacity: int, warmup: int, chunk: int,
                 preset: str, text_ids: torch.Tensor | None):
        device = self.device = model.device
        self.model, self.row, self.batch, self.context = model, row, batch, context
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        self.cache, self.attn = _make_cache(row, model.config, capacity, preset)
        model.set_attn_implementation(self.attn)
        ids = prompt(batch, context, model.config.vocab_size, text_ids).to(device)
        _sync(device)
        t = time.perf_counter()
        with torch.no_grad():
            for s in range(0, context, chunk):
                out = model(ids[:, s: s + chunk], **cache_kwargs(model, self.cache), use_cache=True, logits_to_keep=1)
        _sync(device)
        self.prefill_s = time.perf_counter() - t
        self.pos, self.tok = context, out.logits[:, -1:].argmax(-1)
        del out
        self.fwd = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True) if row in _COMPILED \
            else model.forward
        self.tokens = [self.tok.cpu()]
        t = time.perf_counter()
        for _ in range(warmup):
            self.step()
        _sync(device)
        self.warmup_s = time.perf_counter() - t
        self.peak_GiB = (torch.cuda.max_memory_allocated(device) - base) / _GiB if device.type == "cuda" else None

    def step(self) -> None:
        pos = torch.full((1,), self.pos, device=self.device, dtype=torch.long)
        with torch.no_grad():
            o = self.fwd(self.tok, **cache_kwargs(self.model, self.cache), cache_position=pos,
                         position_ids=pos.expand(self.batch, 1), use_cache=True)
        self.tok = o.logits[:, -1:].argmax(-1).clone()
        self.pos += 1
        self.tokens.append(self.tok.cpu())

    def time_steps(self, steps: int) -> list[float]:
        """Wall ms of each of `steps` decode steps (synchronized on CUDA)."""
        self.model.set_attn_implementation(self.attn)
        walls = []
        for _ in range(steps):
            _sync(self.device)
            t = time.perf_counter()
            self.step()
            _sync(self.device)
            walls.append((time.perf_counter() - t) * 1e3)
        return walls

    def figures(self) -> dict:
        res = {"row": self.row, "cache": type(self.cache).__name__, "attn": self.attn, "batch": self.batch,
               "context": self.context, "prefill_s": round(self.prefill_s, 3), "warmup_s": round(self.warmup_s, 2),
               "cache_MiB": round(cache_bytes(self.cache) / 2**20, 2)}
        if self.device.type == "cuda":
            self.model.set_attn_implementation(self.attn)
            res["gpu_ms"] = round(_gpu_ms_per_step(self.step), 3)
            res["peak_GiB_over_model"] = round(self.peak_GiB, 3)
        return res


def run_row(model, row: str, batch: int, context: int, *, steps: int = 20, warmup: int = 3, chunk: int = 8192,
            preset: str = "k5v3", text_ids: torch.Tensor | None = None) -> dict:
    """One row at one (batch, context) on its own: prefill, warm up, time `steps` steps; returns the row's figures
    and its greedy tokens. `decode_bench` interleaves rows instead, which is what a comparison needs."""
    if row in _COMPILED:
        torch._dynamo.reset()
    p = _Prepared(model, row, batch, context, context + warmup + steps + 8, warmup, chunk, preset, text_ids)
    walls = p.time_steps(steps)
    res = {**p.figures(), "wall_ms": round(statistics.median(walls), 3), "wall_ms_min": round(min(walls), 3)}
    if "gpu_ms" in res:
        res["wall_over_gpu"] = round(res["wall_ms"] / res["gpu_ms"], 3) if res["gpu_ms"] else None
    res["_tokens"] = torch.cat(p.tokens, dim=1)
    return res


def _order(rows: list, rep: int) -> list:
    """Repetition `rep`'s order: the rows rotated by `rep`, so each row takes each place in turn."""
    k = rep % len(rows) if rows else 0
    return rows[k:] + rows[:k]


def decode_bench(model, rows, contexts, batch: int = 1, *, steps: int = 20, warmup: int = 3, repeats: int = 5,
                 chunk: int = 8192, preset: str = "k5v3", text_ids: torch.Tensor | None = None, progress: bool = True,
                 on_row=None, agree: bool = True) -> list[dict]:
    """Every row at every context (one process, one model), timed interleaved so that a drift of the machine (clock,
    other load) falls on every row alike: per context all rows are prefilled and warmed up, then each of `repeats`
    repetitions times `steps` steps of every row, in an order rotated by one row per repetition.

    Per row: `wall_ms` the median over the repetitions of each repetition's median step, `wall_ms_reps` those
    figures, `spread_pct` their range over `wall_ms`. `vs_best_baseline`: the median over the repetitions of the
    row's ms over the fastest full-precision row (`dynamic`, `static_compiled`) of the same repetition, with its
    range `vs_best_baseline_range`. With `agree`, the fraction of the row's greedy tokens equal to `dynamic`'s
    (meaningless for random weights, whose logits are nearly flat)."""
    from tqdm.auto import tqdm

    rows = check_rows(rows, model.device)
    check_counts(steps, warmup, repeats, rows)
    capacity = warmup + repeats * steps + 8
    results = []
    bar = tqdm(total=len(contexts) * len(rows) * (repeats + 1), desc="tq-hf-cache bench", disable=not progress,
               unit="run")
    for ctx in contexts:
        if any(r in _COMPILED for r in rows):
            torch._dynamo.reset()
        prepared, failed = {}, []
        for row in rows:
            try:
                prepared[row] = _Prepared(model, row, batch, ctx, ctx + capacity, warmup, chunk, preset, text_ids)
            except torch.cuda.OutOfMemoryError:
                failed.append({"row": row, "label": row_label(row, preset), "batch": batch, "context": ctx,
                               "error": "out of memory"})
                gc.collect()
            bar.update(1)
        reps = {row: [] for row in prepared}
        for rep in range(repeats):
            for row in _order(list(prepared), rep):
                try:
                    reps[row].append(statistics.median(prepared[row].time_steps(steps)))
                except torch.cuda.OutOfMemoryError:
                    del prepared[row], reps[row]
                    failed.append({"row": row, "label": row_label(row, preset), "batch": batch, "context": ctx,
                                   "error": "out of memory"})
                    gc.collect()
                bar.update(1)
        here = []
        for row, p in prepared.items():
            ms = reps[row]
            wall = statistics.median(ms)
            r = {**p.figures(), "label": row_label(row, preset), "wall_ms": round(wall, 3),
                 "wall_ms_reps": [round(x, 3) for x in ms], "spread_pct": round(100 * (max(ms) - min(ms)) / wall, 1)}
            if "gpu_ms" in r:
                r["wall_over_gpu"] = round(wall / r["gpu_ms"], 3) if r["gpu_ms"] else None
            r["_tokens"] = torch.cat(p.tokens, dim=1)
            here.append(r)
        base = [reps[row] for row in prepared if row in BASELINES]
        ref = next((r["_tokens"] for r in here if r["row"] == "dynamic"), None)
        for r in here:
            if base:
                ratios = [x / min(b[i] for b in base) for i, x in enumerate(reps[r["row"]])]
                r["vs_best_baseline"] = round(statistics.median(ratios), 3)
                r["vs_best_baseline_range"] = [round(min(ratios), 3), round(max(ratios), 3)]
            if agree and ref is not None and r["_tokens"].shape == ref.shape:
                r["agree"] = round(float((r["_tokens"] == ref).float().mean()), 3)
            r.pop("_tokens")
        del prepared
        for r in sorted(failed + here, key=lambda r: rows.index(r["row"])):
            results.append(r)
            if on_row is not None:
                on_row(r)
    bar.close()
    return results


def plot(results: list[dict], path: str, title: str) -> None:
    """Bars of wall ms per step (median, whiskers over the repetitions' range), one group per (batch, context), one
    bar per row labelled in user terms; needs matplotlib (the `bench` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if "error" not in r]
    keys = sorted({(r["batch"], r["context"]) for r in ok})
    names = list(dict.fromkeys(r["row"] for r in ok))
    fig, ax = plt.subplots(figsize=(max(7, 2 + 1.8 * len(keys)), 4.5))
    w = 0.8 / max(len(names), 1)
    for i, n in enumerate(names):
        got = [next((r for r in ok if r["row"] == n and (r["batch"], r["context"]) == k), None) for k in keys]
        ys = [r["wall_ms"] if r else 0 for r in got]
        lo = [r["wall_ms"] - min(r.get("wall_ms_reps") or [r["wall_ms"]]) if r else 0 for r in got]
        hi = [max(r.get("wall_ms_reps") or [r["wall_ms"]]) - r["wall_ms"] if r else 0 for r in got]
        label = next(r.get("label", n) for r in ok if r["row"] == n)
        ax.bar([x + i * w for x in range(len(keys))], ys, w, yerr=[lo, hi], capsize=2, label=label)
    ax.set_xticks([x + 0.4 - w / 2 for x in range(len(keys))], [f"batch {b}, {c} tokens" for b, c in keys])
    ax.set_ylabel("wall ms per decode step (median)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    from .eval.report import save_figure

    save_figure(fig, path)
