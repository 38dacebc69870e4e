"""A multi-turn chat through `pipeline("text-generation")`, reusing one TurboQuantCache across the turns.

    python examples/pipeline_chat.py                         # embedded SmolLM2-135M-Instruct, CPU
    python examples/pipeline_chat.py --preset k4v2 --new-tokens 64

Each turn hands the pipeline the whole conversation and the same cache: `generate` then prefills only the tokens
the cache does not hold yet (the new user message), not the whole history. A cache is only valid for a prompt
that starts with exactly the tokens it holds, so before each turn the example compares the templated conversation
with the tokens in the cache and crops the cache back to their common prefix where they differ (a chat template
may re-tokenize the previous answer differently from how it was generated).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import pipeline  # noqa: E402

from tq_hf_cache import DEFAULT_PRESET, PRESETS, TurboQuantCache, cache_kwargs  # noqa: E402
from tq_hf_cache.tools.texts import package_text  # noqa: E402

QUESTIONS = [
    "Summarize the passage above in one sentence.",
    "Which keyword does the passage explain?",
    "Give a one-line code example of it.",
]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default=DEFAULT_PRESET, choices=sorted(PRESETS))
    p.add_argument("--context-chars", type=int, default=3000, help="characters of package text in the first message")
    p.add_argument("--new-tokens", type=int, default=160, help="the most tokens an answer may take")
    p.add_argument("--turns", type=int, default=3, choices=range(1, len(QUESTIONS) + 1))
    args = p.parse_args(argv)

    from tq_hf_cache.tools.models import load_smollm2

    model, tok = load_smollm2()
    chat = pipeline("text-generation", model=model, tokenizer=tok)
    cache = TurboQuantCache(args.preset, config=model.config)
    cached_ids: list[int] = []  # the tokens the cache holds, in order
    messages = [{"role": "system", "content": "You answer briefly."}]
    for turn, question in enumerate(QUESTIONS[: args.turns]):
        content = f"{package_text(args.context_chars)}\n\n{question}" if turn == 0 else question
        messages.append({"role": "user", "content": content})
        prompt_ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
        keep = common_prefix(cached_ids, prompt_ids)
        if keep < len(cached_ids):  # the template re-tokenized part of the history: drop what no longer matches
            cache.crop(keep - len(cached_ids))
            cached_ids = cached_ids[:keep]
        t0 = time.time()
        full = chat(messages, **cache_kwargs(chat.model, cache), max_new_tokens=args.new_tokens, do_sample=False,
                    return_tensors=True, pad_token_id=tok.eos_token_id)[0]["generated_token_ids"]
        seconds = time.time() - t0
        if list(full[: len(prompt_ids)]) != list(prompt_ids):
            raise RuntimeError("the pipeline tokenized the conversation differently from apply_chat_template")
        new_ids = list(full[len(prompt_ids):])
        reply = tok.decode(new_ids, skip_special_tokens=True).strip()
        cut = len(new_ids) >= args.new_tokens and tok.eos_token_id not in new_ids
        # generate fed the prompt and every generated token but the last one into the cache
        cached_ids = (list(prompt_ids) + list(new_ids))[: cache.get_seq_length()]
        messages.append({"role": "assistant", "content": reply})
        held = cache.nbytes()
        print(f"\n[turn {turn + 1}] {len(prompt_ids)} prompt tokens, {len(prompt_ids) - keep} prefilled this turn, "
              f"{seconds:.1f} s; cache holds {cache.get_seq_length()} tokens in "
              f"{(held['total'] - held['workspace']) / 2**20:.2f} MiB")
        print(f"user: {question}")
        print(f"assistant: {reply}" + (f" [... stopped at --new-tokens {args.new_tokens}]" if cut else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
