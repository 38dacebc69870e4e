"""The fast kernel's in-model calls (SmolLM2 shape, TurboQuantStaticCache k5v3, 1 x 4k) replayed in isolation:
every layer's captured launch, in one graph (cold data: 24 layers' inputs), and layer 0's alone (one set); with the
mask as given, and without it; against the dynamic-layer study's configuration."""
import json, sys, statistics
import torch, transformers
from triton.testing import do_bench_cudagraph
from tq_hf_cache import bench, cache_kwargs
from tq_hf_cache.kernels import fast
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16).to("cuda").eval()
ctx = 4096
cache, attn = bench._make_cache("tq_static_compiled", model.config, ctx + 64, "k5v3")
model.set_attn_implementation(attn)
ids = bench.prompt(1, ctx, model.config.vocab_size).cuda()
with torch.no_grad():
    for s in range(0, ctx, 8192):
        out = model(ids[:, s:s + 8192], **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
tok = out.logits[:, -1:].argmax(-1)
calls = []
orig = fast.decode
def rec(*a, **k):
    calls.append((a, k))
    return orig(*a, **k)
fast.decode = rec
with torch.no_grad():
    pos = torch.full((1,), ctx, device="cuda", dtype=torch.long)
    model(tok, **cache_kwargs(model, cache), cache_position=pos, position_ids=pos.view(1, 1), use_cache=True)
fast.decode = orig
torch.cuda.synchronize()
print("captured", len(calls), "calls")
a0, k0 = calls[0]
names = ["query", "kv", "pi", "scale_log2", "kp", "kn", "vp", "vn", "rk", "rv", "sk", "sv", "mask_args", "acc", "ml",
         "counters", "lens", "lengths", "num_splits", "fold", "rows", "out", "w", "parts"]
info = {}
for n, v in zip(names, a0):
    info[n] = (tuple(v.shape), str(v.dtype), tuple(v.stride())) if torch.is_tensor(v) else (repr(v)[:200] if not hasattr(v, "static") else "PackedKV")
mk = a0[12]
info["mask"] = None if mk[1] is None or not mk[0] else (mk[0], tuple(mk[1].shape), str(mk[1].dtype), tuple(mk[2]))
info["mask_row"] = bool(fast._mask_row(mk[0], mk[1], mk[2], a0[4].shape[2])) if mk[0] else None
print(json.dumps(info, indent=0, default=str)[:3000])
def call(c, nomask=False, **over):
    a, k = c
    a = list(a)
    if nomask:
        a[12] = (0, a[12][1], a[12][2])
    for key, val in over.items():
        a[names.index(key)] = val
    return lambda: fast.decode(*a, **k)
res = {"info": info}
def t(fns, reps=5):
    g = lambda: [f() for f in fns]
    xs = [do_bench_cudagraph(g) / len(fns) * 1e3 for _ in range(reps)]
    return statistics.median(xs), xs
for label, kw in [("as_given", {}), ("no_mask", {"nomask": True})]:
    res[label + "_24_layers_us"] = t([call(c, **kw) for c in calls])
    res[label + "_layer0_one_set_us"] = t([call(calls[0], **kw)])
    print(label, "24 layers (cold data)", round(res[label + "_24_layers_us"][0], 2), "| layer 0 alone", round(res[label + "_layer0_one_set_us"][0], 2), flush=True)
# plan variants on the 24 layers, mask as given: 8 warps unfolded / the fold tokens
w, s, f, p = a0[22], a0[18], a0[19], a0[23]
print("plan", w, s, f, p)
res["plan"] = [w, s, f, p]
json.dump(res, open(sys.argv[2], "w"), indent=1, default=str)
