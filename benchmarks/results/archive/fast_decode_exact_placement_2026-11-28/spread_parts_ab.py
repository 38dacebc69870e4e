"""Diagnostic A/B (timing only; outputs of the hacked variants are wrong): fold, spread, spread without the warps'
exact work, spread with the merge reading one exact part. argv: out cases reps"""
import json, os, statistics, sys, time
sys.path.insert(0, os.getcwd()); sys.path.insert(0, "benchmarks")
import torch
from triton.testing import do_bench_cudagraph
import bench_attention as ba
from tq_hf_cache.kernels import decode_attention as da
from tq_hf_cache.kernels import fast

SRC = fast.source()
RUN = "  if (warp >= WARPS - p.spread) spread_run(p, bh, split, warp, xregion);"
assert SRC.count(RUN) == 1
VARS = {"fold": ("0", SRC, None, ""), "spread": ("1", SRC, None, ""), "spread_st2": ("1", SRC, None, "2"),
        "norun_st2": ("1", SRC.replace(RUN, ""), None, "2"), "merge1_st2": ("1", SRC, 1, "2")}
real = fast.jit.kernel
cur = {}
def kern(src, name, df, *a):
    df = dict(df)
    if cur.get("nx") and "XSPREAD" in df:
        df["NXMAX"] = cur["nx"]
    return real(src, name, df, *a)
fast.jit.kernel = kern
def setv(v):
    env, src, nx, st = VARS[v]
    os.environ[fast.SPREAD_ENV] = env
    os.environ["TQ_DIAG_STAGES"] = st
    fast.source = lambda: src
    cur["nx"] = nx
out, CASES, REPS = sys.argv[1], sys.argv[2].split(";"), int(sys.argv[3])
rows = []
for case in CASES:
    shape, preset, bt = case.split("/")
    ba.HQ, ba.HKV, ba.D = ba.SHAPES[shape]
    b, t = map(int, bt.split("x"))
    kb, vb, _ = ba.parse_preset(preset)
    kv, _ = ba.packed_layer(b, t, kb, vb)
    q = torch.randn(b, ba.HQ, 1, ba.D, device="cuda", dtype=torch.bfloat16)
    for v in VARS:
        setv(v); da.decode_attention(q, kv)
    sdpa = ba.cudnn_sdpa(b, t)
    times = {"sdpa": [], **{v: [] for v in VARS}}
    for _ in range(REPS):
        times["sdpa"].append(do_bench_cudagraph(sdpa))
        for v in VARS:
            setv(v)
            times[v].append(do_bench_cudagraph(lambda: da.decode_attention(q, kv)))
    med = {k: statistics.median(x) * 1e3 for k, x in times.items()}
    rows.append(dict(case=case, us=med, all_ms=times))
    print(case, " ".join(f"{k} {x:.2f}" for k, x in med.items()), flush=True)
json.dump(dict(device=torch.cuda.get_device_name(), when=time.strftime("%Y-%m-%d %H:%M"), argv=sys.argv,
               rows=rows), open(out, "w"), indent=1)
