"""The three quality tasks. Every task feeds its prompt through the cache in chunks (chunked prefill), so that
later tokens attend to a cache that already holds the earlier ones, quantized beyond the residual window;
a single-shot prefill would let every prompt token attend to full-precision states and hide the cache error.

All functions take `make_cache`, a zero-argument callable returning a fresh cache, and run under
`torch.inference_mode()`.
"""

from __future__ import annotations

import random
import re

import torch

from ..._compat import cache_kwargs


def _forward(model, ids: torch.Tensor, cache, all_logits: bool) -> torch.Tensor:
    out = model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=0 if all_logits else 1)
    return out.logits


def chunked_prefill(model, ids: torch.Tensor, cache, chunk: int) -> torch.Tensor:
    """Feed ids (1, T) through the cache `chunk` tokens at a time; returns the logits of the last position (1, V)."""
    logits = None
    for s in range(0, ids.shape[1], chunk):
        logits = _forward(model, ids[:, s : s + chunk], cache, all_logits=False)
    return logits[:, -1].float()


# --- (a) perplexity ---------------------------------------------------------------------------------------

@torch.inference_mode()
def perplexity(model, ids: torch.Tensor, make_cache, chunk: int = 256, reference_argmax: torch.Tensor | None = None):
    """Chunked-prefill perplexity of ids (1, N).

    Chunk i (tokens [i*chunk, (i+1)*chunk)) runs with the cache holding chunks 0..i-1; all its positions are
    scored (position t predicts token t+1; the last position of chunk i predicts the first token of chunk i+1).
    `ppl` is over the N - 1 - chunk predictions made from chunks 1..n-1, i.e. by queries that attend to the cache;
    `ppl_all` also counts the first chunk, which attends to nothing cached and is identical for every cache.
    With `reference_argmax` (the fp run's argmax per prediction) it also reports `top1_agreement`.
    Returns the dict and the argmax tensor (N - 1,).
    """
    n = ids.shape[1]
    cache = make_cache()
    nll = torch.empty(n - 1, dtype=torch.float64)
    argmax = torch.empty(n - 1, dtype=torch.long)
    for s in range(0, n, chunk):
        x = ids[:, s : s + chunk]
        logits = _forward(model, x, cache, all_logits=True)[0].float()  # (c, V)
        tgt_end = min(s + chunk + 1, n)  # targets ids[s+1 .. tgt_end)
        m = tgt_end - (s + 1)
        lp = torch.log_softmax(logits[:m], dim=-1)
        tgt = ids[0, s + 1 : tgt_end]
        nll[s : s + m] = -lp.gather(1, tgt[:, None])[:, 0].double()
        argmax[s : s + m] = logits[:m].argmax(-1)
        del logits, lp
    cached = nll[chunk:] if n > chunk + 1 else nll
    out = {
        "tokens": n,
        "chunk": chunk,
        "scored_with_cache": int(cached.numel()),
        "nll": float(cached.mean()),
        "ppl": float(torch.exp(cached.mean())),
        "ppl_all": float(torch.exp(nll.mean())),
    }
    if reference_argmax is not None:
        agree = (argmax == reference_argmax).double()
        out["top1_agreement"] = float(agree[chunk:].mean()) if n > chunk + 1 else float(agree.mean())
    return out, argmax, cache


# --- (b) needle in a haystack -----------------------------------------------------------------------------

NEEDLE_TEMPLATE = "The secret code is {code}."
QUESTION = "\n\nWhat is the secret code mentioned in the text above? The secret code is"


def build_needle_prompt(tokenizer, paragraphs: list[str], length: int, depth: float, code: str, bos: bool = True):
    """A prompt of about `length` tokens: package paragraphs with the needle sentence inserted as its own paragraph
    at the paragraph boundary nearest to `depth` (0 = start, 1 = end) of the haystack, then the question.
    Returns (ids (1, T), needle_token_position)."""
    def n_tok(s):
        return len(tokenizer(s, add_special_tokens=False).input_ids)

    sep = n_tok("\n\n")
    budget = length - n_tok(QUESTION) - n_tok(NEEDLE_TEMPLATE.format(code=code)) - sep - 3
    picked, sizes, total = [], [], 0
    for p in paragraphs:
        k = n_tok(p) + sep
        if total + k > budget:
            break
        picked.append(p)
        sizes.append(k)
        total += k
    cum, at = 0, 0
    target = depth * total
    best = abs(target)
    for i, k in enumerate(sizes):
        cum += k
        if abs(cum - target) < best:
            best, at = abs(cum - target), i + 1
    needle = NEEDLE_TEMPLATE.format(code=code)
    parts = picked[:at] + [needle] + picked[at:]
    text = "\n\n".join(parts) + QUESTION
    enc = tokenizer(text, add_special_tokens=bos).input_ids
    prefix = "\n\n".join(picked[:at])
    needle_pos = len(tokenizer(prefix, add_special_tokens=bos).input_ids)
    return torch.tensor([enc]), needle_pos


@torch.inference_mode()
def greedy_decode(model, cache, first_logits: torch.Tensor, steps: int, forced: list[int] | None = None,
                  eos_token_id=None):
    """Greedy decoding from the prefill's last logits. With `forced`, feed those tokens instead of the argmax
    (teacher forcing) and return the argmax at each step. Stops at EOS only when not forced."""
    out = []
    logits = first_logits
    for i in range(steps):
        tok = int(logits.argmax(-1))
        out.append(tok)
        if forced is None and eos_token_id is not None and tok in eos_token_id:
            break
        nxt = forced[i] if forced is not None else tok
        if i + 1 < steps:
            logits = _forward(model, torch.tensor([[nxt]]), cache, all_logits=False)[:, -1].float()
    return out


def needle_codes(lengths, depths, seed: int = 0) -> dict:
    rng = random.Random(seed)
    return {(L, d): str(rng.randint(10000, 99999)) for L in lengths for d in depths}


@torch.inference_mode()
def needle(model, tokenizer, paragraphs, make_cache, lengths, depths, chunk: int = 256, new_tokens: int = 8,
           seed: int = 0, prompts=None):
    """Needle retrieval at every (length, depth): greedy answer, found = the 5-digit code appears in the answer.
    Returns a list of per-prompt dicts (tokens, needle position, answer text and ids, found)."""
    codes = needle_codes(lengths, depths, seed)
    results = []
    eos = _eos_ids(tokenizer)
    for L in lengths:
        for d in depths:
            code = codes[(L, d)]
            if prompts is not None and (L, d) in prompts:
                ids, pos = prompts[(L, d)]
            else:
                ids, pos = build_needle_prompt(tokenizer, paragraphs, L, d, code)
            cache = make_cache()
            first = chunked_prefill(model, ids, cache, chunk)
            toks = greedy_decode(model, cache, first, new_tokens, eos_token_id=eos)
            answer = tokenizer.decode(toks, skip_special_tokens=True)
            digits = re.sub(r"\D", "", answer)
            results.append({
                "length": L, "depth": d, "tokens": int(ids.shape[1]), "needle_token": int(pos), "code": code,
                "answer": answer, "answer_ids": toks, "found": digits.startswith(code),
            })
    return results


def _eos_ids(tokenizer) -> set:
    e = tokenizer.eos_token_id
    return set() if e is None else ({e} if isinstance(e, int) else set(e))


# --- (c) greedy agreement ---------------------------------------------------------------------------------

@torch.inference_mode()
def fp_generation(model, prompt_ids: torch.Tensor, make_cache, new_tokens: int, chunk: int = 256) -> list[int]:
    """Reference greedy continuation (no EOS stop, so every cache is compared over the same number of tokens)."""
    cache = make_cache()
    first = chunked_prefill(model, prompt_ids, cache, chunk)
    return greedy_decode(model, cache, first, new_tokens)


@torch.inference_mode()
def agreement(model, prompt_ids: torch.Tensor, make_cache, reference: list[int], chunk: int = 256) -> dict:
    """Greedy agreement with the reference continuation, measured by teacher forcing.

    The cache decodes step by step while being fed the reference tokens; at step i its argmax is compared with
    reference[i]. Until the first mismatch this is exactly the cache's own greedy generation, so
    - `first_divergence`: index of the first generated token that differs from fp (= len when none does);
    - `prefix_match`: first_divergence / len, the fraction of the greedy generation identical to fp;
    - `top1_agreement`: fraction of all steps whose argmax equals fp's token, given the same (fp) context.
    """
    cache = make_cache()
    first = chunked_prefill(model, prompt_ids, cache, chunk)
    got = greedy_decode(model, cache, first, len(reference), forced=reference)
    same = [a == b for a, b in zip(got, reference)]
    fd = same.index(False) if False in same else len(same)
    return {"new_tokens": len(reference), "first_divergence": fd, "prefix_match": fd / len(reference),
            "top1_agreement": sum(same) / len(same)}
