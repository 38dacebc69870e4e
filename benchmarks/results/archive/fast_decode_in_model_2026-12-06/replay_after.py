"""tq_decode's own duration (profiler) for the in-model launches of SmolLM2 1 x 4k (TurboQuantStaticCache k5v3),
replayed: back to back; each after a GEMV of one layer's MLP size on its own weights (as in the model); each after a
100 MB fill (L2 flushed, the SM's instruction caches left to the fill's small code). Also cuDNN SDPA alike."""
import json, sys, statistics
import torch, transformers
from torch.profiler import profile, ProfilerActivity
from tq_hf_cache import bench, cache_kwargs
from tq_hf_cache.kernels import fast
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16).to("cuda").eval()
ctx = 4096
cache, attn = bench._make_cache("tq_static_compiled", model.config, ctx + 64, "k5v3")
model.set_attn_implementation(attn)
ids = bench.prompt(1, ctx, model.config.vocab_size).cuda()
with torch.no_grad():
    out = model(ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
tok = out.logits[:, -1:].argmax(-1)
calls = []
orig = fast.decode
fast.decode = lambda *a, **k: (calls.append((a, k)), orig(*a, **k))[1]
with torch.no_grad():
    pos = torch.full((1,), ctx, device="cuda", dtype=torch.long)
    model(tok, **cache_kwargs(model, cache), cache_position=pos, position_ids=pos.view(1, 1), use_cache=True)
fast.decode = orig
del model
torch.cuda.empty_cache()
L = len(calls)
W = [torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16) for _ in range(L)]  # one layer's up-projection
x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
flush = torch.empty(100 * 2**20, dtype=torch.uint8, device="cuda")
from torch.nn.attention import SDPBackend, sdpa_kernel
qs = torch.randn(1, 32, 1, 64, device="cuda", dtype=torch.bfloat16)
kvs = [(torch.randn(1, 32, ctx, 64, device="cuda", dtype=torch.bfloat16),
        torch.randn(1, 32, ctx, 64, device="cuda", dtype=torch.bfloat16)) for _ in range(L)]
def sdpa(i):
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        torch.nn.functional.scaled_dot_product_attention(qs, kvs[i][0], kvs[i][1])
def tq(i):
    a, k = calls[i]
    orig(*a, **k)
def run(kind, before, rounds=6):
    for i in range(L):  # warm
        before(i); kind(i)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as pr:
        for _ in range(rounds):
            for i in range(L):
                before(i); kind(i)
        torch.cuda.synchronize()
    names = {}
    for e in pr.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            names.setdefault(e.name, []).append(e.time_range.elapsed_us())
    return names
res = {}
for kname, kind, pick in (("tq", tq, lambda n: n.startswith("tq_decode")), ("sdpa", sdpa, lambda n: "sdpa" in n or "fprop" in n)):
    for bname, before in (("back_to_back", lambda i: None), ("after_gemv", lambda i: torch.mm(x, W[i].t())),
                          ("after_fill", lambda i: flush.fill_(i & 255))):
        names = run(kind, before)
        durs = [d for n, v in names.items() if pick(n) for d in v]
        res[f"{kname}_{bname}"] = dict(median_us=statistics.median(durs), n=len(durs),
                                        all_kernels={n[:80]: round(statistics.median(v), 2) for n, v in names.items()})
        print(kname, bname, "median us", round(statistics.median(durs), 2), "n", len(durs),
              {n[:50]: round(statistics.median(v), 2) for n, v in names.items()}, flush=True)
json.dump(res, open(sys.argv[2], "w"), indent=1)
