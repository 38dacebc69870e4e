"""How many prefix tokens a PrefixStore holds per byte against the same store over full-precision caches (the issue's
"(c)": `skip_layers` = all), at the prefix lengths of the chat workload (a 2048-token system prompt, then the
system prompt and an 8k / 16k / 32k document), Llama-3.1-8B shape, bf16 K/V, k5v3.

Bytes only, no timing: each prefix is filled into both caches through their own `update` (random bf16 K/V) and
inserted alone into an empty store of each kind; the ratio is the full-precision store's bytes over the TurboQuant
store's for the same tokens. A layer's bytes do not depend on the other layers, so the study runs LAYERS of the 32
(bytes per token scale by 32 / LAYERS for the whole model; the ratio does not change). Runs on a CPU in seconds.

    python benchmarks/studies/prefix_store_bytes.py [--out benchmarks/results/prefix_store_bytes.json]
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from tq_hf_cache import TurboQuantCache  # noqa: E402
from tq_hf_cache.bench import llama_8b_config  # noqa: E402
from tq_hf_cache.prefix_store import PrefixStore  # noqa: E402

LAYERS = 2
LENGTHS = {"system prompt (2k)": 2048, "+ 8k document": 2048 + 8192, "+ 16k document": 2048 + 16384,
           "+ 32k document": 2048 + 32768}


def stored_bytes(cfg, ids: torch.Tensor, full_precision: bool) -> int:
    kw = {"skip_layers": list(range(cfg.num_hidden_layers))} if full_precision else {}
    cache = TurboQuantCache(config=cfg, **kw)
    g = torch.Generator().manual_seed(len(ids))
    for i in range(cfg.num_hidden_layers):
        k = torch.randn(1, cfg.num_key_value_heads, len(ids), cfg.head_dim, generator=g).to(torch.bfloat16)
        cache.update(k, torch.randn(k.shape, generator=g).to(torch.bfloat16), i)
    store = PrefixStore(config=cfg, page_tokens=256, cpu_bytes=1 << 34, **kw)
    store.insert(ids, cache)
    return sum(store.stats()["bytes"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    cfg = llama_8b_config(LAYERS)
    rows = []
    for label, n in LENGTHS.items():
        ids = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
        tq, fp = stored_bytes(cfg, ids, False), stored_bytes(cfg, ids, True)
        row = {"prefix": label, "tokens": n, "bytes_per_token_32_layers": {"turboquant": round(tq / n * 32 / LAYERS, 1),
               "full_precision": round(fp / n * 32 / LAYERS, 1)}, "tokens_per_byte_over_full_precision": round(fp / tq, 3)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    res = {"what": __doc__.split("\n\n")[0], "model": f"Llama-3.1-8B shape ({LAYERS} of 32 layers), bf16 K/V, k5v3",
           "command": "python benchmarks/studies/prefix_store_bytes.py --out benchmarks/results/prefix_store_bytes.json",
           "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
