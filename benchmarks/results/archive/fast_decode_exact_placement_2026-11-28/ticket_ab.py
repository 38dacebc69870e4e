"""base (.dev/s32/base.cu) against the tree's source: N calls of the tree's compared bit for bit with base's output
(the arrival protocol must not change a bit, call after call), then interleaved CUDA-graph timings with SDPA.
argv: out cases reps ncheck"""
import json, os, statistics, sys, time
sys.path.insert(0, os.getcwd()); sys.path.insert(0, "benchmarks")
import torch
from triton.testing import do_bench_cudagraph
import bench_attention as ba
from tq_hf_cache.kernels import decode_attention as da
from tq_hf_cache.kernels import fast
SRC = {"base": open(".dev/s32/base.cu").read(), "new": fast.source()}
out, CASES, REPS, NCHECK = sys.argv[1], sys.argv[2].split(";"), int(sys.argv[3]), int(sys.argv[4])
rows = []
for case in CASES:
    shape, preset, bt = case.split("/")
    ba.HQ, ba.HKV, ba.D = ba.SHAPES[shape]
    b, t = map(int, bt.split("x"))
    kb, vb, _ = ba.parse_preset(preset)
    kv, _ = ba.packed_layer(b, t, kb, vb)
    q = torch.randn(b, ba.HQ, 1, ba.D, device="cuda", dtype=torch.bfloat16)
    fast.source = lambda: SRC["base"]
    ref = da.decode_attention(q, kv).clone()
    fast.source = lambda: SRC["new"]
    bad = 0
    for i in range(NCHECK):
        o = da.decode_attention(q, kv)
        bad += int(not torch.equal(o, ref))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        og = da.decode_attention(q, kv)
    for i in range(NCHECK):
        g.replay()
        bad += int(not torch.equal(og, ref))
    torch.cuda.synchronize()
    sdpa = ba.cudnn_sdpa(b, t)
    times = {"sdpa": [], "base": [], "new": []}
    for _ in range(REPS):
        times["sdpa"].append(do_bench_cudagraph(sdpa))
        for v in ("base", "new"):
            fast.source = lambda v=v: SRC[v]
            times[v].append(do_bench_cudagraph(lambda: da.decode_attention(q, kv)))
    med = {k: statistics.median(x) * 1e3 for k, x in times.items()}
    rows.append(dict(case=case, mismatches=bad, checked=2 * NCHECK, us=med, all_ms=times))
    print(case, f"mismatches {bad}/{2 * NCHECK}", " ".join(f"{k} {x:.2f}" for k, x in med.items()), flush=True)
json.dump(dict(device=torch.cuda.get_device_name(), when=time.strftime("%Y-%m-%d %H:%M"), argv=sys.argv,
               rows=rows), open(out, "w"), indent=1)
