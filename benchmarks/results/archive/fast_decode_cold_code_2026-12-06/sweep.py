"""In-model (eager) tq_decode at SmolLM2's shape, k5v3: the current plan against the 8-warp plan (fast.plan with 8
warps: two CTAs an SM, exact copies' CTAs of their own), first launch (cold code) and again (warm); StaticCache's
cuDNN SDPA (attention + reduction) in the same model. argv: DIR OUT"""
import json, os, statistics, sys
import torch, transformers
from torch.profiler import profile, ProfilerActivity
sys.path.insert(0, os.getcwd())
from tq_hf_cache import bench
from tq_hf_cache.kernels import fast
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16).to("cuda").eval()
launch, choose0 = fast.decode, fast.choose
seen = {}
def twice(*a, **k):
    seen["plan"] = (a[22], a[18], a[19], a[23] if len(a) > 23 else k.get("parts", 1))
    ok = launch(*a, **k)
    launch(*a, **k)
    return ok
def w8(bh, packed_len, device, most, d, nq, warps):
    return (8, *fast.plan(bh, packed_len, device, most, 8, d, nq))
res = {}
for b, ctx in ((1, 4096), (1, 12288), (1, 16384), (1, 24576), (2, 4096), (4, 4096)):
    prep = bench._Prepared(model, "tq_static_compiled", b, ctx, ctx + 128, 0, 8192, "k5v3", None)
    prep.fwd = model.forward
    for rep in range(2):
        for name, ch in (("current", choose0), ("w8", w8)):
            fast.choose, fast.decode = ch, twice
            try:
                prep.step()
                with profile(activities=[ProfilerActivity.CUDA]) as pr:
                    for _ in range(3):
                        prep.step()
                    torch.cuda.synchronize()
            except Exception as e:
                print(b, ctx, name, "failed", repr(e)[:200], flush=True)
                continue
            finally:
                fast.choose, fast.decode = choose0, launch
            us = [e.time_range.elapsed_us() for e in sorted(pr.events(), key=lambda e: e.time_range.start)
                  if e.device_type == torch.autograd.DeviceType.CUDA and e.name == fast.NAME]
            row = dict(plan=seen["plan"], first=round(statistics.median(us[0::2]), 2),
                       again=round(statistics.median(us[1::2]), 2), n=len(us) // 2)
            res.setdefault(f"{b}x{ctx}", {}).setdefault(name, []).append(row)
            print(b, ctx, rep, name, row, flush=True)
    del prep
    torch.cuda.empty_cache()
    prep = bench._Prepared(model, "static_compiled", b, ctx, ctx + 128, 0, 8192, "k5v3", None)
    prep.fwd = model.forward
    prep.step()
    us, calls = bench.kernel_times(prep.step, 3)
    sd = sum(v for k, v in us.items() if "sdpa" in k or "lean_reduction" in k) / 24
    res[f"{b}x{ctx}"]["sdpa_us"] = round(sd, 2)
    res[f"{b}x{ctx}"]["sdpa_kernels"] = {k: round(v / 24, 2) for k, v in us.items() if "sdpa" in k or "lean_reduction" in k}
    print(b, ctx, "sdpa", round(sd, 2), flush=True)
    del prep
    torch.cuda.empty_cache()
json.dump(res, open(sys.argv[2], "w"), indent=1)
