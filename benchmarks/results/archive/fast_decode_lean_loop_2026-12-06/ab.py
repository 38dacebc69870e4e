"""A/B of kernel sources, interleaved, with cuDNN SDPA. argv: out cases(;) reps variants(, name=path; 'base' = tree)"""
import json, os, statistics, sys, time
sys.path.insert(0, os.getcwd()); sys.path.insert(0, "benchmarks")
import torch
from triton.testing import do_bench_cudagraph
import bench_attention as ba
from tq_hf_cache.kernels import decode_attention as da
from tq_hf_cache.kernels import fast

out, CASES, REPS = sys.argv[1], sys.argv[2].split(";"), int(sys.argv[3])
SRC = {"base": fast.source()}
for v in sys.argv[4].split(","):
    n, _, pth = v.partition("=")
    if pth:
        SRC[n] = open(pth).read()
VARS = list(SRC)
def setv(v):
    fast.source = lambda: SRC[v]
rows = []
for case in CASES:
    shape, preset, bt = case.split("/")
    ba.HQ, ba.HKV, ba.D = ba.SHAPES[shape]
    b, t = map(int, bt.split("x"))
    kb, vb, _ = ba.parse_preset(preset)
    kv, nbytes = ba.packed_layer(b, t, kb, vb)
    q = torch.randn(b, ba.HQ, 1, ba.D, device="cuda", dtype=torch.bfloat16)
    outs = {}
    for v in VARS:
        setv(v)
        outs[v] = da.decode_attention(q, kv).float()
    ref = outs["base"]
    err = {v: ((o - ref).norm() / ref.norm()).item() for v, o in outs.items()}
    same = {v: bool(torch.equal(o, ref)) for v, o in outs.items()}
    sdpa = ba.cudnn_sdpa(b, t)
    times = {"sdpa": [], **{v: [] for v in VARS}}
    for _ in range(REPS):
        times["sdpa"].append(do_bench_cudagraph(sdpa))
        for v in VARS:
            setv(v)
            times[v].append(do_bench_cudagraph(lambda: da.decode_attention(q, kv)))
    med = {k: statistics.median(x) * 1e3 for k, x in times.items()}
    rows.append(dict(case=case, bytes=nbytes, err=err, equal=same, us=med, all_ms=times))
    print(case, "equal", [v for v in VARS if same[v]], " ".join(f"{k} {x:.2f}" for k, x in med.items()),
          " | vs base " + " ".join(f"{v} {med['base'] / med[v]:.3f}" for v in VARS[1:]), flush=True)
    kv = None
    torch.cuda.empty_cache()
json.dump(dict(device=torch.cuda.get_device_name(), when=time.strftime("%Y-%m-%d %H:%M"), argv=sys.argv,
               rows=rows), open(out, "w"), indent=1)
