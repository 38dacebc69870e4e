"""A/B of kernel sources (base: .dev/s31/base.cu = HEAD's; new: the tree's) x short fold tokens x ring depth at head
dim 64, interleaved, with cuDNN SDPA. variants 'src:fold[:stages]'. argv: out cases reps variants"""
import json, os, statistics, sys, time
sys.path.insert(0, os.getcwd()); sys.path.insert(0, "benchmarks")
import torch
from triton.testing import do_bench_cudagraph
import bench_attention as ba
from tq_hf_cache.kernels import decode_attention as da
from tq_hf_cache.kernels import fast

SRC = {"new": fast.source(), "base": open(".dev/s31/base.cu").read()}
STAGES = fast.stages
cur = [None]

def setv(v):
    name, fold, *st = v.split(":")
    fast.source = lambda: SRC[name]
    fast.SHORT_FOLD_TOKENS = int(fold)
    want = int(st[0]) if st else None
    if cur[0] != want:
        fast.stages = (lambda d: (want, 3, 2) if d == 64 else STAGES(d)) if want else STAGES
        fast.layout.cache_clear(); fast.warps.cache_clear()
        cur[0] = want

out, CASES = sys.argv[1], sys.argv[2].split(";")
REPS, VARS = int(sys.argv[3]), sys.argv[4].split(",")
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
    ref = outs[VARS[0]]
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
    rows.append(dict(case=case, err=err, equal=same, us=med, all_ms=times))
    print(case, "maxerr %.1e" % max(err.values()), "equal", [v for v in VARS if same[v]],
          " ".join(f"{k} {x:.2f}" for k, x in med.items()), flush=True)
    kv = None
    torch.cuda.empty_cache()
json.dump(dict(device=torch.cuda.get_device_name(), when=time.strftime("%Y-%m-%d %H:%M"), argv=sys.argv,
               rows=rows), open(out, "w"), indent=1)
