"""Where the time to first token goes (issue: the compiled path end to end), Llama-3.1-8B shape, random bf16
weights, one GPU. For each context and cache: a chunked prefill (8192-token chunks of `model(...)`, as the anchor
does) run twice in one process: the first run holds the first-call work (Triton compiles, tables), the second is
warm. Each chunk is timed alone (synchronized), so a cost that grows with the position (attention over
`max_cache_len`, dequantizing the whole history) shows per chunk. A profiler pass over the last chunk (and with
PROFILE_FIRST=1 the first) of a warm run gives the top kernels, their summed device time and the chunk's wall time.
Rows run in a rotating order per context, so no row always pays the process's first use of a library (cuBLAS /
cuDNN handles). GENERATE=N: then the first and second `generate` call (N-token prompt, 16 new tokens) of each static
cache, the first holding compile and CUDA-graph capture; in the order of GEN_ROWS. Run the script twice on one
machine to see the first call with warm disk caches (Triton's, the CUDA kernel's, inductor's). REPS=N: N warm runs
per row (warm, warm2, ...). Each run also records `host_s`: when the host had queued every chunk's work (close to the
wall time where the host, not the GPU, is the bound, or where it waits for the GPU).

    CTXS=4096,32768,131072,8x32768 python benchmarks/studies/first_token_study.py   # writes $OUT/first_token_study.json
"""

import gc
import json
import os
import sys
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
from tq_hf_cache import TurboQuantCache, TurboQuantStaticCache, cache_kwargs  # noqa: E402

OUT = os.environ.get("OUT", ".")
CTXS = [(int(c.split("x")[0]), int(c.split("x")[1])) if "x" in c else (1, int(c))
        for c in os.environ.get("CTXS", "4096,32768,131072").split(",")]
ROWS = os.environ.get("ROWS", "static,tq_static,dynamic,tq").split(",")
PROFILE_FIRST = os.environ.get("PROFILE_FIRST", "0") == "1"
GENERATE = int(os.environ.get("GENERATE", "0"))
GEN_ROWS = os.environ.get("GEN_ROWS", "static,tq_static").split(",")
REPS = int(os.environ.get("REPS", "1"))  # warm runs per row (warm, warm2, ...)
OUT_NAME = os.environ.get("OUT_NAME", "first_token_study.json")
CHUNK = 8192


def build():
    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=1 << 18,
                      rope_theta=500000.0)
    torch.manual_seed(0)
    with torch.device("cuda"):
        return LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


def make(model, row, cap):
    model.set_attn_implementation("sdpa" if row in ("static", "dynamic") else "turboquant")
    if row == "static":
        return StaticCache(config=model.config, max_cache_len=cap)
    if row == "tq_static":
        return TurboQuantStaticCache(config=model.config, max_cache_len=cap)
    if row == "dynamic":
        return DynamicCache(config=model.config)
    return TurboQuantCache(config=model.config)


@torch.no_grad()
def prefill(model, cache, ids, profile_last=False, profile_first=False):
    """Per-chunk seconds; with `profile_last` / `profile_first`, also that chunk's top CUDA kernels (ms), their
    total and the chunk's wall time under the profiler."""
    times, issued, top = [], [], {}
    for s in range(0, ids.shape[1], CHUNK):
        e = min(ids.shape[1], s + CHUNK)
        which = "last" if profile_last and e == ids.shape[1] else "first" if profile_first and s == 0 else None
        run = lambda: model(ids[:, s:e], **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1,  # noqa: E731
                            cache_position=torch.arange(s, e, device="cuda"))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if which:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                run()
                torch.cuda.synchronize()
            agg = {}
            for ev in prof.events():
                if ev.device_type == torch.autograd.DeviceType.CUDA:
                    agg[ev.name[:80]] = agg.get(ev.name[:80], 0.0) + ev.device_time / 1e3
            top[which] = {"wall_ms": round((time.perf_counter() - t0) * 1e3, 2),
                          "kernels_ms": round(sum(agg.values()), 2), "launches": sum(
                              1 for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA),
                          "top_ms": {k: round(v, 3) for k, v in sorted(agg.items(), key=lambda kv: -kv[1])[:12]}}
        else:
            run()
        issued.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times, issued, top


def main():
    model = build()
    with torch.no_grad():  # the process's first forward: CUDA, cuBLAS and cuDNN set up outside every row
        model(torch.zeros(1, 256, dtype=torch.long, device="cuda"))
    torch.cuda.synchronize()
    weights = torch.cuda.memory_allocated()
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "transformers": __import__("transformers").__version__, "rows": []}
    for k, (B, T) in enumerate(CTXS):
        ids = torch.randint(0, 32000, (B, T), generator=torch.Generator().manual_seed(T)).cuda()
        order = ROWS[k % len(ROWS):] + ROWS[: k % len(ROWS)]
        for row in order:
            r = {"batch": B, "ctx": T, "row": row}
            try:
                for run in ("first", "warm") + tuple(f"warm{i}" for i in range(2, REPS + 1)):
                    gc.collect()
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                    cache = make(model, row, T + 64)
                    times, issued, top = prefill(model, cache, ids, profile_last=run == "warm" and T >= 65536,
                                                 profile_first=run == "warm" and PROFILE_FIRST)
                    r[f"{run}_s"] = sum(times)
                    r[f"{run}_chunks_s"] = [round(t, 4) for t in times]
                    r[f"{run}_host_s"] = round(sum(issued), 4)  # until the host had issued every chunk's work
                    r[f"{run}_peak_over_weights_gib"] = (torch.cuda.max_memory_allocated() - weights) / 2**30
                    for which, prof in top.items():
                        r[f"{which}_chunk_profile"] = prof
                    del cache
            except Exception as e:  # noqa: BLE001
                r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(json.dumps({k: v for k, v in r.items() if not k.endswith(("chunks_s", "_profile"))}), flush=True)
            res["rows"].append(r)
            with open(os.path.join(OUT, OUT_NAME), "w") as f:
                json.dump(res, f, indent=1)
    if GENERATE:
        res["generate"] = first_generate(model, GENERATE)
        print(json.dumps(res["generate"]), flush=True)
        with open(os.path.join(OUT, OUT_NAME), "w") as f:
            json.dump(res, f, indent=1)


@torch.no_grad()
def first_generate(model, T: int, new: int = 16) -> list[dict]:
    """Wall seconds of the first and the second `generate` of each static cache (fresh cache each call); the first
    compiles the step and captures its CUDA graphs."""
    ids = torch.randint(0, 32000, (1, T), generator=torch.Generator().manual_seed(1)).cuda()
    out = []
    for row in GEN_ROWS:
        r = {"row": row, "prompt": T, "new_tokens": new}
        for call in ("first", "second"):
            cache = make(model, row, T + new + 8)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.generate(ids, **cache_kwargs(model, cache), max_new_tokens=new, min_new_tokens=new, do_sample=False)
            torch.cuda.synchronize()
            r[f"{call}_s"] = round(time.perf_counter() - t0, 3)
        r["compile_and_capture_s"] = round(r["first_s"] - r["second_s"], 3)
        out.append(r)
    return out


if __name__ == "__main__":
    main()
