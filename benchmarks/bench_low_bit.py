"""Three bits a coordinate with no calibration: perplexity change against the full-precision cache, over rotation
seeds, on the quality tables' text and on a held-out text, with needles; the package's own caches end to end.

    python benchmarks/bench_low_bit.py --model smollm2 --caches k4v2,k4v2-pairs --seeds 0,1,2,3 --texts pkg,gpl3 \
        --needle k4v2-pairs --out benchmarks/results/bench_low_bit.json
    python benchmarks/bench_low_bit.py --model gemma3-270m ... (same file: rows accumulate, done ones are skipped)
    python benchmarks/bench_low_bit.py --out benchmarks/results/bench_low_bit.json --plot benchmarks/results/bench_low_bit.png

Texts: "pkg" is the quality tables' text (`texts.package_text(start=HELD_OUT_START)`, CPython's pydoc topics); "gpl3"
is held out (never used to choose a setting): the GNU GPL v3 shipped by Debian's `base-files` package. Perplexity is
the eval's (`tools.eval.tasks.perplexity`: chunked prefill in chunks of 256, scored from chunk 1); SmolLM2 over 4096
tokens, Gemma 3 270M over 2048, float32 on a CPU. A cache name is a preset (`PRESETS`); `name@key=value` adds a
TurboQuantConfig field (e.g. `k4v2@key_centering=true`). Bytes per token: `TurboQuantConfig.bytes_per_token` of a
full-attention layer at 4096 tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

GPL3 = "/usr/share/common-licenses/GPL-3"
PPL_TOKENS = {"smollm2": 4096, "gemma3-270m": 2048}
NEEDLE_LENGTHS = {"smollm2": [1024, 4096], "gemma3-270m": [2048]}


def parse_cache(name: str) -> tuple[str, dict]:
    """'k4v2-pairs' -> (preset, {}); 'k4v2@key_centering=true@norm_correction=true' -> (preset, fields)."""
    preset, *opts = name.split("@")
    fields = {}
    for o in opts:
        k, v = o.split("=")
        fields[k] = {"true": True, "false": False}.get(v.lower(), int(v) if v.isdigit() else v)
    return preset, fields


def load_text(name: str, tokenizer, n: int) -> tuple[torch.Tensor, str]:
    from tq_hf_cache.tools import texts

    if name == "pkg":
        chars = n * 6
        while True:
            ids = tokenizer(texts.package_text(chars, start=texts.HELD_OUT_START), return_tensors="pt").input_ids
            if ids.shape[1] >= n:
                return ids[:, :n], f"{texts.TEXT_SOURCE}, from paragraph {texts.HELD_OUT_START}"
            chars *= 2
    if name == "gpl3":
        with open(GPL3, encoding="utf-8") as f:
            ids = tokenizer(f.read(), return_tensors="pt").input_ids
        if ids.shape[1] < n:
            raise ValueError(f"{GPL3} has {ids.shape[1]} tokens, fewer than {n}")
        return ids[:, :n], f"GNU GPL v3, {GPL3} (Debian package base-files)"
    raise ValueError(f"unknown text {name!r}: pkg or gpl3")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--caches", default="k4v2,k4v2-pairs")
    p.add_argument("--seeds", default="0,1,2,3")
    p.add_argument("--texts", default="pkg,gpl3")
    p.add_argument("--needle", default="", help="caches to run the needles on (seed 0), beside fp")
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--out", default="benchmarks/results/bench_low_bit.json")
    p.add_argument("--plot", default="", help="only draw this PNG from --out")
    a = p.parse_args()
    if a.plot:
        return plot(a.out, a.plot)
    torch.set_num_threads(1)
    from transformers import DynamicCache

    from tq_hf_cache import TurboQuantCache, TurboQuantConfig
    from tq_hf_cache.tools.eval import tasks
    from tq_hf_cache.tools.eval.models import load_model

    model, tok, info = load_model(a.model)
    n_tok = PPL_TOKENS.get(a.model, 2048)
    res = json.load(open(a.out)) if os.path.exists(a.out) else {"rows": [], "fp": {}, "texts": {}, "needle": {},
                                                                  "runs": []}
    res["runs"].append({"model": a.model, "argv": vars(a), "torch": torch.__version__,
                        "transformers": __import__("transformers").__version__, "threads": 1,
                        "date": time.strftime("%Y-%m-%d")})

    def save():
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out + ".tmp", "w") as f:
            json.dump(res, f, indent=1)
        os.replace(a.out + ".tmp", a.out)

    def make(name: str, seed: int):
        preset, fields = parse_cache(name)
        return lambda: TurboQuantCache(preset, config=model.config, seed=seed, **fields)

    for text in a.texts.split(","):
        ids, src = load_text(text, tok, n_tok)
        res["texts"][text] = src
        key = f"{a.model}/{text}/{n_tok}"
        if key not in res["fp"]:
            out, _, _ = tasks.perplexity(model, ids, lambda: DynamicCache(config=model.config), a.chunk)
            res["fp"][key] = out["ppl"]
            save()
        fp = res["fp"][key]
        print(f"[{key}] fp ppl {fp:.4f}", flush=True)
        for name in a.caches.split(","):
            preset, fields = parse_cache(name)
            cfg = TurboQuantConfig.from_preset(preset, **fields)
            row = next((r for r in res["rows"] if (r["model"], r["text"], r["cache"]) == (a.model, text, name)), None)
            if row is None:
                row = {"model": a.model, "text": text, "cache": name, "tokens": n_tok,
                       "bits_per_coordinate": cfg.bits_per_coordinate,
                       "bytes_per_token_layer": cfg.bytes_per_token(info["num_key_value_heads"], info["head_dim"],
                                                                    4096),
                       "per_seed": {}}
                res["rows"].append(row)
            for s in (int(x) for x in a.seeds.split(",")):
                if str(s) in row["per_seed"]:
                    continue
                t = time.time()
                out, _, _ = tasks.perplexity(model, ids, make(name, s), a.chunk)
                row["per_seed"][str(s)] = 100 * (out["ppl"] / fp - 1)
                vals = list(row["per_seed"].values())
                row.update(mean=sum(vals) / len(vals), min=min(vals), max=max(vals), seeds=len(vals))
                print(f"[{key}] {name} seed {s}: {row['per_seed'][str(s)]:+.3f}% ({time.time() - t:.0f} s)", flush=True)
                save()
    if a.needle:
        from tq_hf_cache.tools import texts

        paras = list(texts.paragraphs()[texts.HELD_OUT_START:])
        out = res["needle"].setdefault(a.model, {})
        for name in ["fp", *a.needle.split(",")]:
            if name in out:
                continue
            mk = (lambda: DynamicCache(config=model.config)) if name == "fp" else make(name, 0)
            rows = tasks.needle(model, tok, paras, mk, NEEDLE_LENGTHS.get(a.model, [2048]), [0.1, 0.5, 0.9], a.chunk,
                                8, 0)
            out[name] = [{"length": r["length"], "depth": r["depth"], "found": r["found"], "answer": r["answer"]}
                         for r in rows]
            print(f"[needle {a.model}] {name}: " + " ".join("Y" if r["found"] else "n" for r in rows), flush=True)
            save()


def plot(path: str, png: str) -> None:
    """Δppl over seeds (dots) and their mean (bar) per cache, one panel per model and text, the +0.5 % floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = json.load(open(path))
    rows = [r for r in res["rows"] if r.get("seeds")]
    panels = sorted({(r["model"], r["text"]) for r in rows}, key=lambda mt: (mt[0] != "smollm2", mt[1] != "pkg"))
    caches = list(dict.fromkeys(r["cache"] for r in rows))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 0.5 * len(caches) + 1.8), sharey=True,
                             squeeze=False)
    for ax, (m, t) in zip(axes[0], panels):
        for y, c in enumerate(caches):
            r = next((r for r in rows if (r["model"], r["text"], r["cache"]) == (m, t, c)), None)
            if r is None:
                continue
            ax.barh(y, r["mean"], color="tab:blue", alpha=0.6)
            ax.plot(list(r["per_seed"].values()), [y] * r["seeds"], "k.", ms=4)
            ax.text(max(r["max"], r["mean"]) + 0.05, y, f"{r['mean']:+.2f}", va="center", fontsize=7)
        ax.axvline(0.5, color="tab:red", ls="--", lw=1)
        ax.set_title(f"{m} / {t}", fontsize=9)
        ax.set_xlabel("Δppl vs fp, % (bar: mean; dots: seeds)", fontsize=8)
    axes[0][0].set_yticks(range(len(caches)), caches, fontsize=8)
    axes[0][0].invert_yaxis()
    fig.suptitle("3.0 code bits a coordinate, no calibration (red: the +0.5 % floor)", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    main()
