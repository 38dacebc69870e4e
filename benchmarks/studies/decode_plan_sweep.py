"""Pipeline stages x programs per SM x hand prefetch of the fused decode kernel (`kernels.decode_plan`), per head dim
and preset.

With 2 stages Triton pipelines the centroid-table loads through shared memory; with 1 they are plain loads, and the
program's shared memory drops from 24.7 to 16.4 KB, so more one-warp programs fit on an SM. For each shape, preset,
batch and context: the kernel's time (CUDA-graph replays, median; `bench_attention.kernel_time`) at stages 1 and 2,
4 / 6 / 8 programs per SM (the splits that many programs give) and each --prefetch (2: the next tile's loads issued
before this tile's math; 0: not), each output checked against the default plan's.
Writes $OUT/decode_plan_sweep.json.

Usage: python benchmarks/studies/decode_plan_sweep.py [--prefetch 2,0] [--cases llama-3.1-8b:k5v3,k4v4:1x4096 ...]
Each case is shape:presets:batch x contexts; shapes are bench_attention's (llama-3.1-8b, gemma-3-4b, gemma-3-12b)
and smollm2 (9 query heads, 3 KV heads, head dim 64). Presets may carry a key split (k5v3:32x6+32x4+64x3).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, ".."))

import bench_attention as ba  # noqa: E402

from tq_hf_cache import kernels  # noqa: E402

SHAPES = dict(ba.SHAPES, smollm2=(9, 3, 64))
CASES = ("llama-3.1-8b:k5v3,k4v4,k4v2,k3v4,k8v4,k3v3,k2v2,k5v3/32x6+32x4+64x3:1x4096,1x32768,1x131072,8x4096,8x32768 "
         "smollm2:k5v3,k4v4,k4v2,k3v3,k8v4,k3v4:1x4096,1x32768,8x32768 "
         "gemma-3-12b:k5v3,k3v3:1x32768,1x131072,8x32768")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default=CASES, help="space-separated shape:presets:BxT,... (a split preset's ':' as '/')")
    p.add_argument("--prefetch", default="2,0")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    a = p.parse_args()
    rows, t0 = [], time.time()
    for case in a.cases.split():
        shape, presets, sizes = case.split(":")
        hq, hkv, d = SHAPES[shape]
        ba.HQ, ba.HKV, ba.D = hq, hkv, d
        for preset, size in itertools.product(presets.split(","), sizes.split(",")):
            b, t = map(int, size.split("x"))
            kv, _ = ba.packed_layer(b, t, *ba.parse_preset(preset.replace("/", ":")))
            _, want = ba.kernel_time(kv, b)
            prefetches = [int(x) for x in a.prefetch.split(",")]
            for stages, per_sm, pf in itertools.product((2, 1), (4, 6, 8), prefetches):
                splits = kernels.num_splits_for(b * hkv, t - ba.RESIDUAL, ba.DEV, per_sm)
                ms, out = ba.kernel_time(kv, b, num_splits=splits, num_stages=stages, prefetch=pf)
                row = {"shape": shape, "preset": preset.replace("/", ":"), "batch": b, "context": t,
                       "stages": stages, "programs_per_sm": per_sm, "prefetch": pf, "num_splits": splits,
                       "kernel_ms": round(ms, 4),
                       "max_abs_diff_vs_default": float((out.float() - want.float()).abs().max())}
                rows.append(row)
                print(row, flush=True)
            del kv
            torch.cuda.empty_cache()
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "decode_plan_sweep.json")
    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows, "seconds": round(time.time() - t0, 1)}, f,
                  indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
