"""What a user gets from `generate(cache=TurboQuantCache(config=model.config))` with nothing else set: the fused
attention over the packed K/V under the model's default "sdpa" attention, and a way to see whether anything was
quantized."""

import pytest
import torch

from conftest import tiny_llama_config, with_cache
from tq_hf_cache import TurboQuantCache, attention


def _model():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(head_dim=64, hidden_size=256)).eval()  # a head dim the fused path takes


def _sdpa_packs_gqa() -> bool:
    """Whether transformers' sdpa attention hands SDPA the KV heads under a mask (5.24's `pack_gqa` for one query);
    before, it repeats them (`repeat_kv`), which reads the keys and values densely (5.17 on the H100)."""
    from transformers.integrations import sdpa_attention

    return hasattr(sdpa_attention, "pack_gqa")


@pytest.mark.parametrize("batch", [1, 2])
def test_sdpa_decode_steps_read_the_packed_kv_and_match_the_dequantized_path(count_paths, batch):
    """Under "sdpa" (no setting on the model) every decode step over a packed history takes the fused attention,
    nothing is dequantized into the workspace, and the scores are those of SDPA on the dequantized keys and values
    (fused_sdpa=False). A left-padded batch passes a mask; a single row none."""
    model = _model()
    model.set_attn_implementation("sdpa")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (batch, 40), generator=g)
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[1, :7] = 0
    outs = {}
    for fused in (True, False):
        cache = TurboQuantCache("k4v4", config=model.config, residual_length=8, fused_sdpa=fused)
        with torch.no_grad():
            outs[fused] = model.generate(ids, attention_mask=mask, **with_cache(cache), max_new_tokens=6,
                                         do_sample=False, output_scores=True, return_dict_in_generate=True,
                                         pad_token_id=0, min_new_tokens=6)
        layers = model.config.num_hidden_layers
        if fused and (batch == 1 or _sdpa_packs_gqa()):
            assert count_paths == {"fused": layers * 5, "filled": 0}  # the 5 steps after the prefill, in every layer
            assert cache.nbytes()["workspace"] == 0
        elif fused:  # older sdpa repeats the KV heads under a mask: those steps fill the dense keys and values
            assert count_paths == {"fused": 0, "filled": 2 * layers * 5}
            count_paths["filled"] = 0
        if fused:
            assert cache.quantized_tokens > 0
    assert count_paths["filled"] == 2 * model.config.num_hidden_layers * 5  # fused_sdpa=False: SDPA read K, V densely
    assert torch.equal(outs[True].sequences, outs[False].sequences)
    for a, b in zip(outs[True].scores, outs[False].scores):  # min_new_tokens puts -inf on end-of-sequence
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_sdpa_calls_the_fused_path_cannot_serve_get_the_dense_keys():
    """Dropout, is_causal, or an unmasked multi-query call: SDPA on the dequantized keys and values."""
    cache = TurboQuantCache(residual_length=8)
    cache.update(torch.randn(1, 2, 40, 64), torch.randn(1, 2, 40, 64), 0)
    k, v = cache.update(torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64), 0)
    q = torch.randn(1, 4, 1, 64)
    assert attention.sdpa_on_packed((q, k, v), {"enable_gqa": True}) is not None
    assert attention.sdpa_on_packed((q, k, v), {"enable_gqa": True, "dropout_p": 0.1}) is None
    assert attention.sdpa_on_packed((q, k, v), {"enable_gqa": True, "is_causal": True}) is None
    assert attention.sdpa_on_packed((torch.randn(1, 4, 3, 64), k, v), {"enable_gqa": True}) is None
    assert attention.sdpa_on_packed((q, v, k), {"enable_gqa": True}) is None  # not a (key, value) pair
    dense = torch.nn.functional.scaled_dot_product_attention(q, k.dense(), v.dense(), enable_gqa=True)
    fused = attention.sdpa_on_packed((q, k, v), {"enable_gqa": True})  # after a fill: None, SDPA reads the dense
    assert fused is None and dense.shape == q.shape


def test_quantized_tokens_says_when_nothing_is_quantized():
    model = _model()
    cache = TurboQuantCache(config=model.config)  # residual_length 128
    with torch.no_grad():
        model(torch.randint(3, 128, (1, 100)), **with_cache(cache))
    assert cache.quantized_tokens == 0 and cache.nbytes()["packed"] == 0
    with torch.no_grad():
        model(torch.randint(3, 128, (1, 200)), **with_cache(cache))
    assert cache.quantized_tokens == 300 - 128 and cache.nbytes()["packed"] > 0
