"""Decode step with split keys on the H100: k4v2 against k4v2 with keys split 64 x 5 + 64 x 3 (channels ordered by a
calibration on random ids), through `bench.run_row` (real chunked prefill, median wall ms of 20 steps, profiler GPU
ms): the workspace path (tq_sdpa), the fused kernel (tq_fused) and the compiled static cache (tq_static_compiled),
beside transformers' StaticCache + torch.compile (static_compiled) in the same run. Llama-3.1-8B shape, 4 layers,
bf16, batch 1, random weights. Writes $OUT/split_speed.json.

With --centred 1 it times k4v2 with key centring instead (the fused kernel and the compiled static cache, where
each step adds q . R(t) mu to the packed positions' scores through a float32 mask).

Usage: python benchmarks/studies/key_split_speed.py [--contexts 4096,32768] [--layers 4] [--centred 0]
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from transformers import LlamaForCausalLM  # noqa: E402

from tq_hf_cache import TurboQuantConfig, bench  # noqa: E402
from tq_hf_cache.bench import llama_8b_config  # noqa: E402
from tq_hf_cache.key_split import calibrate_key_split  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--contexts", default="4096,32768")
p.add_argument("--layers", type=int, default=4)
p.add_argument("--centred", type=int, default=0)
p.add_argument("--out", default=os.environ.get("OUT", "."))
a = p.parse_args()
torch.manual_seed(0)
cfg = llama_8b_config(layers=a.layers)
model = LlamaForCausalLM(cfg).to("cuda", torch.float32).eval()
base = TurboQuantConfig.from_preset("k4v2")
ids = torch.randint(0, cfg.vocab_size, (1, 512), device="cuda")
split = TurboQuantConfig.from_dict({**base.to_dict(),
                                    "key_split": calibrate_key_split(model, ids, [64, 64], [1, -1], base)})
model = model.to(torch.bfloat16)
rows = []
for ctx in map(int, a.contexts.split(",")):
    variants = ((("k4v2", base), ("k4v2-split64x5+64x3", split)) if not a.centred else
                (("k4v2", base), ("k4v2-centred", TurboQuantConfig.from_dict({**base.to_dict(), "key_centering": True}))))
    rows_of = ("tq_sdpa", "tq_fused", "tq_static_compiled") if not a.centred else ("tq_fused", "tq_static_compiled")
    plan = [("static_compiled", "-", base)] + [(row, name, tq) for name, tq in variants for row in rows_of]
    for row, name, tq in plan:
        r = bench.run_row(model, row, 1, ctx, preset=tq)
        r.pop("_tokens")
        r["preset"] = name
        print(r, flush=True)
        rows.append(r)
out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
       "model": f"Llama-3.1-8B shape, {a.layers} layers, bf16, random weights", "batch": 1, "rows": rows,
       "command": "python benchmarks/studies/key_split_speed.py " + " ".join(sys.argv[1:])}
with open(os.path.join(a.out, "split_speed.json"), "w") as f:
    json.dump(out, f, indent=1)
print("wrote", os.path.join(a.out, "split_speed.json"))
