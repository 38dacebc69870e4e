"""Does choosing each layer's rotation by calibration close the 2-bit gap? A CPU study on an allocation folder.

At 2 bits the perplexity change moves with the rotation seed far more than at 3-4 bits (SmolLM2's 2.0 allocation:
+4.4 / +6.0 / +5.5 / +7.0 % over seeds 0-3). Every layer has its own rotation (seed + layer index); here each layer
draws `--candidates` rotations from a pool seed, keeps the one whose quantization (that layer alone, at its
allocated widths, all other layers full precision) moves the next-token distribution least (mean KL, chunked prefill
of calibration text: the package text before the held-out slice), then the whole cache is evaluated on the held-out
text exactly as `tq-hf-cache eval` does (`eval.tasks.perplexity`), against the pool seed's plain rotations.

Usage: PYTHONPATH=. python benchmarks/studies/rotation_choice_study.py --alloc benchmarks/results/allocations/smollm2-2 \
           --pools 0,1,2,3 --candidates 6 --out benchmarks/results/rotation_choice_study_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from tq_hf_cache import TurboQuantCache, TurboQuantConfig  # noqa: E402
from tq_hf_cache.allocation import _chunk_logprobs  # noqa: E402
from tq_hf_cache.cache import _rotation  # noqa: E402
from tq_hf_cache.config import model_facts  # noqa: E402
from tq_hf_cache.eval.tasks import perplexity  # noqa: E402
from tq_hf_cache.texts import HELD_OUT_START, package_text  # noqa: E402
from transformers import DynamicCache  # noqa: E402


def load(name):
    if name == "smollm2":
        from tq_hf_cache.models import load_smollm2

        return load_smollm2()
    from tq_hf_cache.eval.models import load_model

    model, tok, _ = load_model(name)
    return model, tok


def with_seeds(cfg: TurboQuantConfig, model_config, seeds: dict[int, int]) -> TurboQuantCache:
    """A cache whose layer i uses rotation seed seeds[i] (the default: cfg.seed + i)."""
    cache = TurboQuantCache(cfg, config=model_config)
    for i, s in seeds.items():
        layer = cache.layers[i]
        if hasattr(layer, "_rotation_for"):
            layer._rotation_for = partial(_rotation, seed=s, kind=cfg.rotation)
    return cache


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--alloc", required=True)
    ap.add_argument("--pools", default="0,1")
    ap.add_argument("--candidates", type=int, default=6)
    ap.add_argument("--calib-tokens", type=int, default=1024)
    ap.add_argument("--eval-tokens", type=int, default=4096)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(2)
    model, tok = load(a.model)
    layers = model_facts(model.config)["num_hidden_layers"]
    base = TurboQuantConfig.from_pretrained(a.alloc)
    calib = tok(package_text(min_chars=a.calib_tokens * 8), return_tensors="pt").input_ids[:, : a.calib_tokens]
    held = tok(package_text(40000, start=HELD_OUT_START), return_tensors="pt").input_ids[:, : a.eval_tokens]
    ref = _chunk_logprobs(model, calib, DynamicCache(config=model.config), 256)
    fp = perplexity(model, held, lambda: DynamicCache(config=model.config))[0]["ppl"]
    res = {"model": a.model, "alloc": a.alloc, "candidates": a.candidates, "calib_tokens": a.calib_tokens,
           "eval_tokens": a.eval_tokens, "fp_ppl": fp, "pools": []}
    for pool in [int(x) for x in a.pools.split(",")]:
        t0 = time.time()
        plain = {i: pool + i for i in range(layers)}  # what cfg.seed = pool gives
        cands = {i: [plain[i]] + [10_000 * (pool + 1) + 100 * i + j for j in range(1, a.candidates)] for i in range(layers)}
        chosen, kls = {}, {}
        for i in range(layers):
            others = [j for j in range(layers) if j != i]
            cfg = TurboQuantConfig.from_dict({**base.to_dict(), "skip_layers": others})
            row = []
            for s in cands[i]:
                lp = _chunk_logprobs(model, calib, with_seeds(cfg, model.config, {i: s}), 256)
                row.append(float((ref.exp() * (ref - lp)).sum(-1).mean()))
            kls[i] = row
            chosen[i] = cands[i][min(range(len(row)), key=row.__getitem__)]
            print(f"pool {pool} layer {i}: KL plain {row[0]:.2e} best {min(row):.2e}", flush=True)
        ppl_plain = perplexity(model, held, lambda: with_seeds(base, model.config, plain))[0]["ppl"]
        ppl_chosen = perplexity(model, held, lambda: with_seeds(base, model.config, chosen))[0]["ppl"]
        r = {"pool": pool, "plain_delta_pct": 100 * (ppl_plain / fp - 1), "chosen_delta_pct": 100 * (ppl_chosen / fp - 1),
             "chosen_seeds": chosen, "kl_per_layer": kls, "seconds": round(time.time() - t0, 1)}
        res["pools"].append(r)
        print(f"pool {pool}: plain {r['plain_delta_pct']:+.2f}% chosen {r['chosen_delta_pct']:+.2f}% ({r['seconds']} s)", flush=True)
        json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
