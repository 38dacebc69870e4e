"""CPU decode step at 3072 tokens on the embedded SmolLM2: DynamicCache against TurboQuantCache on the path a user
gets by default (transformers' sdpa attention, which runs the fused attention on a decode step: its packed history
read by the C of `kernels.cpu`), on the same path where no C compiler works (the torch math, `TQ_FUSED_BACKEND=torch`)
and on the workspace path (`fused_sdpa=False`). The caches are stepped in turns in one process; medians after 2 warm steps,
per round (--rounds rounds of --steps steps each, the history growing by the steps); the ratio reported is the median
of the rounds' ratios, each round's beside it (this 2-core machine's noise moves one round's ratio by 0.1 or more).

    python benchmarks/studies/cpu_default_path.py --out benchmarks/results
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from transformers import DynamicCache

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
from tq_hf_cache import TurboQuantCache, cache_kwargs, ops  # noqa: E402
from tq_hf_cache.models import load_smollm2  # noqa: E402
from tq_hf_cache.texts import package_text  # noqa: E402


def _commit() -> str:
    """The commit the study ran, with "+ changes" when the package or the studies differ from it."""
    root = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir)
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True).stdout
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "tq_hf_cache", "benchmarks/studies"], cwd=root,
                               capture_output=True, text=True).stdout
    except OSError:
        return "unknown"
    return head.strip() + (" + changes" if dirty.strip() else "")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--context", type=int, default=3072)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=".")
    args = p.parse_args()
    model, tok = load_smollm2()
    ids = tok(package_text(8 * args.context), return_tensors="pt")["input_ids"][:, : args.context]
    caches = {"DynamicCache": DynamicCache(config=model.config),
              "TurboQuantCache (default, sdpa)": TurboQuantCache(config=model.config),
              "TurboQuantCache (default, no C compiler: torch math)": TurboQuantCache(config=model.config),
              "TurboQuantCache (fused_sdpa=False)": TurboQuantCache(config=model.config, fused_sdpa=False)}
    backend = {name: "torch" if "torch math" in name else "auto" for name in caches}
    tok_of, rounds = {}, []
    with torch.no_grad():
        for name, cache in caches.items():
            ops.FUSED_BACKEND = backend[name]
            for s in range(0, args.context, 512):
                out = model(ids[:, s: s + 512], **cache_kwargs(model, cache))
            tok_of[name] = out.logits[:, -1:].argmax(-1)
        for _ in range(args.rounds):
            times = {k: [] for k in caches}
            for _ in range(args.steps + 2):
                for name, cache in caches.items():
                    ops.FUSED_BACKEND = backend[name]
                    t = time.perf_counter()
                    out = model(tok_of[name], **cache_kwargs(model, cache))
                    times[name].append(time.perf_counter() - t)
                    tok_of[name] = out.logits[:, -1:].argmax(-1)
            rounds.append({k: statistics.median(v[2:]) * 1e3 for k, v in times.items()})
    ratios = {k: [r[k] / r["DynamicCache"] for r in rounds] for k in caches}
    from tq_hf_cache.kernels import cpu

    res = {"command": "python benchmarks/studies/cpu_default_path.py " + " ".join(sys.argv[1:]), "code": _commit(),
           "c_kernels": cpu.available(), "context": args.context, "threads": torch.get_num_threads(),
           "torch": torch.__version__,
           "steps_per_round": args.steps, "rounds": args.rounds,
           "ms_per_step": {k: [round(r[k], 2) for r in rounds] for k in caches},
           "vs_DynamicCache_per_round": {k: [round(x, 3) for x in v] for k, v in ratios.items()},
           "vs_DynamicCache": {k: round(statistics.median(v), 3) for k, v in ratios.items()}}
    print(json.dumps(res))
    with open(os.path.join(args.out, "cpu_default_path_smollm2.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
