"""A/B of plans on this tree's kernel: 'new' = fast.choose, 'old' = the choose of e42b43a (at head dim 64 and
16 warps, SM-cut splits: 8 warps up to SHORT_TOKENS, else the 16-warp plan), 'f768' = new with SHORT_FOLD_TOKENS 768.
argv: out cases reps."""
import json, os, statistics, sys, time
sys.path.insert(0, os.getcwd()); sys.path.insert(0, "benchmarks")
import torch
from triton.testing import do_bench_cudagraph
import bench_attention as ba
from tq_hf_cache.kernels import decode_attention as da
from tq_hf_cache.kernels import fast

NEW, SHORT = fast.choose, fast.SHORT_FOLD_TOKENS
seen = []

def old(bh, L, dev, most, d, nq, w):
    r = NEW(bh, L, dev, most, d, nq, w)
    if r[0] == 16 and r[2] == SHORT:
        if L <= fast.SHORT_TOKENS and fast.ctas_per_sm(d, nq, 8) == 2:
            return (8, *fast.plan(bh, L, dev, most, 8, d, nq))
        return (16, *fast.plan(bh, L, dev, most, 16, d, nq))
    return r

def setv(name):
    fast.SHORT_FOLD_TOKENS = 768 if name == "f768" else SHORT
    f = old if name == "old" else NEW
    fast.choose = lambda *a, **k: seen.append((name, f(*a, **k))) or seen[-1][1]

VARIANTS = ["new", "old", "f768"]
out, CASES = sys.argv[1], sys.argv[2].split(";")
REPS = int(sys.argv[3]) if len(sys.argv) > 3 else 3
rows = []
for case in CASES:
    shape, preset, bt = case.split("/")
    ba.HQ, ba.HKV, ba.D = ba.SHAPES[shape]
    b, t = map(int, bt.split("x"))
    kb, vb, _ = ba.parse_preset(preset)
    kv, nbytes = ba.packed_layer(b, t, kb, vb)
    q = torch.randn(b, ba.HQ, 1, ba.D, device="cuda", dtype=torch.bfloat16)
    outs, plans = {}, {}
    for name in VARIANTS:
        seen.clear(); setv(name)
        outs[name] = da.decode_attention(q, kv).float()
        plans[name] = seen[-1][1] if seen else None
    err = {n: ((o - outs["new"]).norm() / outs["new"].norm()).item() for n, o in outs.items()}
    sdpa = ba.cudnn_sdpa(b, t)
    times = {"sdpa": [], **{n: [] for n in VARIANTS}}
    for _ in range(REPS):
        times["sdpa"].append(do_bench_cudagraph(sdpa))
        for name in VARIANTS:
            setv(name)
            times[name].append(do_bench_cudagraph(lambda: da.decode_attention(q, kv)))
    setv("new")
    med = {k: statistics.median(x) * 1e3 for k, x in times.items()}
    rows.append(dict(case=case, plans=plans, err_vs_new=err, us=med, all_ms=times))
    print(case, plans, "err", {k: f"{e:.1e}" for k, e in err.items()}, " ".join(f"{k} {x:.2f}" for k, x in med.items()), flush=True)
    kv = None
    torch.cuda.empty_cache()
fast.choose, fast.SHORT_FOLD_TOKENS = NEW, SHORT
json.dump(dict(device=torch.cuda.get_device_name(), when=time.strftime("%Y-%m-%d %H:%M"), argv=sys.argv,
               rows=rows), open(out, "w"), indent=1)
