"""Centroid lookups in the fused decode kernel: the multi-centroid entries of `lookup_table` (lut 0) against one
fp16 centroid per load from a one-line table (lut 1) and against a table held across the warp's lanes, read with
shuffles (lut 2). Times one Llama-3.1-8B-shaped layer (CUDA-graph replays, median) and checks every variant's
output against lut 0's.

Usage: python benchmarks/studies/lut_study.py [--out DIR]       writes DIR/lut_study.json
       python benchmarks/studies/lut_study.py --profile LUT     a few launches for ncu (k5v3, batch 1, 128k)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_attention import DEV, HKV, HQ, D, kernel_time, packed_layer, sdpa_time  # noqa: E402

from tq_hf_cache import kernels  # noqa: E402
from tq_hf_cache.kernels import decode_attention as da  # noqa: E402

PRESETS = {"k5v3": (5, 3), "k4v4": (4, 4), "k4v2": (4, 2)}
CASES = ((1, 131072), (8, 32768))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--profile", type=int, default=None)
    p.add_argument("--luts", default="0,1,2")
    p.add_argument("--block-n", default="32,64")
    p.add_argument("--per-sm", default="4,8")
    a = p.parse_args()
    if a.profile is not None:
        kv, _ = packed_layer(1, 131072, 5, 3)
        q = torch.randn(1, HQ, 1, D, device=DEV, dtype=torch.bfloat16)
        for _ in range(4):
            da.decode_attention(q, kv, lut=a.profile)
        torch.cuda.synchronize()
        return
    rows = []
    for name, (b, t) in itertools.product(PRESETS, CASES):
        kv, nbytes = packed_layer(b, t, *PRESETS[name])
        sdpa_ms, _ = sdpa_time(b, t)
        _, want = kernel_time(kv, b)
        for lut, bn, per_sm in itertools.product(*(map(int, s.split(",")) for s in (a.luts, a.block_n, a.per_sm))):
            splits = kernels.num_splits_for(b * HKV, t, DEV, per_sm)
            r = {"preset": name, "batch": b, "context": t, "lut": lut, "block_n": bn, "programs_per_sm": per_sm}
            try:
                ms, out = kernel_time(kv, b, lut=lut, block_n=bn, num_splits=splits)
            except Exception as e:  # noqa: BLE001
                r["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            else:
                r.update(kernel_ms=round(ms, 4), sdpa_ms=round(sdpa_ms, 4), speedup_vs_sdpa=round(sdpa_ms / ms, 3),
                         GBps=round(nbytes / ms / 1e6, 1),
                         max_abs_diff_vs_lut0=float((out.float() - want.float()).abs().max()))
            rows.append(r)
            print(r, flush=True)
        del kv
        torch.cuda.empty_cache()
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "lut_study.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
