"""Variants of the fused decode kernel on one layer (B, 32 q heads, 8 KV heads, d=128, k4v4): wall (do_bench)
and kernel-only (profiler) time, registers and spills. Usage: python benchmarks/diag_decode_kernel.py"""
import json, os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch
from triton.testing import do_bench
from tq_hf_cache.kernels import decode_attention as da

sys.argv = [sys.argv[0], "--skip_model"]
DEV = torch.device("cuda")


def state(b, L):
    from tq_hf_cache.codebook import theoretical_codebook
    from tq_hf_cache.rotation import make_rotation
    rot = make_rotation(128, 0).to(DEV)
    cb = theoretical_codebook(4, 128).to(DEV)
    kp = torch.randint(0, 256, (b, 8, L, 64), dtype=torch.uint8, device=DEV)
    vp = torch.randint(0, 256, (b, 8, L, 64), dtype=torch.uint8, device=DEV)
    kn = (torch.rand(b, 8, L, device=DEV) + 1).half()
    vn = (torch.rand(b, 8, L, device=DEV) + 1).half()
    r = [torch.randn(b, 8, n, 128, device=DEV, dtype=torch.bfloat16) for n in (128, 128, 1, 1)]
    return dict(k_packed=kp, k_norms=kn, v_packed=vp, v_norms=vn, res_k=r[0], res_v=r[1], new_k=r[2], new_v=r[3],
                rotation=rot, k_codebook=cb, v_codebook=cb)


def kernel_ms(fn, reps=20):
    from torch.profiler import ProfilerActivity, profile
    fn(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    tot = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA":
            tot[e.key[:30]] = round(e.self_device_time_total / reps / 1000, 4)
    return tot


rows = []
for b, L in [(1, 32768), (8, 32768), (1, 131072)]:
    st = state(b, L)
    q = torch.randn(b, 32, 1, 128, device=DEV, dtype=torch.bfloat16)
    ref = da.decode_attention(q, st, None, None, lut=0)
    variants = [dict(lut=0), dict(lut=1), dict(lut=2), dict(lut=0, _diag=1), dict(lut=2, num_warps=8),
                dict(lut=2, block_n=32), dict(lut=2, block_n=128), dict(lut=1, num_warps=8), dict(lut=2, num_splits=64)]
    for v in variants:
        try:
            out = da.decode_attention(q, st, None, None, **v)
            c = da.LAST_COMPILED
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            wall = do_bench(lambda: da.decode_attention(q, st, None, None, **v), return_mode="median")
            row = {"b": b, "L": L, **{k: v[k] for k in v}, "wall_ms": round(wall, 4), "kernels_ms": kernel_ms(lambda: da.decode_attention(q, st, None, None, **v)),
                   "regs": getattr(c, "n_regs", None), "spills": getattr(c, "n_spills", None), "err_vs_lut0": round(err, 5)}
        except Exception as e:
            row = {"b": b, "L": L, **v, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(json.dumps(row), flush=True)
        rows.append(row)
    import time
    t = time.perf_counter()
    for _ in range(200):
        da.decode_attention(q, st, None, None)
    torch.cuda.synchronize()
    print("host+launch per call (200 back-to-back) us", round((time.perf_counter() - t) / 200 * 1e6, 1), flush=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "diag_decode_kernel.json"), "w"), indent=1)
