"""k4v4 / k3v3 perplexity of SmolLM2 with the default attention sinks (sink_tokens=4), over rotation seeds.

    PYTHONPATH=. python benchmarks/sink_quality_study.py   # -> benchmarks/results/sink_quality_smollm2.json
"""
import json
import os
import torch
from transformers import DynamicCache
from tq_hf_cache import TurboQuantCache
from tq_hf_cache.models import load_smollm2
from tq_hf_cache.texts import package_text, HELD_OUT_START
from tq_hf_cache.eval.tasks import perplexity
torch.set_num_threads(1)
model, tok = load_smollm2()
ids = tok(package_text(40000, start=HELD_OUT_START), return_tensors="pt")["input_ids"][:, :4096]
fp = perplexity(model, ids, lambda: DynamicCache())[0]["ppl"]
out = {"fp": fp, "tokens": 4096, "rows": []}
print("fp", fp, flush=True)
for preset in ["k4v4", "k3v3"]:
    for seed in range(6):
        r = perplexity(model, ids, lambda: TurboQuantCache(preset, config=model.config, seed=seed))[0]["ppl"]
        out["rows"].append({"preset": preset, "seed": seed, "sink_tokens": 4, "ppl": r, "delta_pct": 100 * (r / fp - 1)})
        print(preset, seed, round(100 * (r / fp - 1), 3), flush=True)
        json.dump(out, open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "sink_quality_smollm2.json"), "w"), indent=1)
