"""A chat workload served four ways, timed to the first token: users share system prompts, each brings a document,
and asks over several turns.

- none: every request prefills its whole prompt into a new TurboQuantCache;
- deepcopy: transformers' recipe: one DynamicCache per system prompt, prefilled once, `copy.deepcopy` per request;
- store: a `PrefixStore` warmed with the system prompts; each request restores its longest stored prefix (its system
  prompt, or its own previous turn), computes the rest and inserts it;
- store_fp: the same store over caches that keep every layer in full precision (`skip_layers` = all): what a store of
  unquantized K/V holds in the same bytes.

Reports the time to first token (median, p90) per mode, whether each mode's first token is the one `none` computed,
the store's hit rate and tokens reused, and the bytes a stored token takes in `store` against `store_fp` (the system
prompts alone, inserted once into each). Writes bench_prefix_store.json and .png into --out.

    python benchmarks/bench_prefix_store.py --out benchmarks/results        # embedded SmolLM2, CPU
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from transformers import DynamicCache  # noqa: E402

from tq_hf_cache import TurboQuantCache, cache_kwargs  # noqa: E402
from tq_hf_cache.prefix_store import PrefixStore  # noqa: E402
from tq_hf_cache.texts import package_text  # noqa: E402

QUESTIONS = ["What is this document about?", "Name one term it defines.", "Summarize it in five words."]


def template(tok, system: str, turns: list[tuple[str, str | None]]) -> torch.Tensor:
    msgs = [{"role": "system", "content": system}]
    for question, answer in turns:
        msgs.append({"role": "user", "content": question})
        if answer is not None:
            msgs.append({"role": "assistant", "content": answer})
    return tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]


def first_token(model, cache, ids) -> int:
    with torch.no_grad():
        out = model.generate(ids, **cache_kwargs(model, cache), max_new_tokens=1, do_sample=False,
                             attention_mask=torch.ones_like(ids))
    return int(out[0, -1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--users", type=int, default=6)
    p.add_argument("--prompts", type=int, default=2, help="shared system prompts")
    p.add_argument("--prompt-chars", type=int, default=3000)
    p.add_argument("--doc-chars", type=int, default=1200)
    p.add_argument("--turns", type=int, default=3, choices=range(1, len(QUESTIONS) + 1))
    p.add_argument("--page-tokens", type=int, default=64)
    p.add_argument("--out", default=".")
    a = p.parse_args(argv)

    from tq_hf_cache.models import load_smollm2

    model, tok = load_smollm2()
    cfg = model.config
    systems = [f"You answer from the manual below.\n\n{package_text(a.prompt_chars, start=200 * s)}"
               for s in range(a.prompts)]
    docs = [package_text(a.doc_chars, start=600 + 20 * u) for u in range(a.users)]
    system_ids = [tok.apply_chat_template([{"role": "system", "content": s}], return_tensors="pt",
                                          return_dict=True)["input_ids"] for s in systems]
    all_layers = list(range(cfg.num_hidden_layers))
    stores = {"store": PrefixStore(config=cfg, page_tokens=a.page_tokens, cpu_bytes=1 << 33, model=model),
              "store_fp": PrefixStore(config=cfg, page_tokens=a.page_tokens, cpu_bytes=1 << 33, model=model,
                                      skip_layers=all_layers)}
    base = {}
    for name, store in stores.items():
        kw = {"skip_layers": all_layers} if name == "store_fp" else {}
        for ids in system_ids:
            cache = TurboQuantCache(config=cfg, **kw)
            with torch.no_grad():
                model(ids, **cache_kwargs(model, cache))
            store.insert(ids, cache)
    # the same prefixes (the system prompts, nothing shared between them) in both stores: bytes per stored token
    warm_bytes = {name: sum(store.stats()["bytes"]) for name, store in stores.items()}
    warm_tokens = sum(int(ids.shape[1]) for ids in system_ids)
    for s, ids in enumerate(system_ids):
        cache = DynamicCache(config=cfg)
        with torch.no_grad():
            model(ids, **cache_kwargs(model, cache))
        base[s] = cache

    ttft = {m: [] for m in ("none", "deepcopy", "store", "store_fp")}
    agree = {m: 0 for m in ttft}
    history: dict[int, list] = {u: [] for u in range(a.users)}
    for turn in range(a.turns):
        for u in range(a.users):
            s = u % a.prompts
            turns = history[u] + [(f"{docs[u]}\n\n{QUESTIONS[turn]}" if turn == 0 else QUESTIONS[turn], None)]
            ids = template(tok, systems[s], turns)
            got = {}
            for mode in ttft:  # the modes in turns, request by request: drift on the host hits them alike
                t = time.perf_counter()
                if mode == "none":
                    got[mode] = first_token(model, TurboQuantCache(config=cfg), ids)
                elif mode == "deepcopy":
                    got[mode] = first_token(model, copy.deepcopy(base[s]), ids)
                else:
                    store = stores[mode]
                    cache, n = store.match(ids)
                    with torch.no_grad():
                        if ids.shape[1] - 1 > n:
                            model(ids[:, n:-1], **cache_kwargs(model, cache))
                    store.insert(ids[:, :-1], cache)
                    got[mode] = first_token(model, cache, ids)
                ttft[mode].append(time.perf_counter() - t)
            for mode in ttft:
                agree[mode] += got[mode] == got["none"]
            answer = tok.decode([got["none"]], skip_special_tokens=True)
            history[u] = turns[:-1] + [(turns[-1][0], answer)]

    def pct(v, q):
        v = sorted(v)
        return v[min(len(v) - 1, int(q * len(v)))]

    res = {"model": "SmolLM2-135M-Instruct (fp32, CPU)", "threads": torch.get_num_threads(), "users": a.users,
           "prompts": a.prompts, "turns": a.turns, "page_tokens": a.page_tokens, "requests": a.users * a.turns,
           "ttft_s": {m: {"median": round(statistics.median(v), 4), "p90": round(pct(v, 0.9), 4),
                          "all": [round(x, 4) for x in v]} for m, v in ttft.items()},
           "first_token_same_as_none": agree, "stores": {}}
    for name, store in stores.items():
        st = store.stats()
        held = sum(st["bytes"])
        res["stores"][name] = {**{k: st[k] for k in ("lookups", "hits", "tokens_reused", "pages", "bytes")},
                               "hit_rate": round(st["hits"] / max(st["lookups"], 1), 3)}
        res["stores"][name]["bytes_held"] = held
    res["system_prompt_tokens"] = warm_tokens
    res["bytes_per_stored_token"] = {k: round(v / warm_tokens, 1) for k, v in warm_bytes.items()}
    res["tokens_per_gib_store_over_store_fp"] = round(warm_bytes["store_fp"] / warm_bytes["store"], 2)
    res["none_over_store_median"] = round(res["ttft_s"]["none"]["median"] / res["ttft_s"]["store"]["median"], 2)
    print(json.dumps({k: v for k, v in res.items() if k != "ttft_s"} | {
        "ttft_median": {m: v["median"] for m, v in res["ttft_s"].items()}}, indent=1))
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "bench_prefix_store.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    plot(res, path[:-5] + ".png")
    return 0


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(res["ttft_s"])
    fig, ax = plt.subplots(figsize=(6, 3.2))
    med = [res["ttft_s"][m]["median"] for m in modes]
    p90 = [res["ttft_s"][m]["p90"] for m in modes]
    x = range(len(modes))
    ax.bar([i - 0.2 for i in x], med, 0.4, label="median")
    ax.bar([i + 0.2 for i in x], p90, 0.4, label="p90")
    ax.set_xticks(list(x), ["no reuse", "deepcopy\n(DynamicCache)", "PrefixStore\n(k5v3)", "PrefixStore\n(full precision)"])
    ax.set_ylabel("time to first token, s")
    ax.set_title(f"{res['requests']} requests, {res['users']} users, {res['prompts']} shared prompts ({res['model']})",
                 fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
