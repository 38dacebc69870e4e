"""Decode-step benchmark: DynamicCache+SDPA vs TurboQuantCache (workspace path: dequantize + SDPA; fused path:
attn_implementation="turboquant") vs transformers' QuantizedCache (quanto int4), on a Llama-3.1-8B-shaped model
with random bf16 weights (32 layers, 32 query heads, 8 KV heads, head dim 128), as benchmarks/anchors/ does.

Caches are filled directly through the cache/layer API, not by a prefill through the model:
- DynamicCache / QuantizedCache: one `cache.update` per layer with random bf16 K/V of the full context;
- TurboQuantCache: a real update of `residual_length` random tokens per layer (the residual window), then the
  packed history as random codes and norms written into `PackedBuffer.append_slots` (the bytes moved and the
  work per token do not depend on the values).
Then each method runs `--warmup` + `--steps` decode steps of one token through the model, timed with CUDA
events (median). Peak memory is max_memory_allocated during the decode steps, over the weights.
Per-layer attention alone: SDPA (GQA) on bf16 K/V vs the fused kernel on a packed layer state vs the workspace
path (dequantize K and V into a workspace + SDPA), median of triton.testing.do_bench.
Longest context: by formula, from the peaks measured at the two largest contexts (linear fit, bytes per token
and fixed part) and the device's total memory.

Usage: python benchmarks/studies/decode_filled_cache.py [--contexts 4096,32768,131072] [--batches 1,8] [--out DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import tq_hf_cache  # noqa: E402
from tq_hf_cache import TurboQuantCache, attention, cache_kwargs  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--contexts", default="4096,32768,131072")
p.add_argument("--batches", default="1,8")
p.add_argument("--methods", default="dynamic,tq_workspace,tq_fused,quanto4")
p.add_argument("--quanto_batches", default="1")
p.add_argument("--layers", type=int, default=32)
p.add_argument("--steps", type=int, default=30)
p.add_argument("--warmup", type=int, default=3)
p.add_argument("--preset", default=tq_hf_cache.DEFAULT_PRESET)
p.add_argument("--residual", type=int, default=128)
p.add_argument("--budget_s", type=float, default=520)
p.add_argument("--skip_model", action="store_true")
p.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
a = p.parse_args()
T0 = time.time()
DEV = torch.device("cuda")
HQ, HKV, D = 32, 8, 128
GiB = 2**30
torch.manual_seed(0)


def log(*x):
    print(*x, flush=True)


def quanto_installed() -> bool:
    try:
        import optimum.quanto  # noqa: F401

        return True
    except Exception:
        return False


import transformers  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from tq_hf_cache import kernels, ops  # noqa: E402
from tq_hf_cache.kernels.decode_attention import decode_attention  # noqa: E402

env = {
    "device": torch.cuda.get_device_name(),
    "total_memory_GiB": round(torch.cuda.get_device_properties(DEV).total_memory / GiB, 2),
    "torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
    "quant_kernels_available": kernels.available(), "quanto": "installed" if quanto_installed() else "not installed",
    "preset": a.preset, "residual_length": a.residual,
}
log(json.dumps(env))
results = {"env": env, "layer_attention": [], "decode": [], "max_context": []}
contexts = [int(x) for x in a.contexts.split(",")]
batches = [int(x) for x in a.batches.split(",")]
kbits, vbits = tq_hf_cache.PRESETS[a.preset]


def random_state(b, length, r, dtype=torch.bfloat16):
    """A fused-kernel layer state: `length` packed tokens, r residual tokens, 1 new token."""
    from tq_hf_cache.codebook import theoretical_codebook
    from tq_hf_cache.packing import packed_bytes
    from tq_hf_cache.rotation import make_rotation

    rot = make_rotation(D, 0).to(DEV)
    kcb, vcb = theoretical_codebook(kbits, D).to(DEV), theoretical_codebook(vbits, D).to(DEV)
    kp = torch.randint(0, 256, (b, HKV, length, packed_bytes(D, kbits)), dtype=torch.uint8, device=DEV)
    vp = torch.randint(0, 256, (b, HKV, length, packed_bytes(D, vbits)), dtype=torch.uint8, device=DEV)
    kn = (torch.rand(b, HKV, length, device=DEV) * 10 + 1).half()
    vn = (torch.rand(b, HKV, length, device=DEV) * 10 + 1).half()
    rk, rv = (torch.randn(b, HKV, r, D, device=DEV, dtype=dtype) for _ in range(2))
    nk, nv = (torch.randn(b, HKV, 1, D, device=DEV, dtype=dtype) for _ in range(2))
    return dict(k_packed=kp, k_norms=kn, v_packed=vp, v_norms=vn, res_k=rk, res_v=rv, new_k=nk, new_v=nv,
                rotation=rot, k_codebook=kcb, v_codebook=vcb)


def bench_layer():
    """One layer's decode attention: SDPA on bf16 K/V vs fused on packed vs dequantize-into-workspace + SDPA."""
    F = torch.nn.functional
    for b in batches:
        for L in contexts:
            row = {"batch": b, "context": L}
            q = torch.randn(b, HQ, 1, D, device=DEV, dtype=torch.bfloat16)
            kv_bf16 = b * HKV * L * D * 2 * 2
            try:
                k = torch.randn(b, HKV, L, D, device=DEV, dtype=torch.bfloat16)
                v = torch.randn_like(k)
                row["sdpa_ms"] = do_bench(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), return_mode="median")
                row["sdpa_TBps"] = round(kv_bf16 / row["sdpa_ms"] / 1e9, 2)
                del k, v
            except torch.OutOfMemoryError:
                row["sdpa_ms"] = "OOM"
            torch.cuda.empty_cache()
            st = random_state(b, L - a.residual - 1, a.residual)
            packed_bytes_ = sum(st[x].numel() * st[x].element_size() for x in ("k_packed", "k_norms", "v_packed", "v_norms"))
            out = torch.empty(b, 1, HQ, D, device=DEV, dtype=torch.bfloat16)
            row["fused_ms"] = do_bench(lambda: decode_attention(q, st, None, None, out=out), return_mode="median")
            row["fused_TBps"] = round(packed_bytes_ / row["fused_ms"] / 1e9, 2)
            # what the kernel reads is the floor's numerator; at the copy bandwidth measured below it gives the floor
            row["packed_bytes"] = packed_bytes_
            lq = st["k_packed"].shape[2]
            wk = torch.empty(b, HKV, L, D, device=DEV, dtype=torch.bfloat16)
            wv = torch.empty_like(wk)

            def workspace():
                ops.dequantize_into(st["k_packed"], st["k_norms"], st["rotation"], st["k_codebook"], wk[:, :, :lq])
                ops.dequantize_into(st["v_packed"], st["v_norms"], st["rotation"], st["v_codebook"], wv[:, :, :lq])
                return F.scaled_dot_product_attention(q, wk, wv, enable_gqa=True)

            row["workspace_ms"] = do_bench(workspace, return_mode="median")
            for key in ("sdpa_ms", "fused_ms", "workspace_ms"):
                if isinstance(row.get(key), float):
                    row[key] = round(row[key], 4)
            if isinstance(row["sdpa_ms"], float):
                row["fused_over_sdpa"] = round(row["fused_ms"] / row["sdpa_ms"], 3)
            log(json.dumps(row))
            results["layer_attention"].append(row)
            del st, wk, wv
            torch.cuda.empty_cache()


def copy_bandwidth():
    x = torch.empty(2 * GiB // 2, dtype=torch.bfloat16, device=DEV)
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), return_mode="median")
    moved = 2 * x.numel() * x.element_size()  # read + write
    del x, y
    torch.cuda.empty_cache()
    return round(moved / ms / 1e9, 2)


results["copy_TBps"] = copy_bandwidth()
log("copy bandwidth TB/s", results["copy_TBps"])
bench_layer()
if a.skip_model:
    json.dump(results, open(os.path.join(a.out, "bench_decode.json"), "w"), indent=1)
    sys.exit(0)

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=a.layers,
                  num_attention_heads=HQ, num_key_value_heads=HKV, max_position_embeddings=131072 + 1024,
                  rope_theta=500000.0)
cfg._attn_implementation = "sdpa"
torch.set_default_dtype(torch.bfloat16)
with torch.device("cuda"):
    model = LlamaForCausalLM(cfg)
model.eval()
torch.set_default_dtype(torch.float32)
WEIGHTS = torch.cuda.memory_allocated()
results["weights_GiB"] = round(WEIGHTS / GiB, 2)
log("model ready", round(time.time() - T0, 1), "s; weights GiB", results["weights_GiB"])
TOTAL = torch.cuda.get_device_properties(DEV).total_memory


def fill_dense(cache, b, L):
    for i in range(a.layers):
        k = torch.randn(b, HKV, L, D, device=DEV, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        cache.update(k, v, i)
        del k, v


def fill_tq(cache, b, L):
    r = min(a.residual, L)
    for i, layer in enumerate(cache.layers):
        k = torch.randn(b, HKV, r, D, device=DEV, dtype=torch.bfloat16)
        cache.update(k, torch.randn_like(k), i)
        n = L - r
        for buf in (layer.k_buf, layer.v_buf):
            pk, nk = buf.append_slots(n)
            pk.random_(0, 256)
            nk.uniform_(1, 11)
        layer.cumulative_length += n


def cache_bytes(cache, kind):
    if kind.startswith("tq"):
        nb = cache.nbytes()
        return nb["packed"] + nb["residual"], nb
    seen, total = set(), 0

    def walk(o, depth=0):
        nonlocal total
        if isinstance(o, torch.Tensor):
            if o.is_cuda and o.data_ptr() not in seen:
                seen.add(o.data_ptr())
                total += o.numel() * o.element_size()
            return
        if depth > 4:
            return
        if isinstance(o, (list, tuple)):
            for x in o:
                walk(x, depth + 1)
        elif hasattr(o, "__dict__"):
            for x in vars(o).values():
                walk(x, depth + 1)

    walk(cache)
    return total, None


def decode_steps(cache, b):
    tok = torch.randint(0, cfg.vocab_size, (b, 1), device=DEV)
    times = []
    with torch.no_grad():
        for i in range(a.warmup + a.steps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            model(tok, **cache_kwargs(model, cache), use_cache=True)
            e1.record()
            torch.cuda.synchronize()
            if i >= a.warmup:
                times.append(e0.elapsed_time(e1))
    times.sort()
    return round(times[len(times) // 2], 3), round(times[0], 3)


def run_method(kind, b, L, cache=None):
    row = {"method": kind, "batch": b, "context": L}
    need = {"dynamic": b * L * a.layers * HKV * D * 2 * 2, "quanto4": b * L * a.layers * HKV * D * 2 * 2 // 3}.get(kind, 0)
    if WEIGHTS + need > 0.97 * TOTAL:
        row["skipped"] = f"does not fit: KV alone needs {need / GiB:.1f} GiB next to {WEIGHTS / GiB:.1f} GiB of weights"
        return row, None
    try:
        gc.collect()  # a TurboQuantCache is a reference cycle (layers -> codebook lambdas -> cache): free the last one
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        if cache is None:
            if kind == "dynamic":
                cache = DynamicCache()
                fill_dense(cache, b, L)
            elif kind == "quanto4":
                from transformers import QuantizedCache

                cache = QuantizedCache(backend="quanto", config=model.config, nbits=4, residual_length=128)
                fill_dense(cache, b, L)
            else:
                cache = TurboQuantCache(a.preset, config=model.config, residual_length=a.residual)
                fill_tq(cache, b, L)
        if kind == "tq_fused":
            cache.workspace.clear()  # the fused path needs no workspace: do not count the one the other path left
            model.set_attn_implementation(attention.NAME)
        else:
            model.set_attn_implementation("sdpa")
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
        row["allocated_over_weights_GiB"] = round((torch.cuda.memory_allocated() - WEIGHTS) / GiB, 3)
        torch.cuda.reset_peak_memory_stats()
        row["decode_ms_median"], row["decode_ms_min"] = decode_steps(cache, b)
        row["peak_over_weights_GiB"] = round((torch.cuda.max_memory_allocated() - WEIGHTS) / GiB, 3)
        kv, detail = cache_bytes(cache, kind)
        row["kv_bytes"] = kv
        row["kv_bytes_per_token_per_layer"] = round(kv / b / (L + a.warmup + a.steps) / a.layers, 1)
        if detail:
            row["tq_nbytes"] = detail
            live = sum(layer.k_buf.nbytes_per_vec + layer.v_buf.nbytes_per_vec for layer in cache.layers[:1])
            row["packed_live_bytes_per_token_per_layer"] = live + 2 * cache.layers[0].k_buf.norms.element_size()
    except torch.OutOfMemoryError as e:
        row["error"] = "OOM: " + str(e)[:160]
        cache = None
    model.set_attn_implementation("sdpa")
    return row, cache


if kernels.available():
    log("quantize/dequantize kernels: available")
methods = a.methods.split(",")
for L in contexts:
    for b in batches:
        shared_tq = None
        for kind in methods:
            if time.time() - T0 > a.budget_s:
                results["decode"].append({"method": kind, "batch": b, "context": L, "skipped": "time budget"})
                continue
            if kind == "quanto4" and (str(b) not in a.quanto_batches.split(",") or env["quanto"] != "installed"):
                results["decode"].append({"method": kind, "batch": b, "context": L,
                                          "skipped": "quanto not installed" if env["quanto"] != "installed" else "batch not requested"})
                continue
            t = time.time()
            row, cache = run_method(kind, b, L, shared_tq if kind.startswith("tq") else None)
            row["wall_s"] = round(time.time() - t, 1)
            if kind.startswith("tq"):
                shared_tq = cache  # the workspace and fused paths time the same filled cache
            del cache
            torch.cuda.empty_cache()
            log(json.dumps(row))
            results["decode"].append(row)
        shared_tq = None
        torch.cuda.empty_cache()

# ratios against DynamicCache in this run
by = {(r["method"], r["batch"], r["context"]): r for r in results["decode"] if "decode_ms_median" in r}
for (m, b, L), r in by.items():
    dyn = by.get(("dynamic", b, L))
    if dyn and m != "dynamic":
        r["step_over_dynamic"] = round(r["decode_ms_median"] / dyn["decode_ms_median"], 3)
        if r.get("kv_bytes"):
            r["kv_bytes_over_dynamic"] = round(r["kv_bytes"] / dyn["kv_bytes"], 4)
# longest context by formula: peak(L) = fixed + per_token * L, fitted on the two largest measured contexts
free = TOTAL - WEIGHTS
for m in methods:
    for b in batches:
        pts = sorted((r["context"], r["peak_over_weights_GiB"] * GiB) for (mm, bb, _), r in by.items() if mm == m and bb == b)
        if len(pts) < 2:
            continue
        (l1, p1), (l2, p2) = pts[-2], pts[-1]
        per_tok = (p2 - p1) / (l2 - l1)
        fixed = p2 - per_tok * l2
        results["max_context"].append({"method": m, "batch": b, "bytes_per_token": round(per_tok, 1),
                                       "fixed_GiB": round(fixed / GiB, 3), "max_context": int((free - fixed) / per_tok),
                                       "fit_on": [l1, l2]})
mc = {(r["method"], r["batch"]): r["max_context"] for r in results["max_context"]}
for r in results["max_context"]:
    if ("dynamic", r["batch"]) in mc:
        r["over_dynamic"] = round(r["max_context"] / mc[("dynamic", r["batch"])], 2)
results["total_s"] = round(time.time() - T0, 1)
json.dump(results, open(os.path.join(a.out, "bench_decode.json"), "w"), indent=1)

# summary table and plot
log("\nmethod        batch context  step_ms  x_dynamic  peak_GiB  KV_B/tok/layer")
for r in results["decode"]:
    if "decode_ms_median" in r:
        log(f"{r['method']:13s} {r['batch']:5d} {r['context']:7d} {r['decode_ms_median']:8.2f} {r.get('step_over_dynamic', 1.0):9.3f}"
            f" {r['peak_over_weights_GiB']:9.2f} {r['kv_bytes_per_token_per_layer']:10.1f}")
    else:
        log(f"{r['method']:13s} {r['batch']:5d} {r['context']:7d}  {r.get('skipped') or r.get('error')}")
for r in results["max_context"]:
    log(json.dumps(r))
try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(batches) + 1, figsize=(6 * (len(batches) + 1), 4.5))
    for ax, b in zip(axes, batches):
        for m in methods:
            pts = sorted((L, r["decode_ms_median"]) for (mm, bb, L), r in by.items() if mm == m and bb == b)
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], "o-", label=m)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("decode step (ms)")
        ax.set_title(f"Llama-3.1-8B shape, batch {b}, {env['device']}")
        ax.legend()
    ax = axes[-1]
    for b in batches:
        rows = [r for r in results["layer_attention"] if r["batch"] == b and isinstance(r.get("sdpa_ms"), float)]
        ax.plot([r["context"] for r in rows], [r["sdpa_ms"] for r in rows], "o--", label=f"SDPA bf16, batch {b}")
        rows = [r for r in results["layer_attention"] if r["batch"] == b]
        ax.plot([r["context"] for r in rows], [r["fused_ms"] for r in rows], "o-", label=f"fused {a.preset}, batch {b}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("one layer's decode attention (ms)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(a.out, "bench_decode.png"), dpi=110)
    log("plot written")
except Exception as e:  # no matplotlib there: the JSON holds everything
    log("no plot:", type(e).__name__, e)
log("done", results["total_s"], "s")
