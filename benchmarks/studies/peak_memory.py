"""Memory through a real chunked prefill and a few decode steps, by cache (Llama-3.1-8B shape, random weights).

    python benchmarks/studies/peak_memory.py --contexts 32768,131072 --chunk 8192
Per chunk: memory held after the chunk and the peak within it, over the weights (GiB). Answers "what holds the
extra memory" of the TurboQuant workspace path at long context.
"""

import argparse
import json
import os
import sys

import torch
from transformers import DynamicCache

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir))
from bench_prefix import load_model  # noqa: E402

from tq_hf_cache import TurboQuantCache, cache_kwargs  # noqa: E402

GiB = 2**30


@torch.no_grad()
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--contexts", default="32768,131072")
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--caches", default="dynamic,tq_sdpa,tq_fused")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    model = load_model("llama8b-random", "cuda", torch.bfloat16)
    cfg = model.config
    rows = []
    for L in [int(x) for x in args.contexts.split(",")]:
        for kind in args.caches.split(","):
            model.set_attn_implementation("turboquant" if kind == "tq_fused" else "sdpa")
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            cache = DynamicCache(config=cfg) if kind == "dynamic" else TurboQuantCache(config=cfg)
            ids = torch.randint(0, cfg.vocab_size, (1, L), device="cuda")
            chunks = []
            for s in range(0, L, args.chunk):
                torch.cuda.reset_peak_memory_stats()
                model(ids[:, s:s + args.chunk], **cache_kwargs(model, cache), logits_to_keep=1)
                torch.cuda.synchronize()
                chunks.append((round((torch.cuda.memory_allocated() - base) / GiB, 2),
                               round((torch.cuda.max_memory_allocated() - base) / GiB, 2)))
            torch.cuda.reset_peak_memory_stats()
            tok = ids[:, :1]
            for _ in range(3):
                model(tok, **cache_kwargs(model, cache))
            torch.cuda.synchronize()
            row = {"cache": kind, "context": L, "held_after_chunk_GiB": [c[0] for c in chunks],
                   "peak_in_chunk_GiB": [c[1] for c in chunks],
                   "decode_peak_GiB": round((torch.cuda.max_memory_allocated() - base) / GiB, 2),
                   "held_after_decode_GiB": round((torch.cuda.memory_allocated() - base) / GiB, 2)}
            if kind != "dynamic":
                row["nbytes_GiB"] = {k: round(v / GiB, 3) for k, v in cache.nbytes().items()}
            print(json.dumps(row), flush=True)
            rows.append(row)
            del cache, ids
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
