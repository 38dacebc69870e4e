"""Ring depths and table copies (STAGES, KR, VR put into the defines of the 16-warp head-dim-64 build) against the
layout `fast.layout` picks ("base"), cuDNN SDPA on bf16 K/V in the same run, repetitions interleaved, outputs compared
bit for bit. Run from the repository root:
    python benchmarks/results/archive/fast_decode_h100_2026-12-06/layout_sweep.py OUT \
        "smollm2-1.7b/k5v3/1x4096;..." REPS "s4=4:32:32,kr16=3:16:32,..."
"""
import json, os, statistics, sys, time
sys.path.insert(0, os.getcwd()); sys.path.insert(0, "benchmarks")
import torch
from triton.testing import do_bench_cudagraph
import bench_attention as ba
from tq_hf_cache.kernels import decode_attention as da
from tq_hf_cache.kernels import fast

out, CASES, REPS = sys.argv[1], sys.argv[2].split(";"), int(sys.argv[3])
VAR = {"base": None}
for v in sys.argv[4].split(","):
    n, _, s = v.partition("=")
    VAR[n] = tuple(map(int, s.split(":")))
orig = fast.defines
cur = {"ovr": None}
seen = {}
def defines(*a, **k):
    df = orig(*a, **k)
    o = cur["ovr"]
    if o is not None and df["D"] == 64 and df["WARPS"] == 16:
        df = dict(df, STAGES=o[0], KR=o[1], VR=o[2])
    seen[(cur["name"], df["KB"])] = (df["WARPS"], df["STAGES"], df["KR"], df["VR"], fast.packed_smem(df))
    return df
fast.defines = defines
def setv(n):
    cur["name"], cur["ovr"] = n, VAR[n]
rows = []
for case in CASES:
    shape, preset, bt = case.split("/")
    ba.HQ, ba.HKV, ba.D = ba.SHAPES[shape]
    b, t = map(int, bt.split("x"))
    kb, vb, _ = ba.parse_preset(preset)
    kv, nbytes = ba.packed_layer(b, t, kb, vb)
    q = torch.randn(b, ba.HQ, 1, ba.D, device="cuda", dtype=torch.bfloat16)
    outs = {}
    for v in VAR:
        setv(v)
        outs[v] = da.decode_attention(q, kv).float()
        assert not fast._BROKEN, fast._BROKEN
    ref = outs["base"]
    same = {v: bool(torch.equal(o, ref)) for v, o in outs.items()}
    sdpa = ba.cudnn_sdpa(b, t)
    times = {"sdpa": [], **{v: [] for v in VAR}}
    for _ in range(REPS):
        times["sdpa"].append(do_bench_cudagraph(sdpa))
        for v in VAR:
            setv(v)
            times[v].append(do_bench_cudagraph(lambda: da.decode_attention(q, kv)))
    med = {k: statistics.median(x) * 1e3 for k, x in times.items()}
    rows.append(dict(case=case, bytes=nbytes, equal=same, us=med, all_ms=times))
    print(case, "equal", all(same.values()), " ".join(f"{k} {x:.2f}" for k, x in med.items()),
          "| vs base " + " ".join(f"{v} {med['base'] / med[v]:.3f}" for v in VAR if v != "base"), flush=True)
    kv = None
    torch.cuda.empty_cache()
print({f"{k[0]}/k{k[1]}": v for k, v in seen.items()})
json.dump(dict(device=torch.cuda.get_device_name(), when=time.strftime("%Y-%m-%d %H:%M"), argv=sys.argv,
               rows=rows, layouts={f"{k[0]}/k{k[1]}": v for k, v in seen.items()}), open(out, "w"), indent=1)
