"""The fast decode kernel inside a model, against cuDNN SDPA inside the same model: a random model of a checkpoint
folder (for SmolLM2-1.7B's shape: `benchmarks/results/archive/fast_decode_in_model_2026-12-06/smollm2_random.py
DIR`), eager decode steps, each kernel's device time from the profiler.
- `tq_decode`: each layer's launch as the model makes it ("in_model": the layer's other kernels have taken the
  kernel's code out of the SMs' instruction caches and out of L2), and the same launch made again at once ("again":
  code warm), `TurboQuantStaticCache` with `--preset`;
- SDPA: `StaticCache`'s cuDNN attention kernel and its reduction a layer.
Usage:
    python benchmarks/studies/fast_decode_in_model.py --model DIR [--cases 1x4096,1x16384,1x32768,2x4096]
        [--preset k5v3] [--steps 3] --out F
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from tq_hf_cache import bench  # noqa: E402
from tq_hf_cache.kernels import fast  # noqa: E402


def events(step, steps: int) -> list:
    """The CUDA kernel events of `steps` calls of `step`, in launch order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sorted(ev, key=lambda e: e.time_range.start)


def ours(model, batch: int, context: int, preset: str, steps: int) -> dict:
    """tq_decode's us a call: each launch in the model, and made again at once; and the plan it ran."""
    prep = bench._Prepared(model, "tq_static_compiled", batch, context, context + 8 * steps + 16, 0, 8192, preset, None)
    prep.fwd = model.forward  # eager: each layer's launch goes through `fast.decode`
    launch, plan = fast.decode, {}

    def twice(*args, **kw):
        plan.update(warps=args[22], splits=args[18], fold=args[19], parts=args[23] if len(args) > 23 else kw["parts"])
        ok = launch(*args, **kw)
        launch(*args, **kw)
        return ok

    fast.decode = twice
    try:
        prep.step()  # warm
        us = [e.time_range.elapsed_us() for e in events(prep.step, steps) if e.name == fast.NAME]
    finally:
        fast.decode = launch
    return dict(plan=plan, in_model_us=round(statistics.median(us[0::2]), 2), again_us=round(statistics.median(us[1::2]), 2),
                calls=len(us) // 2)


def sdpa(model, batch: int, context: int, steps: int) -> dict:
    """StaticCache's cuDNN SDPA kernels (attention, reduction): us a call, their sum."""
    prep = bench._Prepared(model, "static_compiled", batch, context, context + 8 * steps + 16, 0, 8192, "k5v3", None)
    prep.fwd = model.forward
    prep.step()
    per: dict[str, list[float]] = {}
    for e in events(prep.step, steps):
        if "sdpa" in e.name or "lean_reduction" in e.name:
            per.setdefault(e.name, []).append(e.time_range.elapsed_us())
    kernels = {k: round(statistics.median(v), 2) for k, v in per.items()}
    return dict(kernels=kernels, us=round(sum(kernels.values()), 2))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--cases", default="1x4096,1x16384,1x32768,2x4096")
    ap.add_argument("--preset", default="k5v3")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16).to("cuda").eval()
    rows = {}
    for case in a.cases.split(","):
        b, t = map(int, case.split("x"))
        row = dict(tq=ours(model, b, t, a.preset, a.steps), sdpa=sdpa(model, b, t, a.steps))
        row["sdpa_over_tq_in_model"] = round(row["sdpa"]["us"] / row["tq"]["in_model_us"], 2)
        rows[case] = row
        print(case, row, flush=True)
        torch.cuda.empty_cache()
    with open(a.out, "w") as fh:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, model=a.model,
                       layers=model.config.num_hidden_layers, preset=a.preset, when=time.strftime("%Y-%m-%d %H:%M"),
                       command=" ".join(sys.argv), rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
