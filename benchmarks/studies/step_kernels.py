"""Where a compiled decode step's GPU time goes, kernel by kernel (H100, Llama-3.1-8B shape, random bf16 weights, or
a checkpoint: --model).

Per case: a TurboQuantStaticCache (or StaticCache) row prefilled and warmed up as `tq_hf_cache.bench` does, then
--steps steps under torch.profiler; each kernel name's device time per step and per layer, largest first, and the
step's total. Comparing cases shows which kernels grow with the context or the batch besides the attention.
`--general_mask`: the fast kernel reads a decode step's mask by its general per-row path, not as the one row it is
(`kernels.fast._mask_row`), to measure what that costs in the model.
Usage:
    python benchmarks/studies/step_kernels.py [--layers 8] [--cases 1x4096,1x131072,8x32768]
        [--rows tq_static_compiled] [--preset k5v3] [--general_mask] [--model DIR] --out F
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from tq_hf_cache import bench  # noqa: E402


def profile_steps(prep, steps: int) -> dict:
    prep.model.set_attn_implementation(prep.attn)
    us, calls = bench.kernel_times(prep.step, steps)
    ranked = sorted(us.items(), key=lambda kv: -kv[1])
    return {"total_us": round(sum(us.values()), 1),
            "kernels": [{"name": k[:160], "us": round(v, 2), "calls": round(calls[k], 2)} for k, v in ranked]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--cases", default="1x4096,1x131072,8x32768")
    ap.add_argument("--rows", default="tq_static_compiled")
    ap.add_argument("--preset", default="k5v3")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--general_mask", action="store_true")
    ap.add_argument("--model", help="a checkpoint folder to load (bf16) instead of the random Llama (--layers)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.general_mask:
        from tq_hf_cache.kernels import fast

        fast._mask_row = lambda *args: False
    if a.model:
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16).to("cuda")
        a.layers = model.config.num_hidden_layers
    else:
        model = bench.random_llama_8b(a.layers, device="cuda")
    model.eval()
    rows = []
    for case in a.cases.split(","):
        b, t = map(int, case.split("x"))
        for row in a.rows.split(","):
            torch._dynamo.reset()
            t0 = time.time()
            prep = bench._Prepared(model, row, b, t, t + 64, 3, 8192, a.preset, None)
            res = dict(case=case, row=row, layers=a.layers, setup_s=round(time.time() - t0, 1),
                       **profile_steps(prep, a.steps))
            rows.append(res)
            top = ", ".join(f"{k['name'][:40]} {k['us']:.0f}" for k in res["kernels"][:6])
            print(f"{case} {row}: {res['total_us']:.0f} us a step ({a.layers} layers) | {top}", flush=True)
            del prep
            torch.cuda.empty_cache()
    with open(a.out, "w") as fh:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, preset=a.preset,
                       mask_path="general" if a.general_mask else "as the kernel chooses",
                       when=time.strftime("%Y-%m-%d %H:%M"), command=" ".join(sys.argv), rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
