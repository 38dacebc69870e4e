"""The house refactor's speed floor: two trees of the package timed on one GPU in the same run, interleaved.

The floor: the compiled step through `generate` (1 x 4k, 1 x 128k, 8 x 32k) and the eager dynamic step (1 x 4k,
1 x 32k) of a Llama-3.1-8B-shaped model (32 layers, random bf16 weights), no row of the tree after the refactor
slower than the tree before by more than 3 %.

Each tree runs in its own processes (PYTHONPATH = that tree, so the two never mix), one process per (tree, rep) that
builds the model once and runs every row; the processes go before, after, before, after, ... (`--order abba`
alternates which goes first). A row's figure per rep is measured inside one process; its figure per tree is the
median over reps; the ratio is after / before of those medians (and per rep, paired).

The harness is this file, the same code for both trees, using only the public API (`TurboQuantCache`,
`TurboQuantStaticCache`, `model.generate`): `tq_hf_cache.tools.bench` is itself part of what the refactor may move.

Rows:
- compiled: a `TurboQuantStaticCache` (k5v3) holding `context` tokens, then `model.generate` with it, which compiles
  the decode step (transformers' own path: torch.compile, CUDA graphs). ms per new token = (time of a generate of
  `long` new tokens - time of one of `short`) / (long - short), so the fixed part of a call drops out; the calls
  continue one sequence on the same cache (no prefill in them: each computes one uncached token, then decodes).
  Two warm calls first (compile, graph capture), then `--turns` pairs; the row's figure is their median. The cache
  is filled (`--fill update`, the default) by `cache.update` with seeded random K/V per layer in chunks, which costs
  no model compute (a 128k prefill through the model takes ~30 s per process; the step's time does not depend on
  what the cache holds); `--fill model` prefills through the model in chunks instead.
- eager: a `TurboQuantCache` (k5v3) with attn_implementation "turboquant", prefilled through the model in chunks
  of `--chunk`, `--warmup` steps, then `--steps` decode steps each timed between synchronizations; the figure is
  their median (ms per step).

Usage, on the GPU machine (the before tree inside the repository, ignored by git, so that it travels as a carried
path):
    git archive e116c1e | tar -x -C .before           # once, here, after mkdir .before
    python benchmarks/bench_house_speed.py --before .before --before-commit e116c1e --after-commit HASH \\
        --reps 2 --budget-s 540 --out $OUT
    python benchmarks/bench_house_speed.py --dry-run --before DIR --out DIR   # CPU: a 2-layer model, small contexts

Writes OUT/bench_house_speed.json (after every process, so a stop keeps what ran) and OUT/bench_house_speed.png.
`--budget-s` bounds the whole run: no process starts that the time left cannot hold (judged by the longest so far,
a pair's two for its first), and a running one is stopped at the budget (its finished rows are kept).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

PRESET = "k5v3"
FLOOR_PCT = 3.0
ROWS = [("eager", 1, 4096), ("eager", 1, 32768), ("compiled", 1, 4096), ("compiled", 1, 131072),
        ("compiled", 8, 32768)]
DRY_ROWS = [("eager", 1, 160), ("eager", 1, 300), ("compiled", 1, 160), ("compiled", 1, 400), ("compiled", 2, 200)]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def row_key(kind: str, batch: int, context: int) -> str:
    return f"{kind}_b{batch}_{context}"


def row_label(kind: str, batch: int, context: int, dry_run: bool = False) -> str:
    """The row in user terms, on three lines: size, cache, how it runs."""
    size = f"{batch} x {context // 1024}k" if context % 1024 == 0 else f"{batch} x {context}"
    if kind == "compiled":
        return f"{size}\nTurboQuantStaticCache\ngenerate, " + ("eager (dry run)" if dry_run else "compiled")
    return f"{size}\nTurboQuantCache\neager step, turboquant"


def plan(reps: int, order: str) -> list[tuple[int, str]]:
    """(rep, tree) in the order the processes run: before, after per rep; `abba` swaps every second rep."""
    out = []
    for rep in range(reps):
        pair = ("after", "before") if order == "abba" and rep % 2 else ("before", "after")
        out += [(rep, tree) for tree in pair]
    return out


# ---- the worker: one process of one tree, every row ----

def _worker(a) -> None:
    import torch
    import transformers

    import tq_hf_cache
    from tq_hf_cache import TurboQuantCache, TurboQuantStaticCache

    pkg = os.path.dirname(os.path.abspath(tq_hf_cache.__file__))
    if os.path.realpath(os.path.dirname(pkg)) != os.path.realpath(a.worker_tree):
        raise SystemExit(f"imported {pkg}, not the tree {a.worker_tree}")
    cuda = torch.cuda.is_available() and not a.dry_run
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if not cuda:
        torch.set_num_threads(1)
    res = {"tree": a.worker_label, "rep": a.worker_rep, "package": pkg, "rows": [],
           "env": {"device": torch.cuda.get_device_name(dev) if cuda else "cpu", "torch": torch.__version__,
                   "transformers": transformers.__version__, "python": sys.version.split()[0]}}

    def save():
        with open(a.worker_out, "w") as f:
            json.dump(res, f, indent=1)

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    def cache_kw(cache) -> dict:
        """The keyword `forward` and `generate` take the cache under: `cache` from transformers 5.24, else
        `past_key_values` (as `tq_hf_cache.cache_kwargs` says; kept here so that the harness is this file)."""
        import inspect

        return {"cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values": cache}

    t = time.perf_counter()
    if a.dry_run:
        cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                       max_position_embeddings=1024)
    else:  # tq_hf_cache.tools.bench.llama_8b_config
        cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                       head_dim=128, max_position_embeddings=140_000, rope_theta=500000.0)
    torch.manual_seed(0)
    with torch.device(dev):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    sync()
    res["model_s"] = round(time.perf_counter() - t, 2)
    res["layers"] = cfg.num_hidden_layers
    save()

    def prompt(batch: int, n: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(n)
        return torch.randint(3, cfg.vocab_size, (batch, n), generator=g).to(dev)

    def prefill(cache, ids):
        out = None
        for s in range(0, ids.shape[1], a.chunk):
            out = model(ids[:, s: s + a.chunk], **cache_kw(cache), use_cache=True, logits_to_keep=1)
        return out.logits[:, -1:].argmax(-1)

    def fill_update(cache, batch: int, n: int) -> None:
        """`n` tokens of seeded random K/V per layer through `cache.update` (the Cache API), in chunks."""
        g = torch.Generator(device=dev).manual_seed(1)
        for s in range(0, n, a.chunk):
            shape = (batch, cfg.num_key_value_heads, min(a.chunk, n - s), cfg.head_dim)
            for layer in range(cfg.num_hidden_layers):
                k = torch.randn(shape, generator=g, device=dev, dtype=dtype)
                v = torch.randn(shape, generator=g, device=dev, dtype=dtype)
                cache.update(k, v, layer)

    def eager_row(batch: int, ctx: int) -> dict:
        model.set_attn_implementation("turboquant")
        cache = TurboQuantCache(PRESET, config=cfg)
        ids = prompt(batch, ctx)
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            tok = prefill(cache, ids)
        sync()
        fill_s = time.perf_counter() - t0
        pos = ctx

        def step():
            nonlocal tok, pos
            p = torch.full((1,), pos, device=dev, dtype=torch.long)
            with torch.no_grad():
                o = model(tok, **cache_kw(cache), cache_position=p, position_ids=p.expand(batch, 1), use_cache=True)
            tok = o.logits[:, -1:].argmax(-1)
            pos += 1

        for _ in range(a.warmup):
            step()
        walls = []
        for _ in range(a.steps):
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            walls.append((time.perf_counter() - t0) * 1e3)
        return {"ms": round(statistics.median(walls), 4), "ms_steps_min": round(min(walls), 4),
                "ms_steps_max": round(max(walls), 4), "fill_s": round(fill_s, 2)}

    def compiled_row(batch: int, ctx: int) -> dict:
        short, long = a.new_tokens
        torch._dynamo.reset()
        model.set_attn_implementation("turboquant")
        capacity = ctx + 1 + 2 * short + a.turns * (short + long) + 8
        cache = TurboQuantStaticCache(cfg, max_cache_len=capacity, tq_config=PRESET)
        seq = prompt(batch, ctx + 1)
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            if a.fill == "model":
                prefill(cache, seq[:, :ctx])
            else:
                fill_update(cache, batch, ctx)
        sync()
        fill_s = time.perf_counter() - t0
        extra = {"disable_compile": True} if a.dry_run else {}

        def generate(seq, new):
            sync()
            t0 = time.perf_counter()
            with torch.no_grad():
                out = model.generate(seq, attention_mask=torch.ones_like(seq), **cache_kw(cache), max_new_tokens=new,
                                     min_new_tokens=new, do_sample=False, pad_token_id=0, **extra)
            sync()
            if out.shape[1] != seq.shape[1] + new:
                raise RuntimeError(f"generate gave {out.shape[1] - seq.shape[1]} new tokens, not {new}")
            return out, time.perf_counter() - t0

        seq, first_s = generate(seq, short)  # compiles
        seq, second_s = generate(seq, short)
        turns = []
        for _ in range(a.turns):
            seq, t_short = generate(seq, short)
            seq, t_long = generate(seq, long)
            turns.append((t_long - t_short) / (long - short) * 1e3)
        held = int(cache.get_seq_length())
        if held != seq.shape[1] - 1:  # each call must have gone on from the cache, not computed the prompt again
            raise RuntimeError(f"the cache holds {held} tokens after the calls, the sequence {seq.shape[1]}")
        return {"ms": round(statistics.median(turns), 4), "ms_turns": [round(x, 4) for x in turns],
                "fill_s": round(fill_s, 2), "first_call_s": round(first_s, 2), "second_call_s": round(second_s, 2),
                "held_at_end": held, "capacity": capacity}

    for kind, batch, ctx in [tuple(r) for r in json.loads(a.worker_rows)]:
        key = row_key(kind, batch, ctx)
        if time.time() > a.deadline:
            res["rows"].append({"row": key, "skipped": "budget"})
            save()
            continue
        gc_collect(torch, cuda)
        t0 = time.perf_counter()
        try:
            got = (compiled_row if kind == "compiled" else eager_row)(batch, ctx)
            got["row_s"] = round(time.perf_counter() - t0, 1)
            res["rows"].append({"row": key, **got})
        except Exception as e:  # the next rows still run
            res["rows"].append({"row": key, "error": f"{type(e).__name__}: {e}"[:2000]})
        print(f"[{a.worker_label} rep {a.worker_rep}] {res['rows'][-1]}", flush=True)
        save()


def gc_collect(torch, cuda: bool) -> None:
    import gc

    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


# ---- the parent: processes in turn, the JSON and the figure ----

def _commit_of(tree: str) -> str | None:
    try:
        got = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    except OSError:
        return None
    top = subprocess.run(["git", "-C", tree, "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    same = top.returncode == 0 and os.path.realpath(top.stdout.strip()) == os.path.realpath(tree)
    return (got.stdout.strip() or None) if got.returncode == 0 and same else None


def summarize(res: dict) -> None:
    """Per row: each tree's ms per rep (None where that rep has no figure), medians, after/before."""
    rows = []
    for kind, batch, ctx in res["settings"]["rows"]:
        key = row_key(kind, batch, ctx)
        ms = {t: [None] * res["settings"]["reps"] for t in ("before", "after")}
        for w in res["workers"]:
            got = next((r for r in w.get("rows", []) if r["row"] == key and "ms" in r), None)
            if got is not None:
                ms[w["tree"]][w["rep"]] = got["ms"]
        row = {"row": key, "label": row_label(kind, batch, ctx, res["settings"]["dry_run"]), "kind": kind,
               "batch": batch, "context": ctx, "before_ms": ms["before"], "after_ms": ms["after"]}
        have = {t: [x for x in ms[t] if x is not None] for t in ms}
        for t in ms:
            row[f"{t}_median"] = round(statistics.median(have[t]), 4) if have[t] else None
        if row["before_median"] and row["after_median"]:
            row["ratio"] = round(row["after_median"] / row["before_median"], 4)
            row["ratio_per_rep"] = [round(b2 / b1, 4) for b1, b2 in zip(ms["before"], ms["after"])
                                    if b1 is not None and b2 is not None]
            row["within_floor"] = row["ratio"] <= 1 + FLOOR_PCT / 100
        else:
            row["ratio"] = row["within_floor"] = None
        rows.append(row)
    res["rows"] = rows
    judged = [r["within_floor"] for r in rows]
    res["verdict"] = ("every row within the floor" if judged and all(judged) else
                      "some row slower than the floor" if any(j is False for j in judged) else "incomplete")


def plot(res: dict, path: str) -> None:
    """Bars of each row's median ms, before and after, whiskers over the reps; after/before above each pair."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    fig, ax = plt.subplots(figsize=(max(7.0, 1.9 * len(rows) + 1.5), 4.8))
    for i, (tree, colour) in enumerate((("before", "0.6"), ("after", "tab:blue"))):
        ys, lo, hi = [], [], []
        for r in rows:
            got = [x for x in r[f"{tree}_ms"] if x is not None]
            m = r[f"{tree}_median"] or 0
            ys.append(m)
            lo.append(m - min(got) if got else 0)
            hi.append(max(got) - m if got else 0)
        commit = res["trees"][tree]["commit"]
        ax.bar([x + (i - 0.5) * 0.38 for x in range(len(rows))], ys, 0.38, yerr=[lo, hi], capsize=3, color=colour,
               label=f"{tree}" + (f" ({commit})" if commit else ""))
    for x, r in enumerate(rows):
        if r["ratio"] is not None:
            top = max(v for t in ("before", "after") for v in r[f"{t}_ms"] if v is not None)
            ax.text(x, top * 1.02, f"{r['ratio']:.3f}", ha="center", va="bottom", fontsize=8,
                    color="black" if r["within_floor"] else "tab:red")
    ax.set_xticks(range(len(rows)), [r["label"] for r in rows], fontsize=7)
    ax.set_ylabel("ms per token (median over reps)")
    ax.margins(y=0.15)
    env = res.get("env") or {}
    model = "dry run, a tiny Llama" if res["settings"]["dry_run"] else "Llama-3.1-8B shape"
    ax.set_title(f"{env.get('device', '?')}: {model}, {env.get('layers', '?')} layers, {PRESET}; "
                 f"after / before above the bars (floor {1 + FLOOR_PCT / 100:.2f}); {res['verdict']}", fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", help="a folder holding the before tree's tq_hf_cache/")
    p.add_argument("--after", default=REPO, help="a folder holding the after tree's tq_hf_cache/ (default: this repo)")
    p.add_argument("--before-commit")
    p.add_argument("--after-commit", help="default: git rev-parse HEAD in --after, where it is a repository")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--order", choices=("abab", "abba"), default="abab")
    p.add_argument("--rows", help="comma-separated row names (default: all), e.g. compiled_b1_4096,eager_b1_32768")
    p.add_argument("--budget-s", type=float, default=540)
    p.add_argument("--new-tokens", default="16,144", help="short,long new tokens of the compiled rows' generate calls")
    p.add_argument("--turns", type=int, default=2, help="(short, long) pairs per compiled row and process")
    p.add_argument("--steps", type=int, default=30, help="timed steps per eager row and process")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--chunk", type=int, default=8192, help="prefill / fill chunk in tokens")
    p.add_argument("--fill", choices=("update", "model"), default="update", help="how compiled rows' caches fill")
    p.add_argument("--dry-run", action="store_true", help="CPU, a 2-layer model, small contexts, eager generate")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    p.add_argument("--worker-tree", help=argparse.SUPPRESS)
    p.add_argument("--worker-label", help=argparse.SUPPRESS)
    p.add_argument("--worker-rep", type=int, help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    p.add_argument("--worker-rows", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=float("inf"), help=argparse.SUPPRESS)
    a = p.parse_args()
    a.new_tokens = [int(x) for x in a.new_tokens.split(",")]
    if len(a.new_tokens) != 2 or not 0 < a.new_tokens[0] < a.new_tokens[1]:
        p.error("--new-tokens takes short,long with 0 < short < long")
    if a.worker_out:
        _worker(a)
        return
    if not a.before:
        p.error("--before DIR is required (a folder holding tq_hf_cache/, e.g. `git archive e116c1e | tar -x -C DIR`)")
    for tree in (a.before, a.after):
        if not os.path.isfile(os.path.join(tree, "tq_hf_cache", "__init__.py")):
            p.error(f"{tree} holds no tq_hf_cache/__init__.py")
    if a.reps < 1 or a.turns < 1 or a.steps < 3:
        p.error("--reps and --turns must be >= 1, --steps >= 3 (a median)")
    table = DRY_ROWS if a.dry_run else ROWS
    if a.rows:
        names = {row_key(*r): r for r in table}
        unknown = [x for x in a.rows.split(",") if x not in names]
        if unknown:
            p.error(f"unknown rows {unknown}; choose from {list(names)}")
        table = [names[x] for x in a.rows.split(",")]
    if a.dry_run:
        a.chunk = min(a.chunk, 64)

    t_start = time.time()
    trees = {"before": os.path.abspath(a.before), "after": os.path.abspath(a.after)}
    res = {"what": "the house refactor's speed floor: after / before per row, no row above "
                   f"{1 + FLOOR_PCT / 100:.2f}", "floor_pct": FLOOR_PCT, "env": None,
           "trees": {"before": {"dir": a.before, "commit": a.before_commit or _commit_of(trees["before"])},
                     "after": {"dir": a.after, "commit": a.after_commit or _commit_of(trees["after"])}},
           "settings": {"reps": a.reps, "order": a.order, "rows": [list(r) for r in table], "preset": PRESET,
                        "new_tokens": a.new_tokens, "turns": a.turns, "steps": a.steps, "warmup": a.warmup,
                        "chunk": a.chunk, "fill": a.fill, "budget_s": a.budget_s, "dry_run": a.dry_run},
           "workers": [], "stopped": None}
    os.makedirs(a.out, exist_ok=True)
    out_json = os.path.join(a.out, "bench_house_speed.json")

    def save():
        summarize(res)
        with open(out_json, "w") as f:
            json.dump(res, f, indent=1)

    def log(*x):
        print(f"[{time.time() - t_start:6.1f}s]", *x, flush=True)

    walls: list[float] = []
    order = plan(a.reps, a.order)
    with tempfile.TemporaryDirectory() as tmp:
        for i, (rep, tree) in enumerate(order):
            left = a.budget_s - (time.time() - t_start)
            first_of_pair = i % 2 == 0
            need = max(walls, default=0.0) * (2 if first_of_pair else 1)
            if left <= 0 or (walls and left < need):
                res["stopped"] = (f"budget: {left:.0f} s left before {tree} rep {rep}, the longest process took "
                                  f"{max(walls, default=0):.0f} s")
                log(res["stopped"])
                break
            wout = os.path.join(tmp, f"{tree}_{rep}.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--worker-tree", trees[tree], "--worker-label", tree,
                   "--worker-rep", str(rep), "--worker-out", wout, "--worker-rows", json.dumps(table),
                   "--deadline", str(time.time() + left - 5), "--new-tokens", ",".join(map(str, a.new_tokens)),
                   "--turns", str(a.turns), "--steps", str(a.steps), "--warmup", str(a.warmup),
                   "--chunk", str(a.chunk), "--fill", a.fill] + (["--dry-run"] if a.dry_run else [])
            env = {**os.environ, "PYTHONPATH": trees[tree], "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
                   "TRANSFORMERS_OFFLINE": "1"}
            if a.dry_run:
                env["OMP_NUM_THREADS"] = "1"
            log(f"{tree} rep {rep}: starting ({left:.0f} s left)")
            t0 = time.time()
            logf = os.path.join(tmp, f"{tree}_{rep}.log")
            with open(logf, "w") as f:
                try:
                    rc = subprocess.run(cmd, env=env, cwd=tmp, stdout=f, stderr=subprocess.STDOUT,
                                        timeout=max(left, 1)).returncode
                except subprocess.TimeoutExpired:
                    rc = "stopped at the budget"
            wall = time.time() - t0
            walls.append(wall)
            with open(logf) as f:
                tail = f.read()[-3000:]
            w = {"tree": tree, "rep": rep, "wall_s": round(wall, 1), "rc": rc}
            if os.path.exists(wout):
                with open(wout) as f:
                    w.update(json.load(f))
                res["env"] = res["env"] or {**w["env"], "layers": w.get("layers")}
            if rc != 0 or any("error" in r for r in w.get("rows", [])):
                w["log_tail"] = tail
            res["workers"].append(w)
            save()
            log(f"{tree} rep {rep}: rc {rc}, {wall:.0f} s, rows " +
                ", ".join(f"{r['row']} {r.get('ms', r.get('error', r.get('skipped')))}" for r in w.get("rows", [])))
    save()
    plot(res, os.path.join(a.out, "bench_house_speed.png"))
    for r in res["rows"]:
        log(f"{r['row']:>22}: before {r['before_ms']} after {r['after_ms']} ratio {r['ratio']}")
    log(res["verdict"], "; wrote", out_json, "and bench_house_speed.png")


if __name__ == "__main__":
    main()
