"""How many packed tokens each program of the fused decode kernel should take (`kernels.MIN_TOKENS_PER_SPLIT`).

At short contexts the kernel runs few programs (the packed history / the minimum per program), each a chain of
tiles, so most of the GPU idles; a smaller minimum starts more programs, each with fewer tiles, at the price of more
partials to merge. For each shape, preset, batch and context: the kernel's time at every minimum (CUDA-graph
replays, median; `bench_attention.kernel_time`), each output checked against the current default's, beside SDPA on
bf16 K/V and the workspace path (dequantize + SDPA) in the same run. Writes $OUT/split_size_study.json and .png.

Usage: python benchmarks/studies/split_size_study.py [--shapes llama-3.1-8b,gemma-3-4b] [--presets k5v3]
       [--contexts 4096,32768,131072] [--batches 1,8] [--minimums 32,64,128,256,512]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, ".."))

import bench_attention as ba  # noqa: E402

from tq_hf_cache import kernels  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="llama-3.1-8b,gemma-3-4b")
    p.add_argument("--presets", default="k5v3")
    p.add_argument("--contexts", default="4096,32768,131072")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--minimums", default="32,64,128,256,512")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    a = p.parse_args()
    default = kernels.MIN_TOKENS_PER_SPLIT
    minimums = [int(x) for x in a.minimums.split(",")]
    rows = []
    for shape, preset, b, t in itertools.product(a.shapes.split(","), a.presets.split(","),
                                                 map(int, a.batches.split(",")), map(int, a.contexts.split(","))):
        ba.HQ, ba.HKV, ba.D = ba.SHAPES[shape]
        kv, _ = ba.packed_layer(b, t, *ba.parse_preset(preset))
        lq = t - ba.RESIDUAL
        sdpa_ms, _ = ba.sdpa_time(b, t)
        ws_ms = ba.workspace_time(kv, b)
        kernels.support.MIN_TOKENS_PER_SPLIT = default
        _, want = ba.kernel_time(kv, b)
        for m in minimums:
            kernels.support.MIN_TOKENS_PER_SPLIT = m
            kbits, vbits, parts = ba.parse_preset(preset)
            per_sm = kernels.decode_plan(ba.D, kbits, vbits, parts is not None, b * ba.HKV * lq)[1]  # the launcher's
            splits = kernels.num_splits_for(b * ba.HKV, lq, ba.DEV, per_sm)
            ms, out = ba.kernel_time(kv, b, num_splits=splits)
            row = {"shape": shape, "preset": preset, "batch": b, "context": t, "min_tokens_per_split": m,
                   "num_splits": splits, "kernel_ms": round(ms, 4), "sdpa_ms": round(sdpa_ms, 4),
                   "workspace_ms": round(ws_ms, 4),
                   "max_abs_diff_vs_default": float((out.float() - want.float()).abs().max())}
            rows.append(row)
            print(row, flush=True)
        kernels.support.MIN_TOKENS_PER_SPLIT = default
        del kv
        torch.cuda.empty_cache()
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "split_size_study.json")
    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "default": default,
                   "rows": rows}, f, indent=1)
    plot(rows, os.path.join(a.out, "split_size_study.png"))
    print("wrote", path)


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys((r["shape"], r["preset"], r["batch"], r["context"]) for r in rows))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for c in cases:
        rs = [r for r in rows if (r["shape"], r["preset"], r["batch"], r["context"]) == c]
        ax.plot([r["min_tokens_per_split"] for r in rs], [r["kernel_ms"] / r["sdpa_ms"] for r in rs], marker="o",
                label=f"{c[0]} {c[1]} b{c[2]} {c[3] // 1024}k")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("packed tokens per program, at least")
    ax.set_ylabel("fused kernel ms / SDPA (bf16) ms")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
