"""A/B of kernel source variants x fold tokens on this tree, interleaved, with cuDNN SDPA.
variants: base; pfirst (folded CTA: packed part first, exact part after); fconst (span uses literal 2048).
argv: out cases reps variants(name@fold,...)"""
import json, os, statistics, sys, time
sys.path.insert(0, os.getcwd()); sys.path.insert(0, "benchmarks")
import torch
from triton.testing import do_bench_cudagraph
import bench_attention as ba
from tq_hf_cache.kernels import decode_attention as da
from tq_hf_cache.kernels import fast

BASE = fast.source()
A = ("    exact_part(p, smem, bh, 0, 1);                    // of the exact part's registers)\n"
     "    __syncthreads();  // the exact partial is out of shared memory\n"
     "    packed_part(p, smem, split, bh);\n")
assert BASE.count(A) == 1
PF = BASE.replace(A, "    packed_part(p, smem, split, bh);\n    __syncthreads();\n    exact_part(p, smem, bh, 0, 1);\n")
S = "  const i64 span = lq + (p.num_splits > 1 ? p.fold : 0);\n"
assert BASE.count(S) == 1
FC = BASE.replace(S, "  const i64 span = lq + (p.num_splits > 1 ? 2048 : 0);\n")
SRC = {"base": BASE, "pfirst": PF, "fconst": FC}
SHORT = fast.SHORT_FOLD_TOKENS

def setv(v):
    name, _, f = v.partition("@")
    fast.source = lambda: SRC[name]
    fast.SHORT_FOLD_TOKENS = int(f) if f else SHORT

out, CASES = sys.argv[1], sys.argv[2].split(";")
REPS = int(sys.argv[3])
VARS = sys.argv[4].split(",")
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
    sdpa = ba.cudnn_sdpa(b, t)
    times = {"sdpa": [], **{v: [] for v in VARS}}
    for _ in range(REPS):
        times["sdpa"].append(do_bench_cudagraph(sdpa))
        for v in VARS:
            setv(v)
            times[v].append(do_bench_cudagraph(lambda: da.decode_attention(q, kv)))
    setv("base")
    med = {k: statistics.median(x) * 1e3 for k, x in times.items()}
    rows.append(dict(case=case, err=err, us=med, all_ms=times))
    print(case, "maxerr %.1e" % max(err.values()), " ".join(f"{k} {x:.2f}" for k, x in med.items()), flush=True)
    kv = None
    torch.cuda.empty_cache()
json.dump(dict(device=torch.cuda.get_device_name(), when=time.strftime("%Y-%m-%d %H:%M"), argv=sys.argv,
               rows=rows), open(out, "w"), indent=1)
