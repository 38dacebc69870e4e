"""Two builds of the explicit-layout decode kernel against each other on the H100, per layer: the source in the
working tree ("new") and another (`--base F`, e.g. `git show REV:tq_hf_cache/kernels/fast/decode_mma.cu > F`), with
cuDNN SDPA on bf16 K/V as the yardstick, Llama-3.1-8B shape (--shape for others), one query.

Each case checks both outputs against the Triton kernel's, then times SDPA, base and new as CUDA-graph replays
(`do_bench_cudagraph` medians), repetitions interleaved. Writes F (JSON). Usage:
    python benchmarks/studies/fast_decode_ab.py --base F [--presets k5v3,k4v4] [--cases 1x4096,...] --out F
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from triton.testing import do_bench_cudagraph  # noqa: E402

import bench_attention as ba  # noqa: E402
from tq_hf_cache.kernels import decode_attention as da  # noqa: E402
from tq_hf_cache.kernels import fast  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="the other build's decode_mma.cu")
    ap.add_argument("--presets", default="k5v3,k4v4")
    ap.add_argument("--cases", default="1x4096,1x32768,1x131072,8x32768")
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    with open(a.base) as fh:
        sources = {"base": fh.read(), "new": fast.source()}
    ba.HQ, ba.HKV, ba.D = ba.SHAPES[a.shape]
    rows = []
    for preset in a.presets.split(","):
        for case in a.cases.split(","):
            b, t = map(int, case.split("x"))
            rows.append(one_case(preset, b, t, sources, a.reps))
            torch.cuda.empty_cache()
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, shape=a.shape,
                  when=time.strftime("%Y-%m-%d %H:%M"), command=" ".join(["python"] + sys.argv), rows=rows)
    with open(a.out, "w") as fh:
        json.dump(result, fh, indent=1)


def one_case(preset: str, b: int, t: int, sources: dict[str, str], reps: int) -> dict:
    kb, vb, _ = ba.parse_preset(preset)
    kv, nbytes = ba.packed_layer(b, t, kb, vb)
    q = torch.randn(b, ba.HQ, 1, ba.D, device="cuda", dtype=torch.bfloat16)
    want = da.decode_attention(q, kv, fast=False).float()
    err = {}
    for name, src in sources.items():
        fast._SOURCE = src
        got = da.decode_attention(q, kv).float()
        err[name] = ((got - want).norm() / want.norm()).item()
    sdpa = ba.cudnn_sdpa(b, t)
    times = {"sdpa": [], "base": [], "new": []}
    for _ in range(reps):
        times["sdpa"].append(do_bench_cudagraph(sdpa))
        for name, src in sources.items():
            fast._SOURCE = src  # (the graph captures the launch of this build's kernel)
            times[name].append(do_bench_cudagraph(lambda: da.decode_attention(q, kv)))
    fast._SOURCE = sources["new"]
    med = {k: statistics.median(v) for k, v in times.items()}
    row = dict(preset=preset, batch=b, context=t, err_vs_triton=err, ms=med, all_ms=times,
               base_vs_sdpa=med["sdpa"] / med["base"], new_vs_sdpa=med["sdpa"] / med["new"],
               new_over_base_time=med["new"] / med["base"], bytes=nbytes)
    print(f"{preset} {b}x{t}: sdpa {med['sdpa'] * 1e3:.1f} base {med['base'] * 1e3:.1f} new "
          f"{med['new'] * 1e3:.1f} us | base {row['base_vs_sdpa']:.3f}x new {row['new_vs_sdpa']:.3f}x sdpa | "
          f"err {err['base']:.1e} / {err['new']:.1e}", flush=True)
    return row


if __name__ == "__main__":
    main()
