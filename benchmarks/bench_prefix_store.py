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
    python benchmarks/bench_prefix_store.py --model llama-3.1-8b --users 16 --prompts 4 --prompt-tokens 2048 \
        --doc-tokens 8192,16384 --turns 2 --out DIR                           # random bf16 weights, one GPU

With --model llama-3.1-8b the model has the Llama-3.1-8B shape and random bf16 weights (nothing is downloaded), the
prompts are random token ids (system prompts of --prompt-tokens, documents of the --doc-tokens lengths in turn,
16-token questions) and the first generated token is the answer carried into the next turn; the stores keep their
pages in GPU memory, then pinned CPU memory.
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
from tq_hf_cache.prefix.store import PrefixStore  # noqa: E402
from tq_hf_cache.tools.texts import package_text  # noqa: E402

QUESTIONS = ["What is this document about?", "Name one term it defines.", "Summarize it in five words.",
             "Which part matters most?"]


def template(tok, system: str, turns: list[tuple[str, str | None]]) -> torch.Tensor:
    msgs = [{"role": "system", "content": system}]
    for question, answer in turns:
        msgs.append({"role": "user", "content": question})
        if answer is not None:
            msgs.append({"role": "assistant", "content": answer})
    return tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]


def random_llama(a):
    """The Llama-3.1-8B shape with random bf16 weights on the GPU, and the workload's prompts as random token ids:
    (model, prompt_of(user, turn, history) -> (ids, turns), the system prompts' ids, a label)."""
    from tq_hf_cache.tools.bench import random_llama_8b

    model = random_llama_8b(32, "cuda", max_position_embeddings=1 << 17).eval()
    cfg = model.config
    model.set_attn_implementation("turboquant")  # the caches' own attention; DynamicCache falls back to sdpa
    g = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(0, cfg.vocab_size, (n,), generator=g)  # noqa: E731
    systems = [ids(a.prompt_tokens) for _ in range(a.prompts)]
    lengths = [int(x) for x in a.doc_tokens.split(",")]
    docs = [ids(lengths[u % len(lengths)]) for u in range(a.users)]
    questions = [ids(16) for _ in range(len(QUESTIONS))]

    def prompt_of(u, turn, history):
        turns = history + [(torch.cat([docs[u], questions[0]]) if turn == 0 else questions[turn], None)]
        parts = [systems[u % a.prompts]]
        for q, answer in turns:
            parts.append(q)
            if answer is not None:
                parts.append(torch.tensor([answer]))
        return torch.cat(parts)[None].to("cuda"), turns

    label = f"Llama-3.1-8B shape, random bf16 weights ({torch.cuda.get_device_name()})"
    return model, prompt_of, [x[None].to("cuda") for x in systems], label


def replay(model, cache, ids, ops) -> int:
    """The first token of `ids` from a new cache that runs `ops` (forwards over token ranges, generate steps): the
    computations a store's restored cache holds, in its chunks."""
    token = None
    for op in ops:
        if op[0] == "model":
            with torch.no_grad():
                model(ids[:, op[1]:op[2]], **cache_kwargs(model, cache))
        else:
            token = first_token(model, cache, ids[:, :op[1]])
    return token


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
    p.add_argument("--model", default="smollm2", choices=["smollm2", "llama-3.1-8b"])
    p.add_argument("--prompt-tokens", type=int, default=2048, help="with --model llama-3.1-8b")
    p.add_argument("--doc-tokens", default="8192,16384", help="with --model llama-3.1-8b: lengths, in turn per user")
    p.add_argument("--gpu-bytes", type=int, default=16 << 30, help="with --model llama-3.1-8b: the stores' GPU tier")
    p.add_argument("--out", default=".")
    a = p.parse_args(argv)

    gpu = a.model != "smollm2"
    if gpu:
        model, prompt_of, system_ids, label = random_llama(a)
        dev = model.device
        tiers = dict(gpu_bytes=a.gpu_bytes, cpu_bytes=1 << 36, device=dev)
    else:
        from tq_hf_cache.tools.models import load_smollm2

        model, tok = load_smollm2()
        systems = [f"You answer from the manual below.\n\n{package_text(a.prompt_chars, start=200 * s)}"
                   for s in range(a.prompts)]
        docs = [package_text(a.doc_chars, start=600 + 20 * u) for u in range(a.users)]
        system_ids = [tok.apply_chat_template([{"role": "system", "content": s}], return_tensors="pt",
                                              return_dict=True)["input_ids"] for s in systems]

        def prompt_of(u, turn, history):
            turns = history + [(f"{docs[u]}\n\n{QUESTIONS[turn]}" if turn == 0 else QUESTIONS[turn], None)]
            return template(tok, systems[u % a.prompts], turns), turns

        label, tiers = "SmolLM2-135M-Instruct (fp32, CPU)", dict(cpu_bytes=1 << 33)
    cfg = model.config
    all_layers = list(range(cfg.num_hidden_layers))
    stores = {"store": PrefixStore(config=cfg, page_tokens=a.page_tokens, model=model, **tiers),
              "store_fp": PrefixStore(config=cfg, page_tokens=a.page_tokens, model=model, skip_layers=all_layers,
                                      **tiers)}
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
    insert_s = {m: [] for m in stores}
    # exactness: each store request's first token against a new cache that ran the same computations in the same
    # chunks (its restored snapshot's history, then this request's): ("model", a, b) a forward over tokens [a, b),
    # ("gen", b) generate on tokens [:b] (computing those the cache does not hold); per user, its last snapshot
    same = {m: 0 for m in stores}
    snap = {m: {} for m in stores}
    sys_ops = [[("model", 0, int(x.shape[1]))] for x in system_ids]
    history: dict[int, list] = {u: [] for u in range(a.users)}
    for turn in range(a.turns):
        for u in range(a.users):
            s = u % a.prompts
            ids, turns = prompt_of(u, turn, history[u])
            got, ops = {}, {}
            for mode in ttft:  # the modes in turns, request by request: drift on the host hits them alike
                t = time.perf_counter()
                if mode == "none":
                    got[mode] = first_token(model, TurboQuantCache(config=cfg), ids)
                elif mode == "deepcopy":
                    got[mode] = first_token(model, copy.deepcopy(base[s]), ids)
                else:
                    store = stores[mode]
                    cache, n = store.match(ids)
                    got[mode] = first_token(model, cache, ids)  # generate computes the tokens past the n restored
                    if gpu:
                        torch.cuda.synchronize()
                    ttft[mode].append(time.perf_counter() - t)
                    t = time.perf_counter()
                    store.insert(ids, cache)  # after the answer's first token: it does not delay it
                    if gpu:
                        torch.cuda.synchronize()  # (its page copies: not into the next mode's time)
                    insert_s[mode].append(time.perf_counter() - t)
                    prev = snap[mode].get(u)
                    before = prev[1] if prev is not None and prev[0] == n else sys_ops[s] if n == sys_ops[s][0][2] \
                        else None
                    L = int(ids.shape[1])
                    ops[mode] = None if before is None else before + [("gen", L)]
                    snap[mode][u] = (L, ops[mode])
                    continue
                if gpu:
                    torch.cuda.synchronize()
                ttft[mode].append(time.perf_counter() - t)
            for mode in ttft:
                agree[mode] += got[mode] == got["none"]
            for mode in stores:
                if ops[mode] is not None:
                    kw = {"skip_layers": all_layers} if mode == "store_fp" else {}
                    same[mode] += got[mode] == replay(model, TurboQuantCache(config=cfg, **kw), ids, ops[mode])
            answer = got["none"] if gpu else tok.decode([got["none"]], skip_special_tokens=True)
            history[u] = turns[:-1] + [(turns[-1][0], answer)]

    def pct(v, q):
        v = sorted(v)
        return v[min(len(v) - 1, int(q * len(v)))]

    res = {"model": label, "threads": torch.get_num_threads(), "users": a.users,
           "prompts": a.prompts, "turns": a.turns, "page_tokens": a.page_tokens, "requests": a.users * a.turns,
           "ttft_s": {m: {"median": round(statistics.median(v), 4), "p90": round(pct(v, 0.9), 4),
                          "all": [round(x, 4) for x in v]} for m, v in ttft.items()},
           "first_token_same_as_none": agree, "first_token_same_as_the_same_chunks": same,
           "insert_s_median": {m: round(statistics.median(v), 4) for m, v in insert_s.items()}, "stores": {}}
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
