"""Does the compiled TurboQuantStaticCache decode step replay as a CUDA graph? Logs inductor's cudagraph decisions
(TORCH_LOGS=perf_hints) and compares compiled logits with eager ones on a small Llama-shaped model."""

import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import transformers  # noqa: E402

from tq_hf_cache import TurboQuantStaticCache, cache_kwargs  # noqa: E402

cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=1024, intermediate_size=2048, num_hidden_layers=4,
                               num_attention_heads=8, num_key_value_heads=2, head_dim=128)
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
model.set_attn_implementation(sys.argv[1] if len(sys.argv) > 1 else "turboquant")
ids = torch.randint(0, 1000, (1, 1000), device="cuda")
res = {}
for compiled in (False, True):
    cache = TurboQuantStaticCache(cfg, max_cache_len=1100)
    fwd = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True) if compiled else model.forward
    with torch.no_grad():
        tok = model(ids, **cache_kwargs(model, cache)).logits[:, -1:].argmax(-1)
        layer = cache.layers[0]
        if os.environ.get("NO_TAG"):  # the experiment: does the ring's attribute keep CUDA graphs off?
            for l in cache.layers:
                del l.keys.turboquant_packed
        print("static address type of cumulative_length / k_packed:",
              getattr(layer.cumulative_length, "_dynamo_static_input_type", None),
              getattr(layer.packed.k_packed, "_dynamo_static_input_type", None), flush=True)
        out, walls = [], []
        for i in range(12):
            pos = torch.tensor([1000 + i], device="cuda")
            torch.cuda.synchronize()
            t = time.perf_counter()
            o = fwd(tok, **cache_kwargs(model, cache), cache_position=pos, position_ids=pos[None])
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - t) * 1e3)
            out.append(o.logits.float().clone())
            tok = o.logits[:, -1:].argmax(-1)
    res[compiled] = torch.cat(out, 1)
    print("compiled" if compiled else "eager", "ms per step:", [round(w, 2) for w in walls[-5:]], flush=True)
print("max |compiled - eager| logits:", (res[True] - res[False]).abs().max().item())
