"""Per-layer decode attention on the H100: the fast kernel's shared-memory layout (ring depth STAGES, pair-table
copies KR / VR) as `kernels.fast.layout` chooses it against fixed ones, and extra source defines, beside cuDNN SDPA
on bf16 K/V; Llama-3.1-8B shape (32 / 8 heads, head dim 128), one query.

Each variant's output is compared with the Triton kernel's (max abs error), then every variant and SDPA are captured as
CUDA graphs of 10 calls and replayed 25 times, interleaved; medians in us per call. Writes JSON.
Usage:
    python benchmarks/studies/fast_decode_layouts.py CASES PRESETS VARIANTS OUT
    e.g. 1x32768,1x131072 k5v3,k4v4 '{"chosen": {}, "old": {"layout": [3, 4, 32]}, "x": {"extra": {"NAME": 1}}}' F
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import bench_attention as ba  # noqa: E402
from tq_hf_cache.kernels import decode_attention as da  # noqa: E402
from tq_hf_cache.kernels import fast  # noqa: E402

_LAYOUT, _DEFINES = fast.layout, fast.defines


def use(variant: dict) -> None:
    """Make the next compiles take this variant's layout and extra defines (the study's only lever on the kernel)."""
    fixed = variant.get("layout")
    fast.layout = (lambda *a, **k: tuple(fixed)) if fixed else _LAYOUT
    extra = variant.get("extra", {})
    fast.defines = lambda *a, **k: {**_DEFINES(*a, **k), **extra}


def graph(fn) -> torch.cuda.CUDAGraph:
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(10):
            fn()
    return g


def main() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cases, presets, variants, out = sys.argv[1].split(","), sys.argv[2].split(","), json.loads(sys.argv[3]), sys.argv[4]
    res = {"device": torch.cuda.get_device_name(), "variants": variants, "rows": []}
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for case in cases:
        b, t = map(int, case.split("x"))
        qq = torch.randn(b, ba.HQ, 1, ba.D, device="cuda", dtype=torch.bfloat16)
        sk = torch.randn(b, ba.HKV, t, ba.D, device="cuda", dtype=torch.bfloat16)
        sv = torch.randn_like(sk)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            graphs = {"sdpa": graph(lambda: sdpa(qq, sk, sv, enable_gqa=True))}
        for preset in presets:
            kb, vb = map(int, preset[1:].split("v"))
            kv, _ = ba.packed_layer(b, t, kb, vb)
            q = torch.randn(b, ba.HQ, 1, ba.D, device="cuda", dtype=torch.bfloat16)
            ref = da.decode_attention(q, kv, fast=False).float()
            rows, errs = dict(graphs), {}
            for name, v in variants.items():
                use(v)
                errs[name] = float((da.decode_attention(q, kv).float() - ref).abs().max())
                rows[name] = graph(lambda: da.decode_attention(q, kv))
            use({})
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ts = {k: [] for k in rows}
            for _ in range(25):
                for k, g in rows.items():
                    torch.cuda.synchronize()
                    e0.record()
                    g.replay()
                    e1.record()
                    torch.cuda.synchronize()
                    ts[k].append(e0.elapsed_time(e1) * 100)  # ms for 10 calls -> us per call
            med = {k: round(sorted(v)[len(v) // 2], 2) for k, v in ts.items()}
            row = {"case": case, "preset": preset, "us_per_call": med, "max_err_vs_triton": errs,
                   "x_sdpa": {k: round(med["sdpa"] / v, 3) for k, v in med.items() if k != "sdpa"}}
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
