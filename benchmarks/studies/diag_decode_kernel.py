"""Runs against an older package: DIAG and LAST_COMPILED exist up to commit 4833ec6, _old_decode_attention before
that, decode_attention_layer / attention_state / arm_deferred up to commit 51e657d; kept for its method. Variants of the fused decode kernel on one layer (B, 32 q heads, 8 KV heads, d=128, k4v4): wall (do_bench),
kernel-only (profiler) time, registers and spills; then the host cost per call of the launchers (state-dict
launcher vs the per-layer cached launch, and the previous two-kernel launcher if
tq_hf_cache/kernels/_old_decode_attention.py is there). Usage: python benchmarks/studies/diag_decode_kernel.py [--quick | --host]"""
import json, os, sys, time
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import torch
from triton.testing import do_bench
from tq_hf_cache.kernels import decode_attention as da

try:
    from tq_hf_cache.kernels import _old_decode_attention as old
except ImportError:
    old = None
DEV = torch.device("cuda")
QUICK = "--quick" in sys.argv
HOST_ONLY = "--host" in sys.argv  # only the host-cost part


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


def host_us(fn, n=300):
    fn(); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return round(host, 1)


rows = []
shapes = [(1, 131072), (8, 32768), (1, 32768)]
variants = [dict(), dict(prefetch=1), dict(prefetch=2), dict(num_warps=8), dict(prefetch=1, num_warps=8),
            dict(num_stages=1), dict(prefetch=2, num_warps=8), dict(block_n=128, prefetch=1), dict(_diag=1)]
if QUICK:
    variants = variants[:3]
for b, L in ([] if HOST_ONLY else shapes):
    st = state(b, L)
    q = torch.randn(b, 32, 1, 128, device=DEV, dtype=torch.bfloat16)
    ref = old.decode_attention(q, st, None, None) if old else da.decode_attention(q, st, None, None)
    todo = [("new", v) for v in variants] + ([("old", dict())] if old else [])
    for which, v in todo:
        mod = da if which == "new" else old
        try:
            out = mod.decode_attention(q, st, None, None, **v)
            c = mod.LAST_COMPILED
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            f = lambda: mod.decode_attention(q, st, None, None, **v)  # noqa: E731
            wall = do_bench(f, return_mode="median")
            row = {"kernel": which, "b": b, "L": L, **v, "wall_ms": round(wall, 4), "kernels_ms": kernel_ms(f),
                   "regs": getattr(c, "n_regs", None), "spills": getattr(c, "n_spills", None),
                   "err_vs_old": round(err, 5)}
        except Exception as e:
            row = {"kernel": which, "b": b, "L": L, **v, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(json.dumps(row), flush=True)
        rows.append(row)

# host cost per call: a real layer (Llama-3.1-8B attention shape), batch 1, 32k packed tokens
from transformers import LlamaConfig  # noqa: E402
from tq_hf_cache import TurboQuantCache  # noqa: E402

cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=1)
cache = TurboQuantCache("k4v4", config=cfg, residual_length=128)
k = torch.randn(1, 8, 128, 128, device=DEV, dtype=torch.bfloat16)
cache.update(k, torch.randn_like(k), 0)
layer = cache.layers[0]
for buf in (layer.k_buf, layer.v_buf):
    pk, nk = buf.append_slots(32768)
    pk.random_(0, 256)
    nk.uniform_(1, 2)
layer.arm_deferred()
k1 = torch.randn(1, 1, 8, 128, device=DEV, dtype=torch.bfloat16).transpose(1, 2)
cache.update(k1, torch.randn_like(k1), 0)
q = torch.randn(1, 1, 32, 128, device=DEV, dtype=torch.bfloat16).transpose(1, 2)
st = layer.attention_state()
o1 = da.decode_attention_layer(q, layer, None)
o1 = da.decode_attention_layer(q, layer, None)
o2 = da.decode_attention(q, st, None, None)
host = {"direct_launch_ok": da._DIRECT.get("ok"), "direct_error": da._DIRECT.get("error"),
        "layer_vs_state_maxdiff": (o1.float() - o2.float()).abs().max().item(),
        "layer_launch_us": host_us(lambda: da.decode_attention_layer(q, layer, None)),
        "state_launch_us": host_us(lambda: da.decode_attention(q, layer.attention_state(), None, None)),
        "attention_state_us": host_us(lambda: layer.attention_state())}
if old:
    host["old_two_kernel_launch_us"] = host_us(lambda: old.decode_attention(q, layer.attention_state(), None, None))
from tq_hf_cache import attention  # noqa: E402


class M(torch.nn.Module):
    pass


mod = M()
kt = k1
kt._tq_layer, kt._tq_deferred = layer, True


def full_call():  # the attention function as transformers calls it, minus the flush/arm (kept deferred)
    layer._defer_next = False
    return attention._fused(q, layer, None, None)


host["attention_fused_us"] = host_us(full_call)
empty = torch.empty(1, device=DEV)
host["torch_empty_us"] = host_us(lambda: torch.empty(1, 1, 32, 128, device=DEV, dtype=torch.bfloat16))
print(json.dumps(host), flush=True)
rows.append({"host": host})
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "diag_decode_kernel.json"), "w"), indent=1)
