"""Tables (markdown) and the quality-vs-bytes plot from result JSON files written by `run_eval` (docs/quality.md
quotes its tables from them).

    python -m tq_hf_cache.tools.eval.report benchmarks/results/quality_*.json --markdown quality_tables.md \
        --plot docs/quality_vs_bytes.png
"""

from __future__ import annotations

import argparse
import io
import json
import re

from ..._io import write_bytes, write_text


def save_figure(fig, path: str) -> None:
    """A matplotlib figure as a PNG at `path`, written through `_io` (savefig would open the path itself)."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    write_bytes(path, buf.getvalue())


def _fmt(x, spec):
    return "n/a" if x is None else format(x, spec)


def _formula(result: dict, entry: dict):
    """(bytes/token/layer, bits/coordinate) from the cache's spec and the model shape (fp16 formula)."""
    from .caches import CacheSpec

    sp, m = entry.get("spec"), result["model"]
    if not sp or "num_key_value_heads" not in m:
        return None, None
    spec = CacheSpec(sp["name"], sp["family"], sp["key_bits"], sp["value_bits"], sp.get("overrides") or {})
    h, d = m["num_key_value_heads"], m["head_dim"]
    per_layer = spec.formula_bytes_per_token_layer(h, d)
    return per_layer, per_layer * 8 / (2 * h * d)


def summary_rows(result: dict) -> list[dict]:
    rows = []
    fam = {"fp": 0, "turboquant": 1, "quanto": 2, "hqq": 3}

    def order(item):
        name, e = item
        sp = e.get("spec", {})
        return (fam.get(sp.get("family"), 9), -sp.get("key_bits", 0), -sp.get("value_bits", 0), name)

    for name, e in sorted(result["caches"].items(), key=order):
        r = {"cache": name, "available": e.get("available", False), "reason": e.get("reason") or e.get("error")}
        p, n, a, b = e.get("perplexity"), e.get("needle"), e.get("agreement"), e.get("bytes")
        if p:
            r.update(ppl=p["ppl"], delta=p["delta_pct"], top1=p.get("top1_agreement"))
        if n:
            r.update(needle=f"{n['found']}/{n['total']}", needle_same=f"{n['same_found_as_fp']}/{n['total']}",
                     needle_answer_same=f"{n['same_answer_as_fp']}/{n['total']}")
        if a:
            r.update(prefix=a["prefix_match"], agree=a["top1_agreement"], first_div=a["min_first_divergence"])
        r["bpt_layer"], r["bits"] = _formula(result, e)
        if b:
            r.update(meas16=(b.get("measured_fp16") or {}).get("per_token"),
                     meas_eval=b["measured_eval_dtype"]["per_token"])
        rows.append(r)
    return rows


def text_summary(result: dict) -> str:
    """The end-of-run table of `tq-hf-cache eval`: per cache, the columns of the tasks the run measured."""
    rows = summary_rows(result)
    tasks = set(result.get("tasks", ()))
    cols = [("cache", lambda r: r["cache"])]
    if "ppl" in tasks:
        cols += [("ppl", lambda r: _fmt(r.get("ppl"), ".4f")),
                 ("ppl vs fp", lambda r: "n/a" if r.get("delta") is None else f"{r['delta']:+.2f}%"),
                 ("top-1 = fp", lambda r: _fmt(r.get("top1"), ".4f"))]
    if "needle" in tasks:
        cols += [("needle found", lambda r: r.get("needle", "n/a")),
                 ("same as fp", lambda r: r.get("needle_same", "n/a"))]
    if "agreement" in tasks and result["settings"].get("agreement_prompts"):
        cols += [("greedy prefix", lambda r: _fmt(r.get("prefix"), ".3f")),
                 ("greedy top-1", lambda r: _fmt(r.get("agree"), ".3f"))]
    if "bytes" in tasks:
        cols += [("bits/coord", lambda r: _fmt(r.get("bits"), ".2f")),
                 ("bytes/token", lambda r: _fmt(r.get("meas_eval"), ".0f"))]
    table = []
    for r in rows:
        if not r["available"] or not any(k in r for k in ("ppl", "needle", "prefix", "meas_eval")):
            why = "not available" if not r["available"] else "failed"
            table.append([r["cache"], f"{why}: {r['reason']}"])
        else:
            table.append([f(r) for _, f in cols])
    widths = [max([len(c)] + [len(t[i]) for t in table if len(t) == len(cols)]) for i, (c, _) in enumerate(cols)]
    lines = ["  ".join(f"{c:<{w}}" if i == 0 else f"{c:>{w}}" for i, ((c, _), w) in enumerate(zip(cols, widths)))]
    for t in table:
        lines.append("  ".join(f"{c:<{w}}" if i == 0 else f"{c:>{w}}" for i, (c, w) in enumerate(zip(t, widths)))
                     if len(t) == len(cols) else f"{t[0]:<{widths[0]}}  {t[1]}")
    if "bytes" in tasks:
        lines.append("bits/coord: stored bits per K/V coordinate (fp16 formula); bytes/token: the perplexity run's "
                     "cache in the model dtype, residual window included")
    failed = [(n, e["error"]) for n, e in result["caches"].items()
              if e.get("error") and any(k in e for k in ("perplexity", "needle", "agreement", "bytes"))]
    lines += [f"{n}: a task failed after others ran: {err}" for n, err in failed]
    return "\n".join(lines)


def markdown_table(result: dict) -> str:
    m, s = result["model"], result["settings"]
    lines = [
        f"**{m['label']}** ({m['architecture']}, {m['num_layers']} layers, {m['num_key_value_heads']} KV heads, "
        f"head dim {m['head_dim']}{', ' + str(m['full_attention_layers']) + ' full-attention layers, sliding window ' + str(m['sliding_window']) if m['full_attention_layers'] != m['num_layers'] else ''}); "
        f"model dtype {result['environment']['dtype']}, torch {result['environment']['torch']}, "
        f"transformers {result['environment']['transformers']}, CPU.",
        "",
        f"Perplexity: {s['ppl_tokens']} tokens, chunk {s['chunk']}; needle: lengths {s['needle_lengths']} x depths "
        f"{s['needle_depths']}; agreement: {s['agreement_prompts']} prompts x {s['agreement_prompt_tokens']} tokens, "
        f"{s['agreement_new_tokens']} greedy tokens.",
        "",
        "| cache | ppl | Δppl vs fp | top-1 = fp (ppl text) | needle found | needle same as fp | greedy prefix match | greedy top-1 agreement | bits/coord | bytes/token/layer (fp16, formula) | bytes/token (fp16, measured @N) | bytes/token (eval dtype, measured) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary_rows(result):
        if not r["available"] or r.get("reason") and "ppl" not in r:
            lines.append(f"| {r['cache']} | not available: {r['reason']} |" + " |" * 10)
            continue
        lines.append(
            f"| {r['cache']} | {_fmt(r.get('ppl'), '.4f')} | {_fmt(r.get('delta'), '+.2f')}% | {_fmt(r.get('top1'), '.4f')} "
            f"| {r.get('needle', 'n/a')} | {r.get('needle_same', 'n/a')} | {_fmt(r.get('prefix'), '.3f')} "
            f"| {_fmt(r.get('agree'), '.4f')} | {_fmt(r.get('bits'), '.2f')} | {_fmt(r.get('bpt_layer'), '.0f')} "
            f"| {_fmt(r.get('meas16'), '.0f')} | {_fmt(r.get('meas_eval'), '.0f')} |"
        )
    errors = [(n, e["error"]) for n, e in result["caches"].items() if e.get("error") and e.get("perplexity")]
    if errors:
        lines.append("")
        lines += [f"- `{n}`: a task failed after the perplexity run: {err}" for n, err in errors]
    bt = (s.get("bytes_tokens") or "n/a")
    lines += ["", f"Measured fp16 bytes: a fresh cache filled with {bt} tokens of float16 KV states of the model's shapes "
                  f"(allocated capacity, residual window included). Eval-dtype bytes: the perplexity run's cache after "
                  f"{s['ppl_tokens']} tokens.", ""]
    return "\n".join(lines)


def update_markdown(path: str, results: list[dict]) -> None:
    """Replace (or append) the block between `<!-- results:NAME -->` and `<!-- /results:NAME -->` per model."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        text = "# KV-cache quality\n\n"
    for res in results:
        name = res["model"]["name"]
        tag = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
        begin, end = f"<!-- results:{tag} -->", f"<!-- /results:{tag} -->"
        block = f"{begin}\n{markdown_table(res)}\n{end}"
        if begin in text and end in text:
            text = text[: text.index(begin)] + block + text[text.index(end) + len(end):]
        else:
            text = text.rstrip("\n") + "\n\n" + block + "\n"
    write_text(path, text)


def seed_groups(caches: dict) -> list[tuple[str, list[dict]]]:
    """The caches as plotted: those named alike but for a `-seed<k>` part (one configuration over rotation seeds) are
    one group, labelled `<name>-seed*` when it holds several; every other cache is its own group."""
    groups: dict[str, list[tuple[str, dict]]] = {}
    for name, e in caches.items():
        groups.setdefault(re.sub(r"-seed\d+", "-seed*", name), []).append((name, e))
    return [(key if len(members) > 1 else members[0][0], [e for _, e in members]) for key, members in groups.items()]


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def plot(results: list[dict], path: str) -> None:
    """Quality vs bytes per token: Δperplexity (%) and greedy top-1 agreement against fp16-formula bits/coordinate. A
    configuration run over several rotation seeds is one point, their mean (see `seed_groups`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    markers = {"turboquant": "o", "quanto": "s", "hqq": "^", "fp": "*"}
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for mi, res in enumerate(results):
        color = colors[mi % len(colors)]
        short = res["model"]["name"]
        for name, members in seed_groups(res["caches"]):
            e = members[0]
            x = _formula(res, e)[1]
            if x is None or not all(m.get("available", False) for m in members):
                continue
            fam = e["spec"]["family"]
            marker = "D" if e["spec"].get("overrides", {}).get("key_centering") else markers.get(fam, "o")
            for ax, task, key in ((axes[0], "perplexity", "delta_pct"), (axes[1], "agreement", "top1_agreement")):
                y = _mean([(m.get(task) or {}).get(key) for m in members])
                if y is None:
                    continue
                ax.scatter([x], [y], marker=marker, color=color, s=60, label=f"{short}" if name == "fp" else None)
                label = name.removeprefix(short + "-")  # an allocation folder named after its model
                ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7, color=color)
    axes[0].set_yscale("symlog", linthresh=1.0)
    axes[0].set_ylabel("perplexity increase vs fp (%)")
    axes[1].set_ylabel("greedy top-1 agreement with fp (teacher-forced)")
    for ax in axes:
        ax.set_xlabel("KV bits per coordinate (fp16 formula; fp16 = 16)")
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
    axes[0].legend(title="o TurboQuant, D with key centring,\ns quanto, ^ HQQ; -seed*: mean over seeds",
                   loc="upper right", fontsize=8, title_fontsize=8)
    fig.suptitle("KV-cache quality vs size (chunked prefill, CPU)")
    fig.tight_layout()
    save_figure(fig, path)


def merge_results(results: list[dict]) -> list[dict]:
    """Join runs of one model that ran different tasks or caches (e.g. ppl+bytes over every cache, needle+agreement
    over a subset) into one result per model; a later file's task entries win."""
    merged: dict[str, dict] = {}
    for res in results:
        name = res["model"]["name"]
        if name not in merged:
            merged[name] = json.loads(json.dumps(res))
            merged[name]["runs"] = [{"command": res.get("command"), "tasks": res.get("tasks"),
                                     "caches": list(res["caches"]), "seconds_total": res.get("seconds_total")}]
            continue
        m = merged[name]
        m["runs"].append({"command": res.get("command"), "tasks": res.get("tasks"), "caches": list(res["caches"]),
                          "seconds_total": res.get("seconds_total")})
        # the settings a task ran with come from the run that ran it
        keys = {"ppl": ("ppl_tokens", "chunk", "text_start"), "bytes": ("bytes_tokens",),
                "needle": ("needle_lengths", "needle_depths", "needle_new_tokens", "seed"),
                "agreement": ("agreement_prompts", "agreement_prompt_tokens", "agreement_new_tokens")}
        for task in res.get("tasks", []):
            if task not in m.get("tasks", []):
                for k in keys.get(task, ()):
                    if k in res["settings"]:
                        m["settings"][k] = res["settings"][k]
        m["tasks"] = sorted(set(m.get("tasks", [])) | set(res.get("tasks", [])))
        for cname, entry in res["caches"].items():
            tgt = m["caches"].setdefault(cname, {})
            seconds = {**tgt.get("seconds", {}), **entry.get("seconds", {})}
            tgt.update(entry)
            if seconds:
                tgt["seconds"] = seconds
    return list(merged.values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tq_hf_cache.tools.eval.report")
    ap.add_argument("results", nargs="+", help="result JSON files")
    ap.add_argument("--markdown", help="markdown file whose result blocks to write/update")
    ap.add_argument("--plot", help="PNG path for the quality-vs-bytes plot")
    ap.add_argument("--merged-json", help="write each model's merged result here ('{model}' is replaced by its name)")
    args = ap.parse_args(argv)
    results = []
    for p in args.results:
        with open(p) as f:
            results.append(json.load(f))
    results = merge_results(results)
    if args.merged_json:
        for r in results:
            path = args.merged_json.format(model=r["model"]["name"])
            write_text(path, json.dumps(r, indent=1))
    if args.markdown:
        update_markdown(args.markdown, results)
    if args.plot:
        plot(results, args.plot)
    if not args.markdown and not args.plot:
        for r in results:
            print(markdown_table(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
