"""Perplexity of TurboQuant presets on SmolLM2 over rotation kinds and seeds (4096 held-out tokens, chunked prefill).

    PYTHONPATH=. python benchmarks/studies/rotation_seed_study.py --sink-tokens 0   # -> results/rotation_seed_study_smollm2.json
    PYTHONPATH=. python benchmarks/studies/rotation_seed_study.py --rotations hadamard --threads 1 \
        --out benchmarks/results/sink_quality_smollm2.json                # the same with the default attention sinks

The first run (sinks off, before they existed) gives docs/eval_findings.md's seed table; the second its sink section
(that run was stopped after k3v3 seed 0). The bit-split rows (k5v3, k4v2, k4v3, k6v2) come from
`--presets k5v3,k4v2 --rotations hadamard --out benchmarks/results/split_seed_study_smollm2.json` and
`--presets k4v3,k6v2 --seeds 1 --rotations hadamard --out benchmarks/results/split_probe_smollm2.json`.
"""
import argparse
import json
import os

import torch
from transformers import DynamicCache

from tq_hf_cache import TurboQuantCache, TurboQuantConfig
from tq_hf_cache.eval.tasks import perplexity
from tq_hf_cache.models import load_smollm2
from tq_hf_cache.texts import HELD_OUT_START, package_text

ap = argparse.ArgumentParser()
ap.add_argument("--presets", default="k4v4,k3v3", help='"kXvY" bit splits, comma-separated (not only the presets)')
ap.add_argument("--rotations", default="hadamard,orthogonal")
ap.add_argument("--seeds", type=int, default=6)
ap.add_argument("--sink-tokens", type=int, default=TurboQuantConfig().sink_tokens)
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                              "rotation_seed_study_smollm2.json"))
args = ap.parse_args()
torch.set_num_threads(args.threads)
model, tok = load_smollm2()
ids = tok(package_text(40000, start=HELD_OUT_START), return_tensors="pt")["input_ids"][:, :4096]
fp = perplexity(model, ids, lambda: DynamicCache())[0]["ppl"]
out = {"fp": fp, "tokens": 4096, "rows": []}
print("fp", fp, flush=True)
for preset in args.presets.split(","):
    for rot in args.rotations.split(","):
        for seed in range(args.seeds):
            kb, vb = (int(x) for x in preset[1:].split("v"))  # any "kXvY", not only the named presets
            r = perplexity(model, ids, lambda: TurboQuantCache(key_bits=kb, value_bits=vb, config=model.config,
                                                               rotation=rot, seed=seed,
                                                               sink_tokens=args.sink_tokens))[0]["ppl"]
            out["rows"].append({"preset": preset, "rotation": rot, "seed": seed, "sink_tokens": args.sink_tokens,
                                "ppl": r, "delta_pct": 100 * (r / fp - 1)})
            print(preset, rot, seed, round(100 * (r / fp - 1), 3), flush=True)
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)
