"""Write cache folders for the split-key evaluation: a base config (a preset or an allocation folder) with its keys
split (`tq_hf_cache.key_split`), channels calibrated once on the calibration text, one folder per rotation seed, so
that `tq-hf-cache eval --caches` runs them like any saved config.

Usage (the commands of docs/quality.md):
    python benchmarks/studies/key_split_folders.py --model gemma3-270m --base k4v2 --sizes 64,64,128 --deltas 2,0,-1 \
        --key-centering --seeds 0,1,2,3,4,5,6,7 --out /tmp/split
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from tq_hf_cache import TurboQuantConfig
from tq_hf_cache.config import PRESETS, model_facts
from tq_hf_cache.key_split import calibrate_key_split
from tq_hf_cache.texts import package_text

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from key_fix_study import load  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--base", required=True, help="a preset name or a folder holding a turboquant_config.json")
    ap.add_argument("--sizes", required=True, help="channels per part, heaviest RoPE pairs first, e.g. 64,64,128")
    ap.add_argument("--deltas", required=True, help="bits added to each layer's key bits, per part, e.g. 2,0,-1")
    ap.add_argument("--key-centering", action="store_true")
    ap.add_argument("--calib-tokens", type=int, default=1024)
    ap.add_argument("--seeds", default="0,1,2,3")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    model, tok = load(a.model)
    if a.base in PRESETS:
        base, tag = TurboQuantConfig.from_preset(a.base), a.base
    else:
        base, tag = TurboQuantConfig.from_pretrained(a.base), os.path.basename(os.path.normpath(a.base))
    cal = tok(package_text(20000, start=0), return_tensors="pt")["input_ids"][:, : a.calib_tokens]
    sizes, deltas = [int(x) for x in a.sizes.split(",")], [int(x) for x in a.deltas.split(",")]
    spec = calibrate_key_split(model, cal, sizes, deltas, base)
    parts = "_".join(f"{n}x{d:+d}" for n, d in zip(sizes, deltas))
    for seed in (int(s) for s in a.seeds.split(",")):
        cfg = TurboQuantConfig.from_dict({**base.to_dict(), "seed": seed, "key_split": spec,
                                          "key_centering": a.key_centering})
        name = f"{a.model}-{tag}-split{parts}{'-c' if a.key_centering else ''}-seed{seed}"
        folder = os.path.join(a.out, name)
        cfg.save_pretrained(folder, model_config=model.config)
        print(folder)
    with open(os.path.join(a.out, f"facts-{a.model}-{tag}-split{parts}.json"), "w") as f:
        json.dump({"model": model_facts(model.config), "command": "key_split_folders.py " + " ".join(
            f"{k}={v}" for k, v in vars(a).items())}, f, indent=1)


if __name__ == "__main__":
    main()
