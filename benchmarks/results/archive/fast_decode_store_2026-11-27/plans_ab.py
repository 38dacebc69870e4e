"""A/B of plans (no kernel change): main's fast.choose, the same with 8-warp CTAs taking at least 256 tokens a split
(`min256`: MIN_TOKENS_PER_SPLIT[8] = 256 instead of 512), and forced (warps, splits) plans; cuDNN SDPA in the same
run. Rows append to $OUT/plans.json. args: --shape --cases --preset --force (w:s,...) --reps"""
import json, os, statistics, sys, argparse, torch
sys.path.insert(0, "."); sys.path.insert(0, "benchmarks")
from triton.testing import do_bench_cudagraph
import bench_attention as ba
from tq_hf_cache.kernels import decode_attention as da, fast
ap = argparse.ArgumentParser(); ap.add_argument("--cases", default="1x4096")
ap.add_argument("--preset", default="k4v4"); ap.add_argument("--force", default="")
ap.add_argument("--reps", type=int, default=7); ap.add_argument("--shape", default="llama-3.1-8b")
a = ap.parse_args()
ba.HQ, ba.HKV, ba.D = ba.SHAPES[a.shape]
choose, seen = fast.choose, {}
def rule(min8):
    def f(*x, **k):
        old = fast.MIN_TOKENS_PER_SPLIT[8]
        fast.MIN_TOKENS_PER_SPLIT[8] = min8
        try:
            got = choose(*x, **k)
        finally:
            fast.MIN_TOKENS_PER_SPLIT[8] = old
        seen[min8] = got
        return got
    return f
def forced(w, s):
    return lambda *x, **k: (w, s, False)
variants = {"main": rule(512), "min256": rule(256)}
for p in filter(None, a.force.split(",")):
    w, s = map(int, p.split(":")); variants[f"w{w}s{s}"] = forced(w, s)
kb, vb, _ = ba.parse_preset(a.preset)
path = os.path.join(os.environ.get("OUT", "/tmp"), "plans.json")
rows = json.load(open(path)) if os.path.exists(path) else []
for case in a.cases.split(","):
    b, t = map(int, case.split("x"))
    kv, _ = ba.packed_layer(b, t, kb, vb)
    q = torch.randn(b, ba.HQ, 1, ba.D, device="cuda", dtype=torch.bfloat16)
    try:
        want = da.decode_attention(q, kv, fast=False).float()
    except ValueError:
        want = None
    err, plans = {}, {}
    for n, f in variants.items():
        fast.choose = f
        got = da.decode_attention(q, kv).float(); torch.cuda.synchronize()
        plans[n] = seen.get(512) if n == "main" else seen.get(256) if n == "min256" else n
        if want is not None:
            err[n] = float(((got - want).norm() / want.norm()).item())
    sdpa = ba.cudnn_sdpa(b, t)
    times = {"sdpa": [], **{n: [] for n in variants}}
    for _ in range(a.reps):
        times["sdpa"].append(do_bench_cudagraph(sdpa))
        for n, f in variants.items():
            fast.choose = f
            times[n].append(do_bench_cudagraph(lambda: da.decode_attention(q, kv)))
    fast.choose = choose
    med = {k: round(statistics.median(v) * 1e3, 2) for k, v in times.items()}
    row = dict(shape=a.shape, preset=a.preset, case=case, plans=plans, us=med,
               vs_sdpa={k: round(med["sdpa"] / v, 3) for k, v in med.items()}, err=err,
               all_us={k: [round(x * 1e3, 2) for x in v] for k, v in times.items()})
    print(json.dumps({k: row[k] for k in ("shape", "preset", "case", "plans", "us", "vs_sdpa")}), flush=True)
    rows.append(row); json.dump(rows, open(path, "w"), indent=1)
    kv = None; torch.cuda.empty_cache()
