"""Isolated replay of the in-model tq_decode launches (SmolLM2 1 x 4k k5v3), each after a 'before' kernel:
SM shared-memory reconfiguration (a tiny kernel preferring max L1 / max shared) against instruction-cache eviction
(the other compiled variant of tq_decode: same shared memory, different code), and both caches emptied
(a 100 MB fill and the other variant). argv: DIR OUT [carveout|evict]"""
import ctypes, json, os, statistics, sys
import torch, transformers
from torch.profiler import profile, ProfilerActivity
sys.path.insert(0, os.getcwd())
from tq_hf_cache import bench, cache_kwargs
from tq_hf_cache.kernels import fast
from tq_hf_cache.kernels.fast import jit
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

TINY = r'''
struct P { float* out; };
extern "C" __global__ void tiny(const P p) {
  __shared__ float s[SMEMF];
  for (int i = threadIdx.x; i < SMEMF; i += blockDim.x) s[i] = i;
  __syncthreads();
  if (s[(threadIdx.x * 7) % SMEMF] < 0.f) p.out[0] = 1.f;
}
'''
class P(ctypes.Structure):
    _fields_ = [("out", ctypes.c_void_p)]
sink = torch.zeros(4, device="cuda")
tinies = {}
for label, smemf, pref in (("tiny_l1", 1024, 0), ("tiny_sh", 1024, 100), ("tiny_none", 1024, -1),
                           ("tiny48k_l1", 12288, 0)):
    k = jit.kernel(TINY, "tiny", {"SMEMF": smemf}, torch.device("cuda", 0))
    if pref >= 0:
        jit._check(jit.cuda().cuFuncSetAttribute(k.func, 9, pref), "carveout")
    tinies[label] = k
prm = P(sink.data_ptr())
stream = lambda: torch.cuda.current_stream().cuda_stream
def tiny(label):
    return lambda i: tinies[label].launch((264, 1, 1), 256, prm, stream())

def variant(c, nomask):
    a, k = c
    a = list(a)
    if nomask:
        a[12] = (0, a[12][1], a[12][2])
    return lambda: orig(*a, **k)
tq = [variant(c, False) for c in calls]
tq_nomask = [variant(c, True) for c in calls]
A = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
flush = torch.empty(100 * 2**20, dtype=torch.uint8, device="cuda")

def run(before, rounds=6):
    for i in range(L):
        before(i); tq[i]()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as pr:
        for _ in range(rounds):
            for i in range(L):
                before(i); tq[i]()
        torch.cuda.synchronize()
    ev = sorted([e for e in pr.events() if e.device_type == torch.autograd.DeviceType.CUDA],
                key=lambda e: e.time_range.start)
    # the tq_decode launches of the mask variant are the ones right after a `before` (or all, for none)
    durs = [e.time_range.elapsed_us() for e in ev if e.name == fast.NAME]
    others = {}
    for e in ev:
        others.setdefault(e.name[:60], []).append(e.time_range.elapsed_us())
    return durs, {n: round(statistics.median(v), 2) for n, v in others.items()}

res = {}
every = {"none": lambda i: None, "fill_100MB": lambda i: flush.fill_(i & 255),
         **{lab: tiny(lab) for lab in tinies},
         "tq_nomask_variant": lambda i: tq_nomask[i](),
         "gemm_2048": lambda i: torch.mm(A, A),
         "fill_then_tiny_l1": lambda i: (flush.fill_(i & 255), tiny("tiny_l1")(i)),
         "fill_then_variant": lambda i: (flush.fill_(i & 255), tq_nomask[i]()),
         "variant_then_fill": lambda i: (tq_nomask[i](), flush.fill_(i & 255)),
         "gemm_then_fill": lambda i: (torch.mm(A, A), flush.fill_(i & 255))}
SETS = {"carveout": (["none"] + list(tinies) + ["tq_nomask_variant", "gemm_2048", "fill_100MB", "fill_then_tiny_l1"], 2),
        "evict": (["none", "fill_100MB", "tq_nomask_variant", "fill_then_variant", "variant_then_fill",
                   "gemm_then_fill"], 1)}
names, reps = SETS[sys.argv[3] if len(sys.argv) > 3 else "evict"]
modes = [(n, every[n]) for n in names]
for rep in range(reps):
    for name, before in modes:
        durs, others = run(before)
        if name in ("tq_nomask_variant", "fill_then_variant", "variant_then_fill"):
            first, second = durs[0::2], durs[1::2]
            row = dict(nomask_us=statistics.median(first), mask_us=statistics.median(second), n=len(second))
        else:
            row = dict(mask_us=statistics.median(durs), n=len(durs))
        row["kernels"] = others
        res.setdefault(name, []).append(row)
        print(rep, name, {k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items() if k != "kernels"},
              {k[:30]: v for k, v in others.items()}, flush=True)
json.dump(res, open(sys.argv[2], "w"), indent=1)
