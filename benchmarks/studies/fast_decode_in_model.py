"""What the fast decode kernel waits on inside a model: each layer's `tq_decode` launch in an eager decode step,
timed by the profiler, against the same launch made again at once ("twice": its inputs, code and SM state warm), and
against the layer's launch made right after the previous layer's launch is repeated ("after_other": the kernel's code
and SM state warm, this layer's inputs not). A random model of a checkpoint folder (for SmolLM2-1.7B's shape:
`benchmarks/results/archive/fast_decode_in_model_2026-12-06/smollm2_random.py DIR`), `TurboQuantStaticCache`,
batch 1. In the model the kernel took 18.1-18.7 us a call at 1 x 4k, the same launches replayed alone 12.5-13.5.
Usage:
    python benchmarks/studies/fast_decode_in_model.py --model DIR [--context 4096] [--preset k5v3] [--steps 4] --out F
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


def durations(step, steps: int) -> list[float]:
    """Device us of every `tq_decode` launch over `steps` calls of `step`, in launch order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.name == fast.NAME]
    return [e.time_range.elapsed_us() for e in sorted(ev, key=lambda e: e.time_range.start)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--preset", default="k5v3")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16).to("cuda").eval()
    layers = model.config.num_hidden_layers
    # prefilled as the benchmarks do; no warm-up steps, so the compiled forward it makes is never run
    prep = bench._Prepared(model, "tq_static_compiled", 1, a.context, a.context + 8 * a.steps + 16, 0, 8192,
                           a.preset, None)
    prep.fwd = model.forward  # eager: each layer's launch goes through `fast.decode`, which the modes below wrap
    launch, prev = fast.decode, []

    def step():
        prev.clear()
        prep.step()

    def twice(*args, **kw):
        ok = launch(*args, **kw)
        launch(*args, **kw)
        return ok

    def after_other(*args, **kw):
        if prev:
            launch(*prev[0][0], **prev[0][1])
        prev[:] = [(args, kw)]
        return launch(*args, **kw)

    rows = {}
    for mode, wrap in (("plain", launch), ("twice", twice), ("after_other", after_other)):
        fast.decode = wrap
        try:
            step()  # warm
            us = durations(step, a.steps)
        finally:
            fast.decode = launch
        if mode == "plain":
            parts = {"in_model": us}
        elif mode == "twice":
            parts = {"first": us[0::2], "again": us[1::2]}
        else:  # per step: layer 0 alone, then (previous layer's launch again, this layer's) for layers 1 ..
            per = [us[s * (2 * layers - 1):(s + 1) * (2 * layers - 1)] for s in range(a.steps)]
            parts = {"other_again": [x for p in per for x in p[1::2]], "after_other": [x for p in per for x in p[2::2]]}
        rows[mode] = {k: {"median_us": round(statistics.median(v), 2), "n": len(v), "us": [round(x, 2) for x in v]}
                      for k, v in parts.items()}
        print(mode, {k: (v["median_us"], v["n"]) for k, v in rows[mode].items()}, flush=True)
    with open(a.out, "w") as fh:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, model=a.model, layers=layers,
                       context=a.context, preset=a.preset, when=time.strftime("%Y-%m-%d %H:%M"),
                       command=" ".join(sys.argv), modes=rows), fh, indent=1)


if __name__ == "__main__":
    main()
