"""In-model tq_decode launch, more modes than the study: what precedes the launch. argv: DIR OUT [carveout%]"""
import json, os, statistics, sys
import torch
sys.path.insert(0, os.getcwd())
from tq_hf_cache.kernels.fast import jit
CARVE = int(sys.argv[3]) if len(sys.argv) > 3 else -1
if CARVE >= 0:
    init0 = jit.Kernel.__init__
    def init(self, *a, **k):
        init0(self, *a, **k)
        jit._check(jit.cuda().cuFuncSetAttribute(self.func, 9, CARVE), "carveout")
        print("carveout set", CARVE, "smem", self.smem, flush=True)
    jit.Kernel.__init__ = init
from tq_hf_cache import bench
from tq_hf_cache.kernels import fast
import transformers
from torch.profiler import ProfilerActivity, profile

model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16).to("cuda").eval()
ctx, steps = 4096, 4
prep = bench._Prepared(model, "tq_static_compiled", 1, ctx, ctx + 8 * 12 + 16, 0, 8192, "k5v3", None)
prep.fwd = model.forward
launch = fast.decode
flush = torch.empty(100 * 2**20, dtype=torch.uint8, device="cuda")
W = torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16)
x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)

def prof(step, n):
    with profile(activities=[ProfilerActivity.CUDA]) as pr:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    ev = sorted([e for e in pr.events() if e.device_type == torch.autograd.DeviceType.CUDA],
                key=lambda e: e.time_range.start)
    return ev

def wrap_before(fn):
    def w(*a, **k):
        fn()
        return launch(*a, **k)
    return w

modes = {
    "plain": launch,
    "sync_before": wrap_before(torch.cuda.synchronize),
    "fill_before": wrap_before(lambda: flush.fill_(3)),
    "gemv_before": wrap_before(lambda: torch.mm(x, W.t())),
    "sleep_before": wrap_before(lambda: torch.cuda._sleep(40000)),
}
res = {"carveout": CARVE}
for name, w in modes.items():
    fast.decode = w
    try:
        prep.step()
        ev = prof(prep.step, steps)
    finally:
        fast.decode = launch
    tq = [e.time_range.elapsed_us() for e in ev if e.name == fast.NAME]
    # which kernel ran just before each tq_decode, and the gap
    before = {}
    gaps = []
    for i, e in enumerate(ev):
        if e.name == fast.NAME and i:
            p = ev[i - 1]
            before[p.name[:60]] = before.get(p.name[:60], 0) + 1
            gaps.append(e.time_range.start - p.time_range.end)
    res[name] = {"median_us": round(statistics.median(tq), 2), "n": len(tq), "us": [round(v, 2) for v in tq],
                 "before": before, "gap_median_us": statistics.median(gaps) if gaps else None}
    print(name, res[name]["median_us"], len(tq), before, "gap", res[name]["gap_median_us"], flush=True)
# timeline of one plain step: kernel names and durations for layer 1
ev = prof(prep.step, 1)
res["timeline"] = [(e.name[:80], round(e.time_range.elapsed_us(), 2)) for e in ev[:80]]
json.dump(res, open(sys.argv[2], "w"), indent=1)
