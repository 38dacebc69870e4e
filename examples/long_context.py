"""The longest prompt the model takes, with a needle in it: the KV memory of DynamicCache and TurboQuantCache and
each one's answer.

    python examples/long_context.py                    # embedded SmolLM2-135M-Instruct: 8192 positions, ~1 min on CPU
    python examples/long_context.py --tokens 4000 --depth 0.25 --preset k4v2

The prompt is package-shipped prose (Python's help topics) with one sentence holding a 5-digit code at --depth of
the prompt, and the question asks for the code. Both caches prefill the prompt in 512-token chunks (as serving
stacks do; one big chunk would hold a whole-prompt attention matrix) and answer greedily. At 8k tokens the 135M
model itself (full precision) finds a needle near the end of the prompt but not one at 0.1 or 0.5 of it
(docs/quality.md), so the default depth is 0.9.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from tq_hf_cache import DEFAULT_PRESET, PRESETS, TurboQuantCache  # noqa: E402
from tq_hf_cache.tools.eval.tasks import build_needle_prompt, chunked_prefill, greedy_decode  # noqa: E402
from tq_hf_cache.tools.texts import HELD_OUT_START, paragraphs  # noqa: E402

CODE = "48213"


def kv_bytes(cache) -> int:
    if isinstance(cache, TurboQuantCache):
        held = cache.nbytes()
        return held["total"] - held["workspace"]
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default=DEFAULT_PRESET, choices=sorted(PRESETS))
    p.add_argument("--tokens", type=int, default=None, help="prompt length (default: the model's longest, minus room "
                                                            "for the answer)")
    p.add_argument("--depth", type=float, default=0.9, help="where the needle sits, 0 (start) .. 1 (end)")
    p.add_argument("--new-tokens", type=int, default=10)
    args = p.parse_args(argv)
    if not 0.0 <= args.depth <= 1.0:
        p.error(f"--depth must be in [0, 1], got {args.depth}")

    from tq_hf_cache.tools.models import load_smollm2

    model, tok = load_smollm2()
    longest = model.config.max_position_embeddings
    tokens = args.tokens or longest - args.new_tokens - 64
    if not 64 <= tokens <= longest - args.new_tokens:
        p.error(f"--tokens must be in [64, {longest - args.new_tokens}] for this model, got {tokens}")
    text = paragraphs()[HELD_OUT_START:]
    target = tokens
    for _ in range(4):  # the builder cuts at paragraph ends, so ask for less until the prompt fits
        ids, needle_at = build_needle_prompt(tok, text, target, args.depth, CODE)
        if ids.shape[1] <= tokens:
            break
        target -= ids.shape[1] - tokens
    else:
        raise SystemExit(f"could not build a prompt of at most {tokens} tokens")
    print(f"prompt: {ids.shape[1]} tokens (the model takes {longest} positions), needle at token {needle_at}")

    eos = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    memory = {}
    for name, cache in (("DynamicCache", DynamicCache()), (f"TurboQuantCache({args.preset})",
                                                           TurboQuantCache(args.preset, config=model.config))):
        t0 = time.time()
        with torch.inference_mode():
            first = chunked_prefill(model, ids, cache, 512)
            answer_ids = greedy_decode(model, cache, first, args.new_tokens, eos_token_id=eos)
        answer = tok.decode(answer_ids, skip_special_tokens=True).strip()
        memory[name] = kv_bytes(cache)
        found = re.sub(r"\D", "", answer).startswith(CODE)
        print(f"\n[{name}] {time.time() - t0:.1f} s, KV cache {memory[name] / 2**20:.1f} MiB "
              f"({memory[name] / cache.get_seq_length():.0f} bytes/token)")
        print(f"  answer: {answer!r} -> the code {CODE} is {'found' if found else 'NOT found'}")
    dyn, tq = memory.values()
    dyn16 = dyn * 2 / torch.tensor([], dtype=model.dtype).element_size()
    print(f"\nmemory: {dyn / tq:.2f}x less with TurboQuantCache than DynamicCache in {model.dtype} ({dyn16 / tq:.2f}x "
          "against a 16-bit DynamicCache): in the same memory it holds a context that much longer, where the "
          "model's positions allow it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
