"""Several users share two long system prompts through one `PrefixStore`; each user then asks a follow-up.

    python examples/prefix_store_chat.py                      # embedded SmolLM2-135M-Instruct, CPU

The app first stores its system prompts. Every request then asks the store for the longest stored prefix of its
prompt (`match`), computes only the rest, inserts what it computed (`insert`), then generates: a first turn reuses
its system prompt, a second turn the whole first one. At the end the example checks that an answer generated from a
restored prefix is, token for token, the answer of a fresh cache that computed the same prompt the same way.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from tq_hf_cache import TurboQuantCache, cache_kwargs  # noqa: E402
from tq_hf_cache.prefix.store import PrefixStore  # noqa: E402
from tq_hf_cache.tools.texts import package_text  # noqa: E402

USERS = ["What is the passage about?", "Name one keyword it explains.", "Is the passage about Python?"]
FOLLOW_UP = "Answer again in five words."


def prompt_ids(tok, system: str, turns: list[str]) -> torch.Tensor:
    messages = [{"role": "system", "content": system}] + [{"role": "user", "content": t} for t in turns]
    return tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]


def serve(model, store: PrefixStore, ids: torch.Tensor, new_tokens: int):
    """One request: restore the longest stored prefix, compute the rest of the prompt but its last token, store
    that, generate. Returns (answer ids, tokens reused, seconds to the first new token)."""
    t = time.perf_counter()
    cache, n = store.match(ids)
    with torch.no_grad():
        if ids.shape[1] - 1 > n:
            model(ids[:, n:-1], **cache_kwargs(model, cache))
        store.insert(ids[:, :-1], cache)
        first = model.generate(ids, **cache_kwargs(model, cache), max_new_tokens=1, do_sample=False)
        ttft = time.perf_counter() - t
        out = model.generate(first, **cache_kwargs(model, cache), max_new_tokens=new_tokens - 1, do_sample=False,
                             attention_mask=torch.ones_like(first))
    return out[0, ids.shape[1]:], n, ttft


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context-chars", type=int, default=2500, help="characters of package text per system prompt")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--users", type=int, default=3, choices=range(1, len(USERS) + 1))
    p.add_argument("--page-tokens", type=int, default=64)
    args = p.parse_args(argv)

    from tq_hf_cache.tools.models import load_smollm2

    model, tok = load_smollm2()
    store = PrefixStore(config=model.config, page_tokens=args.page_tokens, cpu_bytes=256 << 20, model=model)
    systems = [f"Answer from this passage.\n\n{package_text(args.context_chars, start=s)}" for s in (0, 500)]
    system_ids = []
    for system in systems:  # the app stores its system prompts once (their templated tokens begin every prompt)
        ids = tok.apply_chat_template([{"role": "system", "content": system}], return_tensors="pt",
                                      return_dict=True)["input_ids"]
        system_ids.append(ids)
        cache = TurboQuantCache(config=model.config)
        with torch.no_grad():
            model(ids, **cache_kwargs(model, cache))
        store.insert(ids, cache)
    answers = {}
    for turn in range(2):
        for s, system in enumerate(systems):
            for u, question in enumerate(USERS[: args.users]):
                turns = [question] if turn == 0 else [question, FOLLOW_UP]
                ids = prompt_ids(tok, system, turns)
                if turn == 1:  # the conversation so far: the first answer sits between the two questions
                    first = tok.decode(answers[(s, u)], skip_special_tokens=True)
                    msgs = [{"role": "system", "content": system}, {"role": "user", "content": question},
                            {"role": "assistant", "content": first}, {"role": "user", "content": FOLLOW_UP}]
                    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt",
                                                  return_dict=True)["input_ids"]
                out, n, ttft = serve(model, store, ids, args.new_tokens)
                answers[(s, u)] = out
                print(f"[system {s}, user {u}, turn {turn + 1}] {ids.shape[1]} prompt tokens, {n} reused, first "
                      f"token after {ttft:.2f} s: {tok.decode(out, skip_special_tokens=True)!r}")
    st = store.stats()
    print(f"store: {st['hits']} of {st['lookups']} requests reused a prefix, {st['tokens_reused']} tokens in all; "
          f"{st['pages'][0]} pages and {st['bytes'][0] / 2**20:.2f} MiB held")

    # the same request served without the store, computed as the store's was: the system prompt, then the rest of
    # the prompt but its last token (TurboQuant's K/V of a later chunk depend on where the chunks begin: that chunk
    # attends to the quantized history)
    ids = prompt_ids(tok, systems[0], [USERS[0]])
    with torch.no_grad():
        cache = TurboQuantCache(config=model.config)
        k = system_ids[0].shape[1]
        model(ids[:, :k], **cache_kwargs(model, cache))
        model(ids[:, k:-1], **cache_kwargs(model, cache))
        fresh = model.generate(ids, **cache_kwargs(model, cache), max_new_tokens=args.new_tokens,
                               do_sample=False)[0, ids.shape[1]:]
        cache, n = store.match(ids)
        restored = model.generate(ids, **cache_kwargs(model, cache), max_new_tokens=args.new_tokens,
                                  do_sample=False)[0, ids.shape[1]:]
    same = n > 0 and torch.equal(fresh, restored)
    print(f"a restored prefix ({n} tokens) gives {'the same answer as' if same else 'ANOTHER answer than'} a fresh "
          "cache that computed the prompt")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
