"""A/B (branch s28-spv): store_partial four positions a thread, one LDS.128 a warp (SPV) against main (SPV=0: main
SASS), and cuDNN SDPA. args: --shape --cases --presets --reps --tag"""
import json, os, statistics, sys, argparse, torch
sys.path.insert(0, "."); sys.path.insert(0, "benchmarks")
from triton.testing import do_bench_cudagraph
import bench_attention as ba
from tq_hf_cache.kernels import decode_attention as da, fast
ap = argparse.ArgumentParser(); ap.add_argument("--cases", default="1x4096")
ap.add_argument("--presets", default="k5v3,k4v4"); ap.add_argument("--reps", type=int, default=7); ap.add_argument("--tag", default="dry")
ap.add_argument("--shape", default="llama-3.1-8b")
a = ap.parse_args()
ba.HQ, ba.HKV, ba.D = ba.SHAPES[a.shape]
defines = fast.defines
def with_(ml, sp):
    return lambda *x, **k: {**defines(*x, **k), "SPV": ml}
variants = {"main": with_(0, 0), "spv": with_(1, 0)}
out = []
for preset in a.presets.split(","):
    kb, vb, _ = ba.parse_preset(preset)
    for case in a.cases.split(","):
        b, t = map(int, case.split("x"))
        kv, _ = ba.packed_layer(b, t, kb, vb)
        q = torch.randn(b, ba.HQ, 1, ba.D, device="cuda", dtype=torch.bfloat16)
        try:
            want = da.decode_attention(q, kv, fast=False).float()
        except ValueError:
            want = None
        err, got = {}, {}
        for n, f in variants.items():
            fast.defines = f
            got[n] = da.decode_attention(q, kv).float(); torch.cuda.synchronize()
            if want is not None:
                err[n] = float(((got[n] - want).norm() / want.norm()).item())
        err["spv_equal"] = bool(torch.equal(got["main"], got["spv"]))
        sdpa = ba.cudnn_sdpa(b, t)
        times = {"sdpa": [], **{n: [] for n in variants}}
        for _ in range(a.reps):
            times["sdpa"].append(do_bench_cudagraph(sdpa))
            for n, f in variants.items():
                fast.defines = f
                times[n].append(do_bench_cudagraph(lambda: da.decode_attention(q, kv)))
        for n, f in variants.items():  # the counters back at zero: a call after the timed ones gives the same output
            fast.defines = f
            err[n + "_again_equal"] = bool(torch.equal(da.decode_attention(q, kv).float(), got[n]))
        fast.defines = defines
        med = {k: round(statistics.median(v) * 1e3, 2) for k, v in times.items()}
        row = dict(shape=a.shape, preset=preset, case=case, us=med, vs_sdpa={k: round(med["sdpa"] / v, 3) for k, v in med.items()},
                   err=err, all_us={k: [round(x * 1e3, 2) for x in v] for k, v in times.items()})
        print(json.dumps({k: row[k] for k in ("shape", "preset", "case", "us", "vs_sdpa", "err")}), flush=True); out.append(row)
        kv = None; torch.cuda.empty_cache()
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), a.tag + ".json"), "w"), indent=1)
