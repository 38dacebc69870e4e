"""Forced launch plans of the fast kernel against the default (choose + exact_parts), interleaved, with cuDNN SDPA.
argv: out cases(;-sep shape/preset/BxT) reps plans(,-sep w:s:f:p or 'auto'; per case: after '|' in case)"""
import json, os, statistics, sys, time
sys.path.insert(0, os.getcwd()); sys.path.insert(0, "benchmarks")
import torch
from triton.testing import do_bench_cudagraph
import bench_attention as ba
from tq_hf_cache.kernels import decode_attention as da
from tq_hf_cache.kernels import fast

CH, EP = fast.choose, fast.exact_parts
seen = {}
def setp(pl):
    if pl == "auto":
        def ch(*a, **k):
            r = CH(*a, **k); seen["choose"] = r; return r
        def ep(*a, **k):
            r = EP(*a, **k); seen["parts"] = r; return r
        fast.choose, fast.exact_parts = ch, ep
    else:
        w, s, f, p = map(int, pl.split(":"))
        fast.choose = lambda *a, **k: (w, s, f)
        fast.exact_parts = lambda *a, **k: p

out, CASES, REPS = sys.argv[1], sys.argv[2].split(";"), int(sys.argv[3])
rows = []
for case in CASES:
    case, _, pls = case.partition("|")
    PL = ["auto"] + [x for x in pls.split(",") if x]
    shape, preset, bt = case.split("/")
    ba.HQ, ba.HKV, ba.D = ba.SHAPES[shape]
    b, t = map(int, bt.split("x"))
    kb, vb, _ = ba.parse_preset(preset)
    kv, nbytes = ba.packed_layer(b, t, kb, vb)
    q = torch.randn(b, ba.HQ, 1, ba.D, device="cuda", dtype=torch.bfloat16)
    outs = {}
    for v in PL:
        setp(v)
        outs[v] = da.decode_attention(q, kv).float()
    auto = (*seen["choose"], seen["parts"])
    ref = outs["auto"]
    err = {v: ((o - ref).norm() / ref.norm()).item() for v, o in outs.items()}
    sdpa = ba.cudnn_sdpa(b, t)
    times = {"sdpa": [], **{v: [] for v in PL}}
    for _ in range(REPS):
        times["sdpa"].append(do_bench_cudagraph(sdpa))
        for v in PL:
            setp(v)
            times[v].append(do_bench_cudagraph(lambda: da.decode_attention(q, kv)))
    med = {k: statistics.median(x) * 1e3 for k, x in times.items()}
    rows.append(dict(case=case, auto=auto, err=err, us=med, all_ms=times))
    print(case, "auto", auto, "maxerr %.1e" % max(err.values()), " ".join(f"{k} {x:.2f}" for k, x in med.items()),
          flush=True)
    kv = None
    torch.cuda.empty_cache()
json.dump(dict(device=torch.cuda.get_device_name(), when=time.strftime("%Y-%m-%d %H:%M"), argv=sys.argv,
               rows=rows), open(out, "w"), indent=1)
