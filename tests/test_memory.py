"""Between steps the cache holds packed buffers + residual windows + one shared workspace, nothing else."""

import torch
from transformers import LlamaForCausalLM

from conftest import tiny_llama_config, with_cache
from tq_hf_cache import TurboQuantCache
from tq_hf_cache.quant.packing import packed_bytes


def reachable_tensors(root):
    """Every tensor reachable from `root` through attributes, containers and closures, by storage."""
    seen, storages, stack = set(), {}, [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None), torch.nn.Module)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            s = obj.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
            continue
        if isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            stack.extend(obj)
        if hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
        if callable(obj) and getattr(obj, "__closure__", None):
            stack.extend(c.cell_contents for c in obj.__closure__)
    return storages


def test_held_bytes_are_packed_plus_residual_plus_one_workspace():
    cfg = tiny_llama_config(num_hidden_layers=4, head_dim=64, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    b, h, d, layers, residual = 2, 2, 64, 4, 16
    cache = TurboQuantCache("k3v4", residual_length=residual, config=cfg, fused_sdpa=False)  # SDPA fills the workspace
    x = torch.randint(3, 128, (b, 300))
    with torch.no_grad():  # under grad, update returns private tensors for autograd instead of workspace views
        model(x[:, :290], **with_cache(cache))
        for i in range(290, 300):
            model(x[:, i : i + 1], **with_cache(cache))
    seq = cache.get_seq_length()
    assert seq == 300

    held = cache.nbytes()
    for layer in cache.layers:
        # prefill left `residual` tokens in full precision; the 10 decode tokens wait in the window's slack
        assert (layer.quantized_length, layer.residual_tokens) == (290 - residual, residual + 10)
        assert layer.residual_capacity == 2 * residual
        q = layer.quantized_length
        cap = layer.kv.k_buf.capacity
        # live packed bytes are exactly 3 bits per key coordinate and 4 per value coordinate, plus fp16 norms
        live = b * h * q * (packed_bytes(d, 3) + packed_bytes(d, 4) + 2 * 2)
        assert packed_bytes(d, 3) == 24 and live == b * h * q * 60
        assert layer.nbytes()["packed"] == live * cap // q
        # capacity grows in 256-token chunks: at most one chunk beyond what is live
        assert q < cap <= q + 256
    fp_token = b * h * d * 4  # one token's K or V in fp32
    assert held["residual"] == layers * 2 * 2 * residual * fp_token
    sinks = cache.tq_config.sink_tokens
    assert sinks > 0 and held["sinks"] == layers * 2 * sinks * fp_token  # exact K and V of the first tokens
    assert held["full_precision"] == 0
    # one workspace for all layers: room for the longest sequence's K and V plus headroom, not one per layer
    assert 2 * seq * fp_token <= held["workspace"] <= 2 * (seq + 256) * fp_token

    # walking the object graph finds nothing else but small per-layer constants (rotation, codebooks)
    found = reachable_tensors(cache)
    constants = sum(found.values()) - (held["packed"] + held["residual"] + held["sinks"] + held["workspace"])
    assert 0 <= constants <= layers * (d * d * 4 + d * 4 + 2 * 2 * 16 * 4) + 64
    # per token and layer: 3-bit keys + 4-bit values + norms = 60 bytes per head vs 256 in fp16
    assert b * h * (packed_bytes(d, 3) + packed_bytes(d, 4) + 4) * 4.2 < b * h * 2 * d * 2


def test_dropping_the_cache_frees_its_buffers_without_the_garbage_collector():
    import gc
    import weakref

    for config in (None, tiny_llama_config()):
        cache = TurboQuantCache(residual_length=0, config=config)
        cache.update(torch.randn(1, 2, 300, 32), torch.randn(1, 2, 300, 32), 0)
        cache.update(torch.randn(1, 2, 1, 32), torch.randn(1, 2, 1, 32), 0)
        packed = weakref.ref(cache.layers[0].kv.k_buf.packed)
        gc.disable()
        try:
            del cache
            assert packed() is None, "a reference cycle keeps the packed buffers alive"
        finally:
            gc.enable()


def test_a_short_prompt_costs_what_dynamic_cache_costs():
    """Nothing is preallocated: a prompt inside the residual window holds exactly DynamicCache's bytes (no spare
    residual capacity, no sink copies until tokens are quantized, no workspace)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config()).eval()
    from transformers import DynamicCache

    x = torch.randint(3, 128, (1, 4))
    tq, dyn = TurboQuantCache(config=model.config), DynamicCache(config=model.config)
    with torch.no_grad():
        model(x, **with_cache(tq))
        model(x, **with_cache(dyn))
    dyn_bytes = sum(t.numel() * t.element_size() for layer in dyn.layers for t in (layer.keys, layer.values))
    assert tq.nbytes()["total"] == dyn_bytes
