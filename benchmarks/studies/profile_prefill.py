"""Where a TurboQuantCache prefill spends its time (Llama-3.1-8B shape, random weights, one GPU).

    python benchmarks/studies/profile_prefill.py --tokens 4096
Prints wall time of one prefill for DynamicCache and TurboQuantCache (and variants), then the profiler's top ops.
"""

import argparse
import os
import sys
import time

import torch
from transformers import DynamicCache

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir))
from bench_prefix import load_model  # noqa: E402

from tq_hf_cache import TurboQuantCache, cache_kwargs  # noqa: E402
from tq_hf_cache import layer as layer_mod  # noqa: E402


def timed(fn, reps=3):
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return sorted(out)[len(out) // 2]


@torch.no_grad()
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    args = p.parse_args()
    model = load_model("llama8b-random", "cuda", torch.bfloat16)
    cfg = model.config
    ids = torch.randint(10, 1000, (1, args.tokens), device="cuda")
    run = lambda make: model(ids, **cache_kwargs(model, make()), logits_to_keep=1)  # noqa: E731
    print(f"DynamicCache            {timed(lambda: run(lambda: DynamicCache(config=cfg))):.3f} s")
    print(f"TurboQuantCache         {timed(lambda: run(lambda: TurboQuantCache(config=cfg))):.3f} s")
    orig = layer_mod.TurboQuantLayer._widen_norms_if_needed
    layer_mod.TurboQuantLayer._widen_norms_if_needed = lambda self, k, v: None
    print(f"  without norm check    {timed(lambda: run(lambda: TurboQuantCache(config=cfg))):.3f} s")
    layer_mod.TurboQuantLayer._widen_norms_if_needed = orig
    print(f"  norm_dtype float32    {timed(lambda: run(lambda: TurboQuantCache(config=cfg, norm_dtype='float32'))):.3f} s")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        run(lambda: TurboQuantCache(config=cfg))
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
