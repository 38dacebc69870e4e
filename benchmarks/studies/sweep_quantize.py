"""Launch-configuration sweep of the fused quantize kernel (Llama-3.1-8B-shaped layer: 8 KV heads, D=128, bf16).

    PYTHONPATH=. python benchmarks/studies/sweep_quantize.py --out <dir>   # -> sweep_quantize.json

For each bit width: every configuration is first checked against the torch reference on fresh random input
(index mismatches only at near-boundary ties, norms within fp16 rounding), then timed at B=8, T=32768 with
triton.testing.do_bench (median, L2 flushed) and reported as bytes read + written per second and as % of a
device-to-device copy measured in the same run. 4 bits gets the full grid (pipeline stages x programs per SM x
tokens per program x warps); the other widths get the best few 4-bit configurations, except those in --wide
(default 8 bits, where the search gathers from a table): each search that serves them x tile shapes x programs per SM.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
import triton
from triton.testing import do_bench

from tq_hf_cache import reference
from tq_hf_cache.kernels import quantize as Q
from tq_hf_cache.packing import packed_bytes, unpack_indices
from tq_hf_cache.rotation import make_rotation

from bench_quantize import D, H, codebook  # the same layer shape and codebooks as the main benchmark

DEV = torch.device("cuda")


def check(rot, cb, cfg) -> dict:
    x = torch.randn(2, H, 1000, D, device=DEV) * torch.rand(2, H, 1000, 1, device=DEV).add(0.1)
    x = x.to(torch.bfloat16)
    nb = packed_bytes(D, cb.bits)
    p = torch.full((2, H, 1000, nb), 0xA5, dtype=torch.uint8, device=DEV)
    n = torch.full((2, H, 1000), float("nan"), dtype=torch.float16, device=DEV)
    Q.quantize_into(x, rot, cb, p, n, **cfg)
    rp, rn = reference.quantize(x, rot, cb, torch.float16)
    got, want = unpack_indices(p, cb.bits, D), unpack_indices(rp, cb.bits, D)
    bad = got != want
    far = int(((got - want).abs() > 1).sum())
    nerr = float(((n.float() - rn.float()).abs() / rn.float()).max())
    mism = float(bad.float().mean())
    return {"index_mismatch": mism, "non_adjacent": far, "norm_max_rel_err": nerr,
            "ok": bool(mism < 1e-3 and far == 0 and nerr < 1e-3 and not torch.isnan(n).any())}


def timed(rot, cb, cfg, bsz=8, tokens=32768) -> dict:
    nb = packed_bytes(D, cb.bits)
    x = torch.randn(bsz, H, tokens, D, device=DEV, dtype=torch.bfloat16)
    p = torch.empty(bsz, H, tokens, nb, dtype=torch.uint8, device=DEV)
    n = torch.empty(bsz, H, tokens, dtype=torch.float16, device=DEV)
    k = Q.quantize_into(x, rot, cb, p, n, **cfg)
    torch.cuda.synchronize()
    ms = float(do_bench(lambda: Q.quantize_into(x, rot, cb, p, n, **cfg), warmup=25, rep=100, return_mode="median"))
    byts = bsz * H * tokens * (2 * D + nb + 2)
    return {"ms": ms, "GBps": byts / ms / 1e6, "regs": getattr(k, "n_regs", None), "spills": getattr(k, "n_spills", None)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--bits", default="4,2,3,8")
    ap.add_argument("--top", type=int, default=3)
    ap.add_argument("--wide", default="8", help="bit widths that get the search x tile x residency grid")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    a = torch.randn(1 << 30, device=DEV, dtype=torch.bfloat16)
    b = torch.empty_like(a)
    copy = 2 * a.numel() * 2 / float(do_bench(lambda: b.copy_(a), warmup=25, rep=100, return_mode="median")) / 1e6
    del a, b
    torch.cuda.empty_cache()
    rot = make_rotation(D, 0).to(DEV)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "copy_GBps": copy, "B": 8, "T": 32768, "rows": []}
    print(f"copy {copy:.0f} GB/s", flush=True)
    grid = [dict(stages=s, progs_per_sm=p, block_t=bt, num_warps=w)
            for s, p, (bt, w) in itertools.product((1, 3), (4, 6, 8), ((64, 4), (128, 8)))]
    # widths whose search is gather-bound: every search that serves them x tile shapes x residency
    wide = [dict(search=m, stages=1, progs_per_sm=p, block_t=bt, num_warps=w, **({"maxnreg": r} if r else {}))
            for m, p, (bt, w, r) in itertools.product(("poly", "lut"), (4, 8), ((64, 4, None), (64, 4, 128), (64, 8, None)))]
    wide_bits = {int(v) for v in args.wide.split(",") if v}
    best4 = None
    for bits in [int(v) for v in args.bits.split(",")]:
        cb = codebook(bits).to(DEV)
        cfgs = wide if bits in wide_bits else (grid if best4 is None else best4)
        rows = []
        for cfg in cfgs:
            row = {"bits": bits, **cfg}
            try:
                row.update(check(rot, cb, cfg))
                row.update(timed(rot, cb, cfg))
                row["pct_copy"] = 100 * row["GBps"] / copy
            except Exception as e:  # a configuration this triton cannot compile must not lose the run
                row["error"] = repr(e)[:300]
            rows.append(row)
            res["rows"].append(row)
            print(f"bits={bits} {cfg}: " + (f"ERR {row['error'][:100]}" if "error" in row else
                  f"{row['GBps']:.0f} GB/s {row['pct_copy']:.0f}% regs {row['regs']} spills {row['spills']} "
                  f"{'ok' if row['ok'] else 'CHECK FAILED ' + str(row)}"), flush=True)
            with open(os.path.join(args.out, "sweep_quantize.json"), "w") as f:
                json.dump(res, f, indent=1)
        if best4 is None and bits not in wide_bits:
            good = sorted((r for r in rows if r.get("ok")), key=lambda r: -r["GBps"])[: args.top]
            if not good:
                raise SystemExit(f"no {bits}-bit configuration passed its check")
            best4 = [{k: r[k] for k in ("stages", "progs_per_sm", "block_t", "num_warps")} for r in good]
            if bits <= 4:  # the linear scan at the best configuration, for the record
                cfg = dict(best4[0], search="linear")
                row = {"bits": bits, **cfg}
                row.update(check(rot, cb, cfg))
                row.update(timed(rot, cb, cfg))
                row["pct_copy"] = 100 * row["GBps"] / copy
                res["rows"].append(row)
                print(f"bits={bits} {cfg}: {row['GBps']:.0f} GB/s {row['pct_copy']:.0f}% {'ok' if row['ok'] else 'CHECK FAILED'}")
    print("\nbest per bit width:")
    for bits in sorted({r["bits"] for r in res["rows"]}):
        ok = [r for r in res["rows"] if r["bits"] == bits and r.get("ok") and r.get("search") != "linear"]
        if ok:
            r = max(ok, key=lambda r: r["GBps"])
            print(f"  {bits} bits: {r['GBps']:.0f} GB/s = {r['pct_copy']:.0f}% of copy, stages {r['stages']} "
                  f"progs/SM {r['progs_per_sm']} block_t {r['block_t']} warps {r['num_warps']} search {r.get('search')}")
    print("all checks OK" if all(r.get("ok") for r in res["rows"] if "error" not in r) else "SOME CHECKS FAILED")


if __name__ == "__main__":
    main()
