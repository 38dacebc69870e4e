"""Write cache folders for the key-centring evaluation: each allocation folder (and k4v2) with `key_centering` on,
once per rotation seed, so that `tq-hf-cache eval --caches` runs them like any saved config.

Usage: python benchmarks/studies/centred_folders.py --out /tmp/calloc   (then the eval commands in docs/quality.md)
"""

from __future__ import annotations

import argparse
import json
import os

ALLOCATIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "results", "allocations")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seeds", default="0,1,2,3")
    ap.add_argument("--folders", default="gemma3-270m-2,gemma3-270m-2.5,gemma3-270m-3.0625,smollm2-2.5,smollm2-3.25")
    a = ap.parse_args()
    docs = {name: json.load(open(os.path.join(ALLOCATIONS, name, "turboquant_config.json"))) for name in a.folders.split(",")}
    if "gemma3-270m-2" in docs:  # Gemma 3's k4v2: the same config without the per-layer widths
        k4v2 = json.loads(json.dumps(docs["gemma3-270m-2"]))
        k4v2.pop("bit_allocation", None)
        k4v2["tq_config"].update(layer_bits={}, key_bits=4, value_bits=2)
        docs["gemma3-270m-k4v2"] = k4v2
    for name, doc in docs.items():
        for seed in (int(s) for s in a.seeds.split(",")):
            d = json.loads(json.dumps(doc))
            d["tq_config"].update(seed=seed, key_centering=True)
            folder = os.path.join(a.out, f"{name}-seed{seed}-c")
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, "turboquant_config.json"), "w") as f:
                json.dump(d, f, indent=1)
            print(folder)


if __name__ == "__main__":
    main()
