"""The compiled fast path: `generate()` with TurboQuantStaticCache against transformers' StaticCache, with timings.

    python examples/compiled_generate.py                       # embedded SmolLM2-135M; CUDA when available
    python examples/compiled_generate.py --context-chars 20000 --new-tokens 128

On CUDA, `generate()` compiles the decode step of a static cache (torch.compile, CUDA graphs) on its first call; the
second call replays it. Both calls are timed, per cache, and both answers are printed. The compiled path is for CUDA:
on a CPU nothing is compiled (transformers compiles on CUDA only): TurboQuantStaticCache's decode steps read the
positions it holds through the C decode kernels, but its eager steps and prefill cost more than StaticCache's, so it
runs slower there; on a CPU use TurboQuantCache (examples/generate_demo.py). Needs transformers >= 5.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

from tq_hf_cache import TurboQuantStaticCache, cache_kwargs  # noqa: E402
from tq_hf_cache.tools.bench import cache_bytes  # noqa: E402
from tq_hf_cache.tools.texts import package_text  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context-chars", type=int, default=8000, help="characters of package text in the prompt")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--calls", type=int, default=2, help="generate calls per cache (the first one compiles)")
    args = p.parse_args(argv)

    from tq_hf_cache.tools.models import load_smollm2

    cuda = torch.cuda.is_available()
    model, tok = load_smollm2(torch.bfloat16 if cuda else torch.float32)
    model.to("cuda" if cuda else "cpu")
    text = package_text(args.context_chars) + "\n\nSummarize the passage above in one sentence."
    ids = tok(text, return_tensors="pt").input_ids[:, : model.config.max_position_embeddings - args.new_tokens - 8]
    ids = ids.to(model.device)
    capacity = ids.shape[1] + args.new_tokens + 8
    print(f"prompt {ids.shape[1]} tokens, {args.new_tokens} new tokens, on {model.device} "
          f"({'generate compiles the decode step' if cuda else 'no compilation on CPU'})")
    if not cuda:
        print("on a CPU expect TurboQuantStaticCache to be slower than StaticCache: the compiled path is for CUDA; "
              "TurboQuantCache is the CPU cache (examples/generate_demo.py)")
    tokens = {}
    for name, make, attn in (
        ("StaticCache", lambda: transformers.StaticCache(config=model.config, max_cache_len=capacity), "sdpa"),
        ("TurboQuantStaticCache", lambda: TurboQuantStaticCache(model.config, max_cache_len=capacity), "turboquant"),
    ):
        model.set_attn_implementation(attn)  # "turboquant": the fused kernel reads the packed K/V
        for call in range(args.calls):
            cache = make()
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **cache_kwargs(model, cache),
                                 max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
            if cuda:
                torch.cuda.synchronize()
            dt = time.perf_counter() - t
            print(f"[{name}, call {call + 1}] {dt:.2f} s ({1e3 * dt / args.new_tokens:.1f} ms per new token, prefill "
                  f"included), cache {cache_bytes(cache) / 2**20:.1f} MiB")
        tokens[name] = out[0, ids.shape[1]:]
    a, b = tokens["StaticCache"], tokens["TurboQuantStaticCache"]
    same = (a == b).float().mean().item()
    first = next((i for i in range(len(a)) if a[i] != b[i]), None)
    print(f"the two answers share {100 * same:.0f}% of their tokens position by position"
          + ("" if first is None else f" (identical for the first {first}, then greedy decoding follows its own words)"))
    for name, toks in tokens.items():
        print(f"  [{name}] " + tok.decode(toks, skip_special_tokens=True).strip()[:400].replace("\n", " "))
    return 0


if __name__ == "__main__":
    sys.exit(main())
