"""A/B (branch s28-pdl): the kernel launched as a programmatic dependent launch, griddepcontrol.wait at its entry (PDL)
against main (PDL=0: main SASS, a plain launch), and cuDNN SDPA; each timed alone (back-to-back calls in a CUDA graph)
and after a copy into the query (a torch kernel before every call, as a model's rotary / store kernel before its
attention). args: --shape --cases --presets --reps --tag"""
import json, os, statistics, sys, argparse, torch
sys.path.insert(0, "."); sys.path.insert(0, "benchmarks")
from triton.testing import do_bench_cudagraph
from torch.nn.attention import SDPBackend, sdpa_kernel
import bench_attention as ba
from tq_hf_cache.kernels import decode_attention as da, fast
ap = argparse.ArgumentParser(); ap.add_argument("--cases", default="1x4096")
ap.add_argument("--presets", default="k5v3,k4v4"); ap.add_argument("--reps", type=int, default=7); ap.add_argument("--tag", default="pdl")
ap.add_argument("--shape", default="llama-3.1-8b")
a = ap.parse_args()
ba.HQ, ba.HKV, ba.D = ba.SHAPES[a.shape]
defines = fast.defines
def with_(v):
    return lambda *x, **k: {**defines(*x, **k), "PDL": v}
variants = {"main": with_(0), "pdl": with_(1)}
out = []
f = torch.nn.functional.scaled_dot_product_attention
for preset in a.presets.split(","):
    kb, vb, _ = ba.parse_preset(preset)
    for case in a.cases.split(","):
        b, t = map(int, case.split("x"))
        kv, _ = ba.packed_layer(b, t, kb, vb)
        q = torch.randn(b, ba.HQ, 1, ba.D, device="cuda", dtype=torch.bfloat16)
        q2 = q.clone()
        try:
            want = da.decode_attention(q, kv, fast=False).float()
        except ValueError:
            want = None
        err, got = {}, {}
        for n, fn in variants.items():
            fast.defines = fn
            got[n] = da.decode_attention(q, kv).float(); torch.cuda.synchronize()
            if want is not None:
                err[n] = float(((got[n] - want).norm() / want.norm()).item())
        err["pdl_equal"] = bool(torch.equal(got["main"], got["pdl"]))
        sq = torch.randn(b, ba.HQ, 1, ba.D, device="cuda", dtype=torch.bfloat16); sq2 = sq.clone()
        sk = torch.randn(b, ba.HKV, t, ba.D, device="cuda", dtype=torch.bfloat16); sv = torch.randn_like(sk)
        def sdpa():
            return f(sq, sk, sv, enable_gqa=True)
        def sdpa_pre():
            sq.copy_(sq2); return f(sq, sk, sv, enable_gqa=True)
        times = {k: [] for k in ("sdpa", "sdpa_pre", *variants, *(n + "_pre" for n in variants))}
        for _ in range(a.reps):
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                times["sdpa"].append(do_bench_cudagraph(sdpa))
                times["sdpa_pre"].append(do_bench_cudagraph(sdpa_pre))
            for n, fn in variants.items():
                fast.defines = fn
                times[n].append(do_bench_cudagraph(lambda: da.decode_attention(q, kv)))
                times[n + "_pre"].append(do_bench_cudagraph(lambda: (q.copy_(q2), da.decode_attention(q, kv))))
        for n, fn in variants.items():  # the counters back at zero: a call after the timed ones gives the same output
            fast.defines = fn
            err[n + "_again_equal"] = bool(torch.equal(da.decode_attention(q, kv).float(), got[n]))
        fast.defines = defines
        med = {k: round(statistics.median(v) * 1e3, 2) for k, v in times.items()}
        vs = {k: round(med["sdpa"] / v, 3) for k, v in med.items() if not k.endswith("_pre")}
        vs.update({k: round(med["sdpa_pre"] / v, 3) for k, v in med.items() if k.endswith("_pre")})
        row = dict(shape=a.shape, preset=preset, case=case, us=med, vs_sdpa=vs, err=err,
                   all_us={k: [round(x * 1e3, 2) for x in v] for k, v in times.items()})
        print(json.dumps({k: row[k] for k in ("shape", "preset", "case", "us", "vs_sdpa", "err")}), flush=True); out.append(row)
        kv = None; torch.cuda.empty_cache()
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), a.tag + ".json"), "w"), indent=1)
