"""Reusing a saved prompt prefix: bytes on disk and time to first token, TurboQuantCache against DynamicCache.

For each prefix length: the prefix is prefilled once into each cache and saved (TurboQuantCache.save_prefix; the
DynamicCache's keys and values with safetensors, the same way). Then a request of prefix + question is answered
three ways, each timed to its first generated token (median of --repeats, after a warm-up):
  cold      no cache: prefill prefix + question;
  disk      TurboQuantCache.load_prefix from disk (DynamicCache: safetensors load), then prefill the question;
  memory    copy.deepcopy of the filled cache, then prefill the question.
The first token of every reuse path must equal the cold path's (checked). Writes JSON and a PNG.

    python benchmarks/bench_prefix.py --out benchmarks/results                       # CPU, embedded SmolLM2
    python benchmarks/bench_prefix.py --model llama8b-random --device cuda --lengths 4096,32768 --out DIR
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time

import torch
from transformers import DynamicCache

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir))
from tq_hf_cache import TurboQuantCache, cache_kwargs  # noqa: E402


def load_model(name: str, device: str, dtype: torch.dtype):
    if name == "smollm2":
        from tq_hf_cache.tools.models import load_smollm2

        model, _ = load_smollm2(dtype)
        return model.to(device)
    if name == "llama8b-random":  # the Llama-3.1-8B shape with random weights: timing only
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                          num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0)
        with torch.device(device):
            model = LlamaForCausalLM(cfg).to(dtype)
        return model.eval()
    raise SystemExit(f"unknown model {name!r}")


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def save_dynamic(cache: DynamicCache, path: str) -> None:
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    t = {}
    for i, layer in enumerate(cache.layers):
        t[f"layers.{i}.keys"], t[f"layers.{i}.values"] = layer.keys.cpu().contiguous(), layer.values.cpu().contiguous()
    save_file(t, os.path.join(path, "dynamic_prefix.safetensors"))


def load_dynamic(path: str, config, device) -> DynamicCache:
    from safetensors.torch import load_file

    t = load_file(os.path.join(path, "dynamic_prefix.safetensors"), device=device)
    cache = DynamicCache(config=config)
    for i in range(len(t) // 2):
        cache.update(t[f"layers.{i}.keys"], t[f"layers.{i}.values"], i)
    return cache


@torch.no_grad()
def first_token(model, ids, cache, start):
    """Prefill ids[:, start:] on `cache` (which holds ids[:, :start]); returns the greedy first token."""
    return model(ids[:, start:], **cache_kwargs(model, cache), logits_to_keep=1).logits[:, -1].argmax(-1)


@torch.no_grad()
def run(args):
    dtype = getattr(torch, args.dtype)
    model = load_model(args.model, args.device, dtype)
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    rows = []
    for n in args.lengths:
        prefix = torch.randint(10, cfg.vocab_size, (1, n), generator=g).to(args.device)
        question = torch.randint(10, cfg.vocab_size, (1, args.question), generator=g).to(args.device)
        ids = torch.cat([prefix, question], dim=1)
        row = {"prefix_tokens": n, "question_tokens": args.question}
        for kind in ("DynamicCache", "TurboQuantCache"):
            make = (lambda: DynamicCache(config=cfg)) if kind == "DynamicCache" else (lambda: TurboQuantCache(config=cfg))
            filled = make()
            model(prefix, **cache_kwargs(model, filled), logits_to_keep=1)
            folder = tempfile.mkdtemp(prefix="tq_prefix_")
            if kind == "DynamicCache":
                save_dynamic(filled, folder)
                load = lambda: load_dynamic(folder, cfg, args.device)  # noqa: E731
            else:
                filled.save_prefix(folder, prefix, model=model)
                load = lambda: TurboQuantCache.load_prefix(folder, cfg, token_ids=ids, device=args.device,  # noqa: E731
                                                           model=model)
            paths = {
                "cold": lambda: first_token(model, ids, make(), 0),
                "disk": lambda: first_token(model, ids, load(), n),
                "memory": lambda: first_token(model, ids, copy.deepcopy(filled), n),
            }
            want = None
            res = {"disk_bytes": dir_bytes(folder)}
            for name, fn in paths.items():
                fn()  # warm-up
                times = []
                for _ in range(args.repeats):
                    sync(args.device)
                    t0 = time.perf_counter()
                    tok = fn()
                    sync(args.device)
                    times.append(time.perf_counter() - t0)
                if want is None:
                    want = tok
                res[f"ttft_{name}_s"] = statistics.median(times)
                res[f"{name}_first_token_matches_cold"] = bool(torch.equal(tok, want))
            row[kind] = res
            print(json.dumps({"prefix_tokens": n, kind: res}), flush=True)
        d, t = row["DynamicCache"], row["TurboQuantCache"]
        row["disk_ratio"] = d["disk_bytes"] / t["disk_bytes"]
        row["ttft_saved_by_disk_reuse"] = t["ttft_cold_s"] - t["ttft_disk_s"]
        rows.append(row)
    return {
        "model": args.model, "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "dtype": args.dtype, "torch": torch.__version__, "repeats": args.repeats, "rows": rows,
        "command": "python benchmarks/bench_prefix.py " + " ".join(sys.argv[1:]),
    }


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [f"{r['prefix_tokens']} tok" for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    x = range(len(rows))
    for off, kind in ((-0.2, "DynamicCache"), (0.2, "TurboQuantCache")):
        a.bar([i + off for i in x], [r[kind]["disk_bytes"] / 2**20 for r in rows], width=0.4, label=kind)
    a.set_xticks(list(x), labels)
    a.set_ylabel("prefix on disk (MiB)")
    a.legend()
    paths = ["cold", "disk", "memory"]
    for j, kind in enumerate(("DynamicCache", "TurboQuantCache")):
        for k, p in enumerate(paths):
            pos = [i + (j * 3 + k - 2.5) * 0.13 for i in x]
            b.bar(pos, [r[kind][f"ttft_{p}_s"] for r in rows], width=0.13, label=f"{kind} {p}")
    b.set_xticks(list(x), labels)
    b.set_ylabel("time to first token (s)")
    b.legend(fontsize=7)
    fig.suptitle(f"prefix reuse, {result['model']} on {result['device']} ({result['dtype']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", choices=["smollm2", "llama8b-random"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 4096])
    p.add_argument("--question", type=int, default=32, help="tokens after the prefix")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=".", help="folder for bench_prefix_<device>.json/.png")
    args = p.parse_args(argv)
    result = run(args)
    os.makedirs(args.out, exist_ok=True)
    tag = "cpu" if args.device == "cpu" else "h100" if "H100" in result["device"] else args.device.replace(":", "")
    base = os.path.join(args.out, f"bench_prefix_{tag}")
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=1)
    plot(result, base + ".png")
    print(f"wrote {base}.json and .png")


if __name__ == "__main__":
    main()
