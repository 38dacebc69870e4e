"""Multi-GPU and torch.compile checks on real GPUs (run through the device tool on a 2-GPU machine).

1. A model split over the GPUs with `device_map="auto"` (accelerate) generates with TurboQuantCache the same
   tokens as the single-GPU run, with one workspace per device and each layer's packed buffers on its device;
   for both the workspace (sdpa) and the fused (turboquant) attention paths.
2. torch.compile of the decode step on one GPU: default mode and "reduce-overhead" (CUDA graphs): does it run,
   does it match eager, how fast.

    python benchmarks/studies/multi_gpu_check.py   # writes $OUT/multi_gpu_check.json (or benchmarks/results/)
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback

import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from tq_hf_cache import TurboQuantCache, cache_kwargs  # noqa: E402

OUT = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "..", "results")
os.makedirs(OUT, exist_ok=True)
START = time.time()
BUDGET_S = float(os.environ.get("TQ_CHECK_BUDGET_S", "420"))
result: dict = {"devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}


def model_files(tmp: str) -> int:
    cfg = LlamaConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=2, head_dim=128, max_position_embeddings=8192, initializer_range=0.05,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(tmp)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def generate(model, cache, ids, n=48):
    with torch.no_grad():
        out = model.generate(
            ids.to(model.device), attention_mask=torch.ones_like(ids).to(model.device), max_new_tokens=n,
            do_sample=False, **cache_kwargs(model, cache), pad_token_id=0,
        )
    return out[:, ids.shape[1]:].cpu()


def multi_gpu(tmp: str, size: int) -> None:
    single = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.bfloat16, device_map={"": 0}).eval()
    multi = AutoModelForCausalLM.from_pretrained(
        tmp, dtype=torch.bfloat16, device_map="auto", max_memory={0: int(size * 0.55), 1: "60GiB"}
    ).eval()
    devices = sorted({str(d) for d in multi.hf_device_map.values()})
    result["device_map"] = {k: str(v) for k, v in multi.hf_device_map.items()}
    ids = torch.randint(3, 32000, (2, 700), generator=torch.Generator().manual_seed(1))
    rows = []
    for attn in ("sdpa", "turboquant"):
        for m in (single, multi):
            m.set_attn_implementation(attn)
        a_cache = TurboQuantCache("k4v4", config=single.config)
        b_cache = TurboQuantCache("k4v4", config=multi.config)
        a, b = generate(single, a_cache, ids), generate(multi, b_cache, ids)
        layer_devices = sorted({str(layer.k_buf.packed.device) for layer in b_cache.layers})
        ws_devices = sorted(str(k[0]) for k in b_cache.workspace._buffers)
        rows.append({
            "attention": attn,
            "tokens_identical": bool(torch.equal(a, b)),
            "agreement": float((a == b).float().mean()),
            "packed_buffer_devices": layer_devices,
            "workspace_devices": ws_devices,
        })
    d_single = generate(single, DynamicCache(), ids)
    d_multi = generate(multi, DynamicCache(), ids)
    result["multi_gpu"] = {
        "model_devices": devices,
        "runs": rows,
        "dynamic_cache_tokens_identical": bool(torch.equal(d_single, d_multi)),
    }
    del single, multi
    torch.cuda.empty_cache()


def decode_steps(model, cache, ids, steps, feed=None):
    """Prefill, then `steps` single-token forwards; returns (logits list, tokens fed, ms per decode step).

    With `feed`, those tokens are fed (teacher forcing), so that two runs compare logits on the same inputs
    even where near-tied argmaxes of a random model would send their greedy continuations apart."""
    with torch.no_grad():
        logits = [model(ids, **cache_kwargs(model, cache)).logits[:, -1].clone()]
        fed = []
        torch.cuda.synchronize()
        t = time.perf_counter()
        for i in range(steps):
            tok = feed[i] if feed is not None else logits[-1].argmax(-1, keepdim=True)
            fed.append(tok)
            logits.append(model(tok, **cache_kwargs(model, cache)).logits[:, -1].clone())
        torch.cuda.synchronize()
    return logits, fed, (time.perf_counter() - t) / steps * 1e3


def compile_check(tmp: str) -> None:
    """Eager vs torch.compile on the same fed tokens; DynamicCache is the control for compile's own numerics."""
    ids = torch.randint(3, 32000, (1, 1500), generator=torch.Generator().manual_seed(2)).cuda()
    out = {}
    for attn in ("sdpa", "turboquant"):
        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.bfloat16, device_map={"": 0}).eval()
        model.set_attn_implementation(attn)
        rows = {}
        for cache_name, make in (("dynamic", lambda: DynamicCache()), ("turboquant_k4v4", lambda: TurboQuantCache("k4v4", config=model.config))):
            decode_steps(model, make(), ids, 40)  # warm-up: Triton JIT of every shape variant
            ref, fed, eager_ms = decode_steps(model, make(), ids, 40)
            row = {"eager_ms_per_step": eager_ms}
            for mode in ("default", "reduce-overhead"):
                if time.time() - START > BUDGET_S:
                    row[mode] = {"ok": None, "error": f"not run: the {BUDGET_S} s budget of this script was spent"}
                    continue
                torch._dynamo.reset()
                compiled = torch.compile(model, mode=None if mode == "default" else mode)
                try:
                    decode_steps(compiled, make(), ids, 40, fed)  # compile
                    got, _, ms = decode_steps(compiled, make(), ids, 40, fed)
                    errs = [((g.float() - r.float()).norm() / r.float().norm()).item() for g, r in zip(got, ref)]
                    same = sum(int(torch.equal(g.argmax(-1), r.argmax(-1))) for g, r in zip(got, ref)) / len(ref)
                    row[mode] = {"ok": True, "ms_per_step": ms, "rel_logit_err_vs_eager_prefill": errs[0],
                                 "rel_logit_err_vs_eager_max": max(errs), "rel_logit_err_vs_eager_median": sorted(errs)[len(errs) // 2],
                                 "argmax_agreement": same}
                except Exception as e:  # record what breaks, do not hide it
                    row[mode] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:600]}",
                                 "trace": traceback.format_exc()[-1500:]}
            rows[cache_name] = row
        out[attn] = rows
        del model
        torch.cuda.empty_cache()
    result["torch_compile"] = out


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        size = model_files(tmp)
        result["model_bytes"] = size
        if torch.cuda.device_count() >= 2 and os.environ.get("TQ_SKIP_MULTI") != "1":
            multi_gpu(tmp, size)
        else:
            result["multi_gpu"] = f"skipped: {torch.cuda.device_count()} GPU(s)"
        compile_check(tmp)
    path = os.path.join(OUT, "multi_gpu_check.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "device_map"}, indent=1)[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
