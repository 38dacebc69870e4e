"""Per-layer decode attention on a GPU: the explicit-layout kernel (`kernels.cuda`) against the Triton kernel
alone and cuDNN SDPA on bf16 K/V, Llama-3.1-8B shape (32 / 8 heads, head dim 128; --shape for others), one query;
with --workspace 1 also the workspace path (dequantize K and V into bf16, then SDPA).

Each case checks the fast output against the Triton kernel's (relative error; against `reference.packed_attention`'s where
the Triton kernel does not take the preset, such as head dim 256 at 4 bits), then times them as CUDA-graph replays
(`do_bench_cudagraph` medians), repetitions interleaved. Each path cycles through as many independent input sets as
hold together 4x the L2 cache (`bench_attention.cold_sets`: a model's layers, each read once a step), so that no
call finds its inputs in L2 from its last turn; --cold 0 replays one set (at 1 x 4k every path's inputs then stay in
L2). Writes F (JSON) and F with .png (speed over SDPA).
Usage:
    python benchmarks/studies/fast_decode_study.py [--presets k5v3,k4v4,k4v2] [--cases 1x4096,1x32768,...]
        [--shape llama-3.1-8b] [--workspace 0] [--cold 1] --out F
    python benchmarks/studies/fast_decode_study.py --replot F      (the PNG again from the JSON)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import bench_attention as ba  # noqa: E402
from tq_hf_cache import kernels, reference  # noqa: E402
from tq_hf_cache.kernels import decode_attention as da  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="k5v3,k4v4,k4v2")
    ap.add_argument("--cases", default="1x4096,1x32768,1x131072,8x32768,8x131072")
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workspace", type=int, default=0)
    ap.add_argument("--cold", type=int, default=1, help="1: cycle through input sets that together outgrow L2")
    ap.add_argument("--out")
    ap.add_argument("--replot")
    a = ap.parse_args()
    if a.replot:
        with open(a.replot) as fh:
            plot(json.load(fh), a.replot.rsplit(".", 1)[0] + ".png")
        return
    ba.HQ, ba.HKV, ba.D = ba.SHAPES[a.shape]
    bw = ba.copy_bandwidth()
    rows = []
    for preset in a.presets.split(","):
        kb, vb, _ = ba.parse_preset(preset)
        for case in a.cases.split(","):
            b, t = map(int, case.split("x"))
            kv, nbytes = ba.packed_layer(b, t, kb, vb)
            sets = {"packed": ba.cold_sets(nbytes) if a.cold else 1,
                    "sdpa": ba.cold_sets(ba.sdpa_bytes(b, t)) if a.cold else 1}
            kvs = [kv] + [ba.packed_layer(b, t, kb, vb)[0] for _ in range(sets["packed"] - 1)]
            q = torch.randn(b, ba.HQ, 1, ba.D, device="cuda", dtype=torch.bfloat16)
            fast_out = da.decode_attention(q, kv)
            tri = kernels.decode_supports(ba.D, kb, vb, 1, ba.HQ // ba.HKV)
            paths = {"sdpa": [ba.cudnn_sdpa(b, t) for _ in range(sets["sdpa"])],
                     "fast": [functools.partial(da.decode_attention, q, x) for x in kvs]}
            if tri:
                paths["triton"] = [functools.partial(da.decode_attention, q, x, fast=False) for x in kvs]
            if a.workspace:
                paths["workspace"] = [ba.workspace_path(x, b) for x in kvs]
            want = (paths["triton"][0]() if tri else reference.packed_attention(q, kv, None, None)).float()
            torch.cuda.synchronize()
            err = ((fast_out.float() - want).norm() / want.norm()).item()
            times = {k: [] for k in paths}
            for _ in range(a.reps):
                for k, f in paths.items():
                    times[k].append(ba.time_sets(f))
            med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
            row = dict(preset=preset, batch=b, context=t, input_sets=sets, err_vs="triton" if tri else "reference",
                       err=err, ms=med,
                       all_ms=times, bytes=nbytes, fast_bw_frac=nbytes / (med["fast"] * 1e-3) / bw,
                       **{f"{k}_vs_sdpa": med["sdpa"] / med[k] for k in med if k != "sdpa"})
            rows.append(row)
            print(f"{preset} {b}x{t}: " + " ".join(f"{k} {v:.4f}" for k, v in med.items()) + " ms | "
                  + " ".join(f"{k} {row[k + '_vs_sdpa']:.2f}x" for k in med if k != "sdpa") + " sdpa | "
                  f"bw {row['fast_bw_frac']:.0%} | err vs {row['err_vs']} {err:.1e}", flush=True)
            kv = kvs = paths = None  # (freed before the next case allocates)
            torch.cuda.empty_cache()
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, copy_bw=bw, shape=a.shape,
                  cold=bool(a.cold), l2_bytes=torch.cuda.get_device_properties(0).L2_cache_size,
                  when=time.strftime("%Y-%m-%d %H:%M"), rows=rows)
    with open(a.out, "w") as fh:
        json.dump(result, fh, indent=1)
    plot(result, a.out.rsplit(".", 1)[0] + ".png")


def plot(result: dict, path: str) -> None:
    """Speed over cuDNN SDPA per case: the fast kernel and the Triton kernel, one panel per preset."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = list(dict.fromkeys(r["preset"] for r in result["rows"]))
    fig, axes = plt.subplots(1, len(presets), figsize=(4.2 * len(presets), 3.6), sharey=True, squeeze=False)
    for ax, preset in zip(axes[0], presets):
        rows = [r for r in result["rows"] if r["preset"] == preset]
        names = [f"{r['batch']}x{r['context'] // 1024}k" for r in rows]
        x = range(len(rows))
        others = [k for k in ("triton", "workspace") if any(f"{k}_vs_sdpa" in r for r in rows)]
        w = 0.8 / (1 + len(others))
        ax.bar([i - 0.4 + w / 2 for i in x], [r["fast_vs_sdpa"] for r in rows], w, label="fast kernel (CUDA)")
        for j, k in enumerate(others, 1):
            ax.bar([i - 0.4 + w * (j + 0.5) for i in x], [r.get(f"{k}_vs_sdpa", 0.0) for r in rows], w,
                   label={"triton": "Triton kernel", "workspace": "dequantize + SDPA"}[k])
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(2.5, color="r", lw=0.8, ls="--", label="floor 2.5x")
        ax.set_xticks(list(x), names)
        ax.set_title(preset)
    axes[0][0].set_ylabel("speed over cuDNN SDPA (bf16 K/V)")
    axes[0][0].legend(fontsize=8)
    inputs = "inputs cycled past L2" if result.get("cold") else "one input set"
    fig.suptitle(f"decode attention, one layer ({result['shape']}, {result['device']}, {inputs})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
