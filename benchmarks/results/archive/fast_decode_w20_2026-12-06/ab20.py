"""A/B: 20-warp CTAs where choose takes 16 at head dim 64, same source. argv: out cases(;) reps variants(,)
variant: base | w20 | w20f<fold tokens>"""
import json, os, statistics, sys, time
sys.path.insert(0, os.getcwd()); sys.path.insert(0, "benchmarks")
import torch
from triton.testing import do_bench_cudagraph
import bench_attention as ba
from tq_hf_cache import reference
from tq_hf_cache.kernels import decode_attention as da
from tq_hf_cache.kernels import fast

out, CASES, REPS, VARS = sys.argv[1], sys.argv[2].split(";"), int(sys.argv[3]), sys.argv[4].split(",")
_choose, _fold = fast.choose, fast.SHORT_FOLD_TOKENS
seen = {}
def setv(v):
    if v == "base":
        fast.choose, fast.SHORT_FOLD_TOKENS = _choose, _fold
        return
    f = int(v[4:]) if v.startswith("w20f") else None
    fast.SHORT_FOLD_TOKENS = (f, f) if f else _fold
    def ch(bh, n, dev, most, d, nq, w):
        r = _choose(bh, n, dev, most, d, nq, w)
        r2 = (20, *r[1:]) if (r[0] == 16 and d == 64) else r
        seen[(v, bh, n)] = r2
        return r2
    fast.choose = ch
rows = []
for case in CASES:
    shape, preset, bt = case.split("/")
    ba.HQ, ba.HKV, ba.D = ba.SHAPES[shape]
    b, t = map(int, bt.split("x"))
    kb, vb, _ = ba.parse_preset(preset)
    kv, nbytes = ba.packed_layer(b, t, kb, vb)
    q = torch.randn(b, ba.HQ, 1, ba.D, device="cuda", dtype=torch.bfloat16)
    want = reference.packed_attention(q, kv, None, None).float()
    outs = {}
    for v in VARS:
        setv(v)
        outs[v] = da.decode_attention(q, kv).float()
    torch.cuda.synchronize()
    err = {v: ((o - want).norm() / want.norm()).item() for v, o in outs.items()}
    same = {v: bool(torch.equal(o, outs["base"])) for v, o in outs.items()}
    sdpa = ba.cudnn_sdpa(b, t)
    times = {"sdpa": [], **{v: [] for v in VARS}}
    for _ in range(REPS):
        times["sdpa"].append(do_bench_cudagraph(sdpa))
        for v in VARS:
            setv(v)
            times[v].append(do_bench_cudagraph(lambda: da.decode_attention(q, kv)))
    med = {k: statistics.median(x) * 1e3 for k, x in times.items()}
    plans = {v: seen.get((v, b * ba.HKV, t - ba.RESIDUAL)) for v in VARS}
    rows.append(dict(case=case, bytes=nbytes, err_vs_reference=err, equal_base=same, us=med, all_ms=times,
                     plans={k: list(x) if x else None for k, x in plans.items()}))
    print(case, "err", {v: f"{e:.1e}" for v, e in err.items()}, " ".join(f"{k} {x:.2f}" for k, x in med.items()),
          "| vs sdpa " + " ".join(f"{v} {med['sdpa'] / med[v]:.3f}" for v in VARS), plans, flush=True)
    kv = None
    torch.cuda.empty_cache()
setv("base")
def dump(chk):
    json.dump(dict(device=torch.cuda.get_device_name(), when=time.strftime("%Y-%m-%d %H:%M"), argv=sys.argv,
                   source_sha1=__import__("hashlib").sha1(fast.source().encode()).hexdigest(), rows=rows, checks=chk),
              open(out, "w"), indent=1)
dump([])
# dense (orthogonal) and Hadamard rotations, with and without a bool mask, 20 warps against the reference
import dataclasses
from tq_hf_cache.rotation import make_rotation
ba.HQ, ba.HKV, ba.D = ba.SHAPES["smollm2-1.7b"]
chk = []
try:
    for kind in ("orthogonal", "hadamard"):
        kv, _ = ba.packed_layer(1, 4096, 5, 3)
        kv = dataclasses.replace(kv, rotation=make_rotation(ba.D, 0, kind).to("cuda"))
        q = torch.randn(1, ba.HQ, 1, ba.D, device="cuda", dtype=torch.bfloat16)
        mask = torch.rand(1, 1, 1, 4096, device="cuda") > 0.3
        mask[..., -1] = True
        for m in (None, mask):
            want = reference.packed_attention(q, kv, m, None).float()
            for v in ("base", "w20"):
                setv(v)
                o = da.decode_attention(q, kv, m).float()
                chk.append(dict(rotation=kind, mask=m is not None, variant=v,
                                err=((o - want).norm() / want.norm()).item(), finite=bool(torch.isfinite(o).all())))
                print(chk[-1], flush=True)
except Exception as e:
    chk.append(dict(error=repr(e)))
    print("check error", repr(e), flush=True)
setv("base")
dump(chk)
