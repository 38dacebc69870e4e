"""Eager decode step on the H100: k4v2 against k4v2 with split keys (64 x 5 + 64 x 3), on the workspace path (the
default sdpa attention: dequantize + SDPA) and on the fused kernel (attn_implementation="turboquant"); Llama-3.1-8B
shape, 4 layers, bf16, batch 1, random weights. Writes $OUT/split_speed.json."""
import json, os, sys, time
import torch
sys.path.insert(0, ".")
from transformers import LlamaForCausalLM
from tq_hf_cache import TurboQuantCache, TurboQuantConfig
from tq_hf_cache.bench import llama_8b_config
from tq_hf_cache.key_split import calibrate_key_split
torch.manual_seed(0)
cfg = llama_8b_config(layers=4)
model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
ids = torch.randint(0, cfg.vocab_size, (1, 512), device="cuda")
base = TurboQuantConfig.from_preset("k4v2")
spec = calibrate_key_split(model.float(), ids, [64, 64], [1, -1], base)
model = model.to(torch.bfloat16)
rows = []
for attn, ctx in [(a, c) for a in ("sdpa", "turboquant") for c in (4096, 32768)]:
    model.set_attn_implementation(attn)
    prompt = torch.randint(0, cfg.vocab_size, (1, ctx), device="cuda")
    # each twice, alternating: the first pass at a context pays cuDNN's plan for every new key length
    for rep, (name, tq) in enumerate(2 * (("k4v2", base), ("k4v2-split64x5+64x3", TurboQuantConfig.from_dict({**base.to_dict(), "key_split": spec})))):
        cache = TurboQuantCache(tq, config=cfg)
        with torch.no_grad():
            for s in range(0, ctx, 4096):
                model(prompt[:, s:s + 4096], past_key_values=cache)
            tok = prompt[:, -1:]
            times = []
            for i in range(23):
                torch.cuda.synchronize(); t0 = time.perf_counter()
                logits = model(tok, past_key_values=cache).logits
                torch.cuda.synchronize(); times.append(time.perf_counter() - t0)
        times = sorted(times[3:])
        row = dict(attention=attn, context=ctx, cache=name, pass_=rep // 2, ms_per_step_median=round(1000 * times[len(times) // 2], 3),
                   packed_bytes=cache.nbytes()["packed"])
        print(row, flush=True)
        rows.append(row)
        del cache
        torch.cuda.empty_cache()
out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": "Llama-3.1-8B shape, 4 layers, bf16, random",
       "attention": "sdpa: the workspace path (dequantize + SDPA), turboquant: the fused kernel; pass 1 is the one to read (pass 0 pays cuDNN plans or kernel compiles)", "batch": 1, "rows": rows,
       "command": "python benchmarks/studies/key_split_speed.py"}
json.dump(out, open(os.path.join(os.environ["OUT"], "split_speed.json"), "w"), indent=1)
