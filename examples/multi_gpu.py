"""TurboQuant caches on a model spread over several devices: `device_map="auto"` (layers split over GPUs) and tensor
parallel (`tp_plan="auto"`, KV heads split over ranks), each compared with the same model on one device.

    python examples/multi_gpu.py                                 # device_map="auto" on the embedded SmolLM2
    python examples/multi_gpu.py --save-random DIR --layers 32   # a random Llama-3.1-8B-shaped checkpoint
    python examples/multi_gpu.py --model DIR --mode single --json one.json          # reference: one device
    torchrun --nproc-per-node 2 examples/multi_gpu.py --model DIR --mode tp --json tp.json --compare one.json

Every mode generates greedily with DynamicCache, TurboQuantCache (sdpa and the turboquant attention) and, on
transformers >= 5, TurboQuantStaticCache, and prints the tokens' agreement with DynamicCache's. `--compare` checks
each cache's tokens against the same cache's tokens of another run (e.g. one GPU). Under tensor parallel each rank
holds its share of the KV heads: its cache layers, packed buffers and workspace are that rank's alone. On a
machine without GPUs every mode runs on the CPU (tensor parallel over gloo).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

import tq_hf_cache.hf.distributed  # noqa: E402
from tq_hf_cache import TurboQuantCache, cache_kwargs  # noqa: E402
from tq_hf_cache._compat import IS_V5  # noqa: E402


def save_random(folder: str, layers: int, dtype: torch.dtype) -> None:
    """A Llama-3.1-8B-shaped checkpoint with random weights (16 GB in bf16 at 32 layers)."""
    from tq_hf_cache.tools.bench import random_llama_8b

    model = random_llama_8b(layers, "cuda" if torch.cuda.is_available() else "cpu", dtype,
                            max_position_embeddings=16384)
    sharpen(model)
    model.save_pretrained(folder)
    print(f"saved a random {layers}-layer Llama-3.1-8B-shaped model to {folder}")


def sharpen(model, factor: float = 30.0) -> None:
    """Scale the output head of a random model: its logits are nearly flat, so rounding alone (another matmul
    shape, another reduction order under tensor parallel) changes its greedy tokens. The layers stay as they are."""
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(factor)


def load(args, rank_device):
    kw = {"dtype": getattr(torch, args.dtype)}
    if args.model == "smollm2":
        from tq_hf_cache.tools.models import SMOLLM2_GGUF, smollm2_path

        folder, kw["gguf_file"] = smollm2_path(), SMOLLM2_GGUF
    else:
        folder = args.model
    if args.mode == "tp":
        kw["tp_plan"] = "auto"
    elif args.mode == "device_map":
        kw["device_map"] = "auto"
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, **kw).eval()
    if args.mode == "single":
        model.to(rank_device)
    return model


def caches(model, capacity: int):
    yield "DynamicCache", "sdpa", transformers.DynamicCache(config=model.config)
    yield "TurboQuantCache", "sdpa", TurboQuantCache(config=model.config)
    yield "TurboQuantCache", "turboquant", TurboQuantCache(config=model.config)
    if IS_V5:
        from tq_hf_cache import TurboQuantStaticCache

        # generate() compiles the step of a static cache on CUDA: StaticCache shows what compilation alone changes
        yield "StaticCache", "sdpa", transformers.StaticCache(config=model.config, max_cache_len=capacity)
        yield "TurboQuantStaticCache", "turboquant", TurboQuantStaticCache(model.config, max_cache_len=capacity)


def teacher_forced(model, ids, tokens, cache) -> float:
    """Feed `tokens` (another run's greedy answer) one at a time; the fraction of steps where this model's argmax is
    that run's token. Unlike free-running generation, one near-tie does not make every later token differ."""
    eos = model.generation_config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    same = 0
    with torch.no_grad():
        logits = model(ids, **cache_kwargs(model, cache)).logits[:, -1]
        for t in tokens:
            logits[:, eos] = float("-inf")  # as generate's min_new_tokens does
            same += int(logits.argmax(-1)) == t
            logits = model(torch.tensor([[t]], device=ids.device), **cache_kwargs(model, cache)).logits[:, -1]
    return same / len(tokens)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="checkpoint folder, or 'smollm2' (embedded)")
    p.add_argument("--mode", choices=("device_map", "tp", "single"), default="device_map")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens (random ids, fixed seed)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--json", help="write the tokens and timings here (rank 0)")
    p.add_argument("--disable-compile", action="store_true", help="static caches decode eagerly (no auto-compile)")
    p.add_argument("--compare", help="a JSON of another run: check every cache's tokens against it")
    p.add_argument("--save-random", metavar="DIR", help="only save a random Llama-3.1-8B-shaped checkpoint to DIR")
    p.add_argument("--layers", type=int, default=32, help="layers of --save-random")
    args = p.parse_args(argv)
    if args.save_random:
        save_random(args.save_random, args.layers, getattr(torch, args.dtype))
        return 0

    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    t0 = time.time()
    model = load(args, device)
    say = print if rank == 0 else (lambda *a, **k: None)
    placement = sorted({str(p.device) for p in model.parameters()})
    say(f"mode {args.mode}: loaded in {time.time() - t0:.1f} s; parameters on {placement}; "
        f"world size {int(os.environ.get('WORLD_SIZE', '1'))}")
    first = next(model.parameters()).device
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, args.context), generator=g).to(first)
    result = {"mode": args.mode, "model": args.model, "dtype": args.dtype, "context": args.context,
              "disable_compile": args.disable_compile,
              "transformers": transformers.__version__, "torch": torch.__version__,
              "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] or ["cpu"],
              "runs": []}
    for name, attn, cache in caches(model, args.context + args.new_tokens + 8):
        model.set_attn_implementation(attn)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t = time.time()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **cache_kwargs(model, cache),
                                 max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0,
                                 disable_compile=args.disable_compile)
        if cuda:
            torch.cuda.synchronize()
        run = {"cache": name, "attn": attn, "seconds": round(time.time() - t, 2),
               "tokens": out[0, args.context:].tolist()}
        if hasattr(cache, "nbytes"):
            run["cache_MiB_this_rank"] = round(cache.nbytes()["total"] / 2**20, 2)
            layer = next((lay for lay in cache.layers if getattr(lay, "keys", None) is not None), None)
            run["kv_heads_per_layer_here"] = None if layer is None else int(layer.keys.shape[1])
        if cuda:
            run["peak_GiB_this_rank"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        result["runs"].append(run)
    base = result["runs"][0]["tokens"]
    for run in result["runs"]:
        run["agree_with_DynamicCache"] = round(sum(a == b for a, b in zip(run["tokens"], base)) / len(base), 3)
        say(f"  {run['cache']:<22} {run['attn']:<10} {run['seconds']:>6.2f} s   agrees with DynamicCache on "
            f"{100 * run['agree_with_DynamicCache']:.0f}% of {len(base)} tokens"
            + (f"; {run['cache_MiB_this_rank']} MiB, {run['kv_heads_per_layer_here']} KV heads per layer on this rank"
               if "cache_MiB_this_rank" in run else ""))
    ok = True
    if args.compare:
        with open(args.compare) as f:
            other = {(r["cache"], r["attn"]): r["tokens"] for r in json.load(f)["runs"]}
        result["compare"] = {}
        for (name, attn, cache), run in zip(caches(model, args.context + args.new_tokens + 8), result["runs"]):
            want = other.get((name, attn))
            if want is None:
                continue
            model.set_attn_implementation(attn)
            forced = teacher_forced(model, ids, want, cache)
            same = want == run["tokens"]
            result["compare"][f"{name}/{attn}"] = {"same_tokens": same, "teacher_forced_top1": round(forced, 3)}
            ok &= same
            say(f"  {name}/{attn}: {'the same tokens as' if same else 'DIFFERENT tokens from'} {args.compare}; "
                f"fed its tokens, this run's top-1 agrees at {100 * forced:.0f}% of the steps")
    if args.json and rank == 0:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        code = main()
    finally:  # tensor parallel: free the compiled steps' CUDA graphs, then the process group (else no rank exits)
        tq_hf_cache.hf.distributed.shutdown()
    sys.exit(code)
