"""torch.compile of a model that uses TurboQuantCache: the cache step is a graph break, the rest compiles."""

import pytest
import torch
from transformers import LlamaForCausalLM

from conftest import tiny_llama_config, with_cache
from tq_hf_cache import TurboQuantCache


def steps(model, cache, x):
    out = [model(x[:, :30], **with_cache(cache)).logits]
    for i in range(30, x.shape[1]):
        out.append(model(x[:, i : i + 1], **with_cache(cache)).logits)
    return out


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("attn", ["sdpa", "turboquant"])
def test_compiled_model_matches_eager(attn, backend):
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(head_dim=64, num_attention_heads=2, num_key_value_heads=1)).eval()
    model.set_attn_implementation(attn) if hasattr(model, "set_attn_implementation") else None
    model.config._attn_implementation = attn
    x = torch.randint(3, 128, (1, 38), generator=torch.Generator().manual_seed(2))
    eager = steps(model, TurboQuantCache(residual_length=4), x)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    out = steps(compiled, TurboQuantCache(residual_length=4), x)
    for a, b in zip(out, eager):
        assert torch.allclose(a, b, atol=1e-5)


def test_cache_is_not_marked_compileable():
    # generate() only auto-compiles (and CUDA-graphs) caches that declare themselves compileable
    cache = TurboQuantCache(config=tiny_llama_config())
    assert cache.is_compileable is False
