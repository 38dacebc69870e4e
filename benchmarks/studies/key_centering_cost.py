"""What key centring costs a decode step: Llama-3.1-8B shape (32 layers, random bf16 weights), batch 1, 32k-token
chunked prefill, TurboQuantCache k5v3 with the fused attention, eager; wall ms per step (median of 15, synchronized)
and GPU ms per step (profiler), with key_centering off and on.

Usage (CUDA): PYTHONPATH=. python benchmarks/studies/key_centering_cost.py   (writes $OUT/center_gpu.json)
"""
import os, sys, time, json, statistics, gc
import torch, transformers
sys.path.insert(0, ".")
from tq_hf_cache import TurboQuantCache, bench, cache_kwargs
DEV = "cuda"
cfg = bench.llama_8b_config(32)
torch.manual_seed(0)
with torch.device(DEV):
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
model.set_attn_implementation("turboquant")
res = {}
for ctx in (32768,):
    ids = torch.randint(0, cfg.vocab_size, (1, ctx), device=DEV)
    for cen in (False, True):
        gc.collect(); torch.cuda.empty_cache()
        cache = TurboQuantCache(config=cfg, key_centering=cen)
        with torch.no_grad():
            for s in range(0, ctx, 8192):
                out = model(ids[:, s:s + 8192], **cache_kwargs(model, cache), logits_to_keep=1)
        tok = out.logits[:, -1:].argmax(-1)
        def step():
            global tok
            with torch.no_grad():
                o = model(tok, **cache_kwargs(model, cache))
            tok = o.logits[:, -1:].argmax(-1)
        for _ in range(3): step()
        walls = []
        for _ in range(15):
            torch.cuda.synchronize(); t = time.perf_counter(); step(); torch.cuda.synchronize(); walls.append((time.perf_counter() - t) * 1e3)
        from torch.profiler import profile, ProfilerActivity
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3): step()
            torch.cuda.synchronize()
        gpu = sum(e.self_device_time_total for e in prof.key_averages()) / 3 / 1e3
        res[f"ctx{ctx}_centering{int(cen)}"] = {"wall_ms": statistics.median(walls), "gpu_ms": gpu}
        print(ctx, cen, res[f"ctx{ctx}_centering{int(cen)}"], flush=True)
        del cache
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "center_gpu.json"), "w"), indent=1)
