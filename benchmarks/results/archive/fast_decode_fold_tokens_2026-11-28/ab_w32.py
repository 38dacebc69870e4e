"""A/B: this tree's kernel and plan ('cur'), the same with the 16-warp plan forced ('c16'), and 32-warp CTAs with
the 16-warp plan's splits ('w32', source .dev/s31/w32.cu; '@N': short fold tokens). argv: out cases reps variants"""
import json, os, statistics, sys, time
sys.path.insert(0, os.getcwd()); sys.path.insert(0, "benchmarks")
import torch
from triton.testing import do_bench_cudagraph
import bench_attention as ba
from tq_hf_cache.kernels import decode_attention as da
from tq_hf_cache.kernels import fast

BASE, W32 = fast.source(), open(".dev/s31/w32.cu").read()
CHOOSE, SHORT = fast.choose, fast.SHORT_FOLD_TOKENS
fast.MIN_TOKENS_PER_SPLIT[32] = 256
seen = []

def c16(bh, L, dev, most, d, nq, w):
    return CHOOSE(bh, L, dev, most, d, nq, 16 if d == 64 else w)

def w32(bh, L, dev, most, d, nq, w):
    r = c16(bh, L, dev, most, d, nq, w)
    return (32, *r[1:]) if r[0] == 16 and d == 64 else r

LAYOUT = fast.layout

def kr16(d, kb, vb, kn, vn, nq, cap, w=8):
    r = LAYOUT(d, kb, vb, kn, vn, nq, cap, w)
    return (r[0], 16, r[2]) if d == 64 and kb == 5 and w == 16 else r

def setv(v):
    name, _, f = v.partition("@")
    fast.SHORT_FOLD_TOKENS = int(f) if f else SHORT
    fast.source = lambda: W32 if name == "w32" else BASE
    fast.layout = kr16 if name == "kr16" else LAYOUT
    f = {"cur": CHOOSE, "c16": c16, "w32": w32, "kr16": CHOOSE}[name]
    fast.choose = lambda *a, **k: seen.append(f(*a, **k)) or seen[-1]

if __name__ == "__main__":
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
        outs, plans = {}, {}
        for v in VARS:
            seen.clear(); setv(v)
            outs[v] = da.decode_attention(q, kv).float()
            plans[v] = seen[-1] if seen else None
        ref = outs[VARS[0]]
        err = {v: ((o - ref).norm() / ref.norm()).item() for v, o in outs.items()}
        fin = {v: bool(o.isfinite().all()) for v, o in outs.items()}
        sdpa = ba.cudnn_sdpa(b, t)
        times = {"sdpa": [], **{v: [] for v in VARS}}
        for _ in range(REPS):
            times["sdpa"].append(do_bench_cudagraph(sdpa))
            for v in VARS:
                setv(v)
                times[v].append(do_bench_cudagraph(lambda: da.decode_attention(q, kv)))
        setv("cur")
        med = {k: statistics.median(x) * 1e3 for k, x in times.items()}
        rows.append(dict(case=case, plans=plans, err=err, finite=fin, us=med, all_ms=times))
        print(case, plans, "maxerr %.1e" % max(err.values()), all(fin.values()),
              " ".join(f"{k} {x:.2f}" for k, x in med.items()), flush=True)
        kv = None
        torch.cuda.empty_cache()
    json.dump(dict(device=torch.cuda.get_device_name(), when=time.strftime("%Y-%m-%d %H:%M"), argv=sys.argv,
                   rows=rows), open(out, "w"), indent=1)
