"""A/B of plans at 1 x 4k (no kernel change): fast.choose's (warps, splits) forced, the exact copies' parts as
fast.exact_parts gives them for that plan, against the plan of main, and cuDNN SDPA. args: --shape --case --preset
--plans (w:s,...) --reps --tag"""
import json, os, statistics, sys, argparse, torch
sys.path.insert(0, "."); sys.path.insert(0, "benchmarks")
from triton.testing import do_bench_cudagraph
import bench_attention as ba
from tq_hf_cache.kernels import decode_attention as da, fast
ap = argparse.ArgumentParser(); ap.add_argument("--case", default="1x4096")
ap.add_argument("--preset", default="k4v4"); ap.add_argument("--plans", default="8:15,16:15")
ap.add_argument("--reps", type=int, default=7); ap.add_argument("--tag", default="plan")
ap.add_argument("--shape", default="llama-3.1-8b")
a = ap.parse_args()
ba.HQ, ba.HKV, ba.D = ba.SHAPES[a.shape]
choose = fast.choose
seen = {}
def forced(w, s):
    def f(*x, **k):
        return (w, s, False)
    return f
def traced(*x, **k):
    got = choose(*x, **k); seen["main"] = got; return got
variants = {"main": traced, **{f"w{w}s{s}": forced(int(w), int(s)) for w, s in (p.split(":") for p in a.plans.split(","))}}
kb, vb, _ = ba.parse_preset(a.preset)
b, t = map(int, a.case.split("x"))
kv, _ = ba.packed_layer(b, t, kb, vb)
q = torch.randn(b, ba.HQ, 1, ba.D, device="cuda", dtype=torch.bfloat16)
want = da.decode_attention(q, kv, fast=False).float()
err = {}
for n, f in variants.items():
    fast.choose = f
    got = da.decode_attention(q, kv).float(); torch.cuda.synchronize()
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
row = dict(shape=a.shape, preset=a.preset, case=a.case, main_plan=seen.get("main"), us=med,
           vs_sdpa={k: round(med["sdpa"] / v, 3) for k, v in med.items()}, err=err,
           all_us={k: [round(x * 1e3, 2) for x in v] for k, v in times.items()})
print(json.dumps({k: row[k] for k in ("shape", "preset", "case", "main_plan", "us", "vs_sdpa", "err")}), flush=True)
json.dump(row, open(os.path.join(os.environ.get("OUT", "/tmp"), a.tag + ".json"), "w"), indent=1)
