"""Where the time to first token goes (issue: the compiled path end to end), Llama-3.1-8B shape, random bf16
weights, one GPU. For each context and cache: a chunked prefill (8192-token chunks of `model(...)`, as the anchor
does) run twice in one process: the first run holds the first-call work (Triton compiles, tables), the second is
warm. Each chunk is timed alone (synchronized), so a cost that grows with the position (attention over
`max_cache_len`, dequantizing the whole history) shows per chunk. A profiler pass over the last chunk of a warm
run gives the top kernels. Rows run in a rotating order per context, so no row always pays the process's first use
of a library (cuBLAS / cuDNN handles).

    CTXS=4096,32768,131072 python benchmarks/studies/first_token_study.py   # writes $OUT/first_token_study.json
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
CTXS = [int(c) for c in os.environ.get("CTXS", "4096,32768,131072").split(",")]
ROWS = os.environ.get("ROWS", "static,tq_static,dynamic,tq").split(",")
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
def prefill(model, cache, ids, profile_last=False):
    """Per-chunk seconds; with `profile_last`, also the top CUDA kernels of the last chunk (ms)."""
    times, top = [], None
    for s in range(0, ids.shape[1], CHUNK):
        e = min(ids.shape[1], s + CHUNK)
        last = e == ids.shape[1]
        run = lambda: model(ids[:, s:e], **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1,  # noqa: E731
                            cache_position=torch.arange(s, e, device="cuda"))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if profile_last and last:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                run()
                torch.cuda.synchronize()
            agg = {}
            for ev in prof.events():
                if ev.device_type == torch.autograd.DeviceType.CUDA:
                    agg[ev.name[:80]] = agg.get(ev.name[:80], 0.0) + ev.device_time / 1e3
            top = dict(sorted(agg.items(), key=lambda kv: -kv[1])[:10])
        else:
            run()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times, top


def main():
    model = build()
    with torch.no_grad():  # the process's first forward: CUDA, cuBLAS and cuDNN set up outside every row
        model(torch.zeros(1, 256, dtype=torch.long, device="cuda"))
    torch.cuda.synchronize()
    weights = torch.cuda.memory_allocated()
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "transformers": __import__("transformers").__version__, "rows": []}
    for k, T in enumerate(CTXS):
        ids = torch.randint(0, 32000, (1, T), generator=torch.Generator().manual_seed(T)).cuda()
        order = ROWS[k % len(ROWS):] + ROWS[: k % len(ROWS)]
        for row in order:
            r = {"ctx": T, "row": row}
            try:
                for run in ("first", "warm"):
                    gc.collect()
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                    cache = make(model, row, T + 64)
                    times, top = prefill(model, cache, ids, profile_last=run == "warm" and T >= 65536)
                    r[f"{run}_s"] = sum(times)
                    r[f"{run}_chunks_s"] = [round(t, 4) for t in times]
                    r[f"{run}_peak_over_weights_gib"] = (torch.cuda.max_memory_allocated() - weights) / 2**30
                    if top:
                        r["last_chunk_top_kernels_ms"] = top
                    del cache
            except Exception as e:  # noqa: BLE001
                r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(json.dumps({k: v for k, v in r.items() if not k.endswith("chunks_s")}), flush=True)
            res["rows"].append(r)
            with open(os.path.join(OUT, "first_token_study.json"), "w") as f:
                json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
