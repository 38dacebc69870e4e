"""In-model (eager, SmolLM2 shape, TurboQuantStaticCache k5v3) tq_decode per plan: first launch (the model's cold
code) and the same launch again (warm). Plans override kernels.fast.choose / exact_parts. Then StaticCache's SDPA
kernels in the same model. argv: DIR OUT [context]"""
import json, os, statistics, sys
import torch, transformers
from torch.profiler import profile, ProfilerActivity
sys.path.insert(0, os.getcwd())
from tq_hf_cache import bench
from tq_hf_cache.kernels import fast
ctx = int(sys.argv[3]) if len(sys.argv) > 3 else 4096
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16).to("cuda").eval()
prep = bench._Prepared(model, "tq_static_compiled", 1, ctx, ctx + 128, 0, 8192, "k5v3", None)
prep.fwd = model.forward
launch, choose0, parts0 = fast.decode, fast.choose, fast.exact_parts
seen = {}
def twice(*a, **k):
    seen["plan"] = (a[22], a[18], a[19], a[23] if len(a) > 23 else k.get("parts", 1))
    ok = launch(*a, **k)
    launch(*a, **k)
    return ok
def durs():
    with profile(activities=[ProfilerActivity.CUDA]) as pr:
        for _ in range(3):
            prep.step()
        torch.cuda.synchronize()
    return [e.time_range.elapsed_us() for e in sorted(pr.events(), key=lambda e: e.time_range.start)
            if e.device_type == torch.autograd.DeviceType.CUDA and e.name == fast.NAME]
plans = {"current": None, "u3": (16, 3, 0), "u2": (16, 2, 0), "f3": (16, 3, 896), "w8_7": (8, 7, 0), "w8_6": (8, 6, 0),
         "u4": (16, 4, 0)}
res = {}
for rep in range(2):
    for name, pl in plans.items():
        if pl is not None:
            fast.choose = lambda *a, pl=pl, **k: pl
        else:
            fast.choose = choose0
        fast.decode = twice
        try:
            prep.step()
            us = durs()
        except Exception as e:  # (a plan the scratch cannot hold)
            print(name, "failed", repr(e)[:200], flush=True)
            continue
        finally:
            fast.decode, fast.choose = launch, choose0
        row = dict(plan=seen["plan"], first=statistics.median(us[0::2]), again=statistics.median(us[1::2]), n=len(us) // 2)
        res.setdefault(name, []).append(row)
        print(rep, name, row, flush=True)
del prep
torch.cuda.empty_cache()
prep = bench._Prepared(model, "static_compiled", 1, ctx, ctx + 128, 0, 8192, "k5v3", None)
prep.fwd = model.forward
prep.step()
us, calls = bench.kernel_times(prep.step, 3)
res["static_sdpa_eager"] = {k: (round(v, 2), calls[k]) for k, v in us.items() if calls[k] >= 23}
print({k[:60]: v for k, v in res["static_sdpa_eager"].items()}, flush=True)
json.dump(res, open(sys.argv[2], "w"), indent=1)
