"""A warm prefill through our caches on a GPU does not make the host wait for the GPU (a host read of a device
value, a blocking copy): each wait keeps the host from queueing the next layer's work while the GPU runs, and at
short prompts that was most of the time to first token. CUDA only (torch's sync debug mode)."""

import traceback
import warnings

import pytest
import torch

from conftest import tiny_llama_config
from tq_hf_cache import TurboQuantCache, cache_kwargs
from tq_hf_cache._compat import IS_V5

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPT = 300  # past the residual window: the prefill quantizes


def _waits(run) -> list[str]:
    """The tq_hf_cache frames (innermost last) of every wait for the GPU while run() runs."""
    sites = []

    def record(message, *args, **kwargs):
        if "synchroniz" in str(message):
            stack = traceback.format_stack()[:-2]
            frames = [f for f in stack if "tq_hf_cache" in f]
            sites.append("".join(frames[-2:]) or "outside tq_hf_cache:\n" + "".join(stack[-3:]))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(1)
        old, warnings.showwarning = warnings.showwarning, record
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = old
    return sites


def _make(kind: str, model):
    if kind == "dynamic":
        return TurboQuantCache(config=model.config, residual_length=64)
    from tq_hf_cache import TurboQuantStaticCache

    return TurboQuantStaticCache(config=model.config, max_cache_len=PROMPT + 8, residual_length=64)


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_a_warm_prefill_never_waits_for_the_gpu(kind):
    if kind == "static" and not IS_V5:
        pytest.skip("TurboQuantStaticCache needs transformers >= 5")
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(num_hidden_layers=3)).cuda().to(torch.bfloat16).eval()
    model.set_attn_implementation("turboquant")
    ids = torch.randint(3, 128, (1, PROMPT), device="cuda", generator=torch.Generator("cuda").manual_seed(1))

    def prefill():
        with torch.no_grad():
            cache = _make(kind, model)  # a fresh cache, as each new request gets
            model(ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
            return cache

    prefill()  # the first call: kernels compiled, tables built
    torch.cuda.synchronize()
    sites = _waits(prefill)
    assert not sites, f"{len(sites)} waits for the GPU in a warm {kind} prefill, at:\n" + "\n".join(sorted(set(sites)))
