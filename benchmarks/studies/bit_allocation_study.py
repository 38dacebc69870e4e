"""Per-layer bit allocation under a bits-per-coordinate budget, from measured sensitivities (issue 15 study).

Step 1 (sensitivity): on calibration text (the package text before the held-out slice), for every layer i, kind
(keys / values) and bit width b, the mean KL(fp || cache) of the next-token distributions over the chunked-prefill
positions that attend to the cache, with only layer i quantized and only that kind at b bits (the other kind at 8
bits, within 0.1 % of fp on both models). Step 2 (allocation): per-layer (key bits, value bits) minimizing the sum
of the measured KLs under the budget (`tq_hf_cache.allocation`: a Lagrangian sweep and a greedy top-up; sensitivities are
assumed additive). Step 3: perplexity
on the held-out text of the allocation against the uniform preset of the same bytes, over rotation seeds.

Usage: python benchmarks/studies/bit_allocation_study.py [--model smollm2] [--tokens 1024] [--out F.json]
       [--budgets 3.25,2.5,2.0] [--eval-tokens 4096] [--seeds 0,1,2,3] [--threads 2] [--save-dir DIR]
       [--sensitivity EARLIER.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from tq_hf_cache import TurboQuantCache, TurboQuantConfig  # noqa: E402
from tq_hf_cache.allocation import (allocate_bits, bits_per_coordinate, layer_token_weights,  # noqa: E402
                                   measure_sensitivity)
from tq_hf_cache.eval.models import load_model  # noqa: E402
from tq_hf_cache.eval.runner import EvalSettings, eval_texts  # noqa: E402
from tq_hf_cache.eval.tasks import perplexity  # noqa: E402
from tq_hf_cache.texts import package_text  # noqa: E402


@torch.inference_mode()
def refine(model, ids, chunk, layer_bits, rounds, log):
    """Budget-neutral swaps measured in context: with every layer at its allocated widths, the KL change of one
    more bit and of one bit less for each layer and kind (one prefill each); then the best gains paired with the
    cheapest losses, each swap kept only if the whole allocation's KL falls. Widths stay within KEY/VALUE_BITS."""
    from tq_hf_cache.allocation import KEY_BITS, VALUE_BITS, _chunk_logprobs

    cfg = model.config
    layers = cfg.num_hidden_layers
    ref = _chunk_logprobs(model, ids, TurboQuantCache(config=cfg, skip_layers=list(range(layers))), chunk)

    def kl(lb):
        lp = _chunk_logprobs(model, ids, TurboQuantCache(config=cfg, layer_bits=lb), chunk)
        return float((ref.exp() * (ref - lp)).sum(-1).mean())

    widths = (KEY_BITS, VALUE_BITS)
    lb = {i: list(v) for i, v in layer_bits.items()}
    cur = kl(lb)
    log(f"refine: start KL {cur:.5f}")
    for r in range(rounds):
        ups, downs = [], []
        for i in range(layers):
            for w in (0, 1):
                for step, out in ((1, ups), (-1, downs)):
                    b = lb[i][w] + step
                    if b in widths[w]:
                        trial = {**lb, i: [b, lb[i][1]] if w == 0 else [lb[i][0], b]}
                        out.append((kl(trial) - cur, i, w, b))
        ups.sort()
        downs.sort()
        touched, changed = set(), 0
        for du, i, w, b in ups:
            if du >= 0 or (i, w) in touched:
                continue
            for dd, j, v, c in downs:
                if (j, v) in touched or (j, v) == (i, w) or du + dd >= 0:
                    continue
                trial = {k: list(x) for k, x in lb.items()}
                trial[i][w], trial[j][v] = b, c
                new = kl(trial)
                if new < cur:
                    lb, cur = trial, new
                    touched |= {(i, w), (j, v)}
                    changed += 1
                break
        log(f"refine: round {r}: {changed} swaps, KL {cur:.5f}")
        if not changed:
            break
    return lb


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--budgets", default="3.25,2.5,2.0")
    p.add_argument("--eval-tokens", type=int, default=4096)
    p.add_argument("--seeds", default="0,1,2,3")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sensitivity", default=None, help="reuse the sensitivities of an earlier output JSON")
    p.add_argument("--save-dir", default=None,
                   help="also write each budget's allocation as SAVE_DIR/<model>-<budget>/turboquant_config.json")
    p.add_argument("--context", type=int, default=4096,
                   help="the budget holds for the bytes held at this many tokens (sliding-window layers hold fewer)")
    p.add_argument("--uniform", type=int, default=1, help="also evaluate the uniform presets (0: allocated only)")
    p.add_argument("--refine", type=int, default=0, help="rounds of in-context swaps after the allocation (0: none)")
    p.add_argument("--key-centering", type=int, default=0, help="1: measure, save and evaluate with key_centering on")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    model, tok, info = load_model(a.model)
    cfg = model.config
    layers = cfg.num_hidden_layers
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    res = {"model": a.model, "tokens": a.tokens, "chunk": a.chunk, "head_dim": head_dim, "layers": layers,
           "key_centering": bool(a.key_centering)}
    t0 = time.time()
    if a.sensitivity:
        old = json.load(open(a.sensitivity))
        sens = {int(i): {k: {int(b): x for b, x in d.items()} for k, d in v.items()} for i, v in old["sensitivity"].items()}
    else:
        ids = tok(package_text(min_chars=a.tokens * 8), return_tensors="pt").input_ids[:, : a.tokens]
        sens = measure_sensitivity(model, ids, chunk=a.chunk, base=TurboQuantConfig(key_centering=bool(a.key_centering)))
    res["sensitivity"] = sens
    res["allocations"] = {}
    weights = layer_token_weights(cfg, a.context)
    res["context"], res["layer_token_weights"] = a.context, weights
    for budget in map(float, a.budgets.split(",")):
        choice = allocate_bits(sens, budget, head_dim, weights=weights)
        if a.refine:
            ids = tok(package_text(min_chars=a.tokens * 8), return_tensors="pt").input_ids[:, : a.tokens]
            choice = refine(model, ids, a.chunk, choice, a.refine, lambda m: print(f"[{time.time() - t0:6.0f}s] {m}", flush=True))
        bpc = bits_per_coordinate(choice, head_dim, weights=weights)
        res["allocations"][str(budget)] = {"layer_bits": choice, "bits_per_coordinate": round(bpc, 4)}
        print(f"budget {budget}: {bpc:.3f} bits/coord, {choice}", flush=True)
        if a.save_dir:
            folder = os.path.join(a.save_dir, f"{a.model}-{budget:g}" + ("-c" if a.key_centering else ""))
            TurboQuantConfig(layer_bits=choice, key_centering=bool(a.key_centering)).save_pretrained(folder, model_config=cfg, extra={"bit_allocation": {
                "budget": budget, "context": a.context, "tokens": a.tokens, "chunk": a.chunk,
                "made_by": "benchmarks/studies/bit_allocation_study.py",
                "sensitivity_kl": {str(i): v for i, v in sens.items()}}})
    json.dump(res, open(a.out, "w"), indent=1)
    if a.eval_tokens:
        ids = eval_texts(tok, EvalSettings(ppl_tokens=a.eval_tokens, agreement_prompts=0))[0][:, : a.eval_tokens]
        fp, _, _ = perplexity(model, ids, lambda: TurboQuantCache(config=cfg, skip_layers=list(range(layers))), a.chunk)
        res["eval"] = {"fp": fp["ppl"]}
        # the uniform preset at or just above each budget: k4v2, k3v2, k2v2 are 3.25, 2.75, 2.25 bits per
        # coordinate at head dim 64 (SmolLM2) and 3.0625, 2.5625, 2.0625 at head dim 256 (Gemma 3)
        uniform = {"3.25": (4, 2), "3.0625": (4, 2), "2.5": (3, 2), "2.0": (2, 2)}
        for budget, alloc in res["allocations"].items():
            for seed in map(int, a.seeds.split(",")):
                rows = [("allocated", {"layer_bits": alloc["layer_bits"]})]
                if a.uniform:
                    rows.append(("uniform", dict(zip(("key_bits", "value_bits"), uniform.get(budget, (4, 2))))))
                for name, kw in rows:
                    r, _, _ = perplexity(model, ids, lambda: TurboQuantCache(
                        config=cfg, seed=seed, key_centering=bool(a.key_centering), **kw), a.chunk)
                    key = f"{budget}/{name}/seed{seed}"
                    res["eval"][key] = r["ppl"]
                    print(f"[{time.time() - t0:6.0f}s] {key}: ppl {r['ppl']:.4f} ({100 * (r['ppl'] / fp['ppl'] - 1):+.2f} %)",
                          flush=True)
                    json.dump(res, open(a.out, "w"), indent=1)
    res["seconds"] = round(time.time() - t0)
    json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
