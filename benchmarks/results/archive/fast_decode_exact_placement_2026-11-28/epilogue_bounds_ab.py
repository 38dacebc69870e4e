"""Timing-only bounds (hacked outputs are wrong): base; norot (the merge's butterflies skipped); nostore (a split's
partial from warp 0 only, no combine over warps); both. argv: out cases reps"""
import json, os, statistics, sys, time
sys.path.insert(0, os.getcwd()); sys.path.insert(0, "benchmarks")
import torch
from triton.testing import do_bench_cudagraph
import bench_attention as ba
from tq_hf_cache.kernels import decode_attention as da
from tq_hf_cache.kernels import fast

SRC = fast.source()
ROT = "  for (int r = warp; r < live; r += WARPS) {  // red[r] = ys[r] Pi = H ys[r] * s / sqrt(D), a warp a row"
assert SRC.count(ROT) == 1
NOROT = SRC.replace(ROT, "  for (int r = warp; r < 0; r += WARPS) {")
W1 = "      for (int w = 0; w < WARPS; ++w) {\n        const float f = ex2(wm[w * RQ + r] - Mu);"
assert SRC.count(W1) == 1
def nostore(s):
    return s.replace(W1, "      for (int w = 0; w < 1; ++w) {\n        const float f = ex2(wm[w * RQ + r] - Mu);").replace(
        "      for (int w = 0; w < WARPS; ++w) M = fmaxf(M, wm[w * RQ + r]);", "      M = wm[r];")
VARS = {"base": SRC, "norot": NOROT, "nostore": nostore(SRC), "both": nostore(NOROT)}
assert len(set(VARS.values())) == 4
out, CASES, REPS = sys.argv[1], sys.argv[2].split(";"), int(sys.argv[3])
rows = []
for case in CASES:
    shape, preset, bt = case.split("/")
    ba.HQ, ba.HKV, ba.D = ba.SHAPES[shape]
    b, t = map(int, bt.split("x"))
    kb, vb, _ = ba.parse_preset(preset)
    kv, _ = ba.packed_layer(b, t, kb, vb)
    q = torch.randn(b, ba.HQ, 1, ba.D, device="cuda", dtype=torch.bfloat16)
    for v, s in VARS.items():
        fast.source = lambda s=s: s
        da.decode_attention(q, kv)
    sdpa = ba.cudnn_sdpa(b, t)
    times = {"sdpa": [], **{v: [] for v in VARS}}
    for _ in range(REPS):
        times["sdpa"].append(do_bench_cudagraph(sdpa))
        for v, s in VARS.items():
            fast.source = lambda s=s: s
            times[v].append(do_bench_cudagraph(lambda: da.decode_attention(q, kv)))
    med = {k: statistics.median(x) * 1e3 for k, x in times.items()}
    rows.append(dict(case=case, us=med, all_ms=times))
    print(case, " ".join(f"{k} {x:.2f}" for k, x in med.items()), flush=True)
json.dump(dict(device=torch.cuda.get_device_name(), when=time.strftime("%Y-%m-%d %H:%M"), argv=sys.argv,
               rows=rows), open(out, "w"), indent=1)
