"""SM clock right before / after each tq_decode launch, in the model's eager step and in isolated replay.
A probe kernel (264 CTAs) spins SPIN cycles and records clock64 / globaltimer deltas. argv: DIR OUT"""
import ctypes, json, os, statistics, sys
import torch, transformers
from torch.profiler import profile, ProfilerActivity
sys.path.insert(0, os.getcwd())
from tq_hf_cache import bench
from tq_hf_cache.kernels import fast
from tq_hf_cache.kernels.fast import jit
SRC = r'''
struct P { unsigned long long* out; int slot; };
extern "C" __global__ void probe(const P p) {
  if (threadIdx.x) return;
  unsigned long long t0, t1;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  long long c0 = clock64(), c1;
  do { c1 = clock64(); } while (c1 - c0 < SPIN);
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
  unsigned long long* o = p.out + (static_cast<long long>(p.slot) * gridDim.x + blockIdx.x) * 2;
  o[0] = c1 - c0; o[1] = t1 - t0;
}
'''
class P(ctypes.Structure):
    _fields_ = [("out", ctypes.c_void_p), ("slot", ctypes.c_int)]
NSLOT, G = 4096, 264
buf = torch.zeros(NSLOT * G * 2, dtype=torch.int64, device="cuda")
kern = jit.kernel(SRC, "probe", {"SPIN": 4000}, torch.device("cuda", 0))
slot = [0]
def probe():
    prm = P(buf.data_ptr(), slot[0] % NSLOT)
    slot[0] += 1
    kern.launch((G, 1, 1), 32, prm, torch.cuda.current_stream().cuda_stream)
def ghz(lo, hi):
    x = buf.view(NSLOT, G, 2)[lo:hi].double().cpu()
    per = x[..., 0] / x[..., 1]  # cycles per ns, per CTA
    return [round(float(v), 3) for v in per.median(dim=1).values]

model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16).to("cuda").eval()
prep = bench._Prepared(model, "tq_static_compiled", 1, 4096, 4096 + 128, 0, 8192, "k5v3", None)
prep.fwd = model.forward
launch = fast.decode
calls = []
def prof(step, n):
    with profile(activities=[ProfilerActivity.CUDA]) as pr:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    return [e.time_range.elapsed_us() for e in sorted(pr.events(), key=lambda e: e.time_range.start)
            if e.device_type == torch.autograd.DeviceType.CUDA and e.name == fast.NAME]
res = {}
def before(*a, **k):
    probe()
    return launch(*a, **k)
def after(*a, **k):
    ok = launch(*a, **k)
    probe()
    return ok
def record(*a, **k):
    calls.append((a, k))
    return launch(*a, **k)
for name, w in (("probe_before", before), ("probe_after", after)):
    fast.decode = w
    prep.step()
    s0 = slot[0]
    us = prof(prep.step, 3)
    torch.cuda.synchronize()
    fast.decode = launch
    clk = ghz(s0, slot[0])
    res["in_model_" + name] = dict(tq_us=statistics.median(us), ghz=statistics.median(clk), ghz_all=clk, us=us)
    print("in_model", name, "tq", round(statistics.median(us), 2), "GHz", statistics.median(clk), min(clk), max(clk), flush=True)
fast.decode = record
prep.step()
fast.decode = launch
torch.cuda.synchronize()
for name in ("probe_before", "probe_after"):
    def step():
        for a, k in calls:
            if name == "probe_before":
                probe()
            launch(*a, **k)
            if name == "probe_after":
                probe()
    step()
    s0 = slot[0]
    us = prof(step, 6)
    torch.cuda.synchronize()
    clk = ghz(s0, slot[0])
    res["replay_" + name] = dict(tq_us=statistics.median(us), ghz=statistics.median(clk), ghz_all=clk)
    print("replay", name, "tq", round(statistics.median(us), 2), "GHz", statistics.median(clk), min(clk), max(clk), flush=True)
json.dump(res, open(sys.argv[2], "w"), indent=1)
