"""Host-side time of compiled decode steps: StaticCache against TurboQuantStaticCache, per step, top CPU ops."""
import json, sys, time, statistics
import torch, transformers
from tq_hf_cache import bench
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16).to("cuda").eval()
out = {}
for row in ("static_compiled", "tq_static_compiled"):
    torch._dynamo.reset()
    prep = bench._Prepared(model, row, 1, 4096, 4096 + 200, 4, 8192, "k5v3", None)
    model.set_attn_implementation(prep.attn)
    # host time of a step without waiting for the GPU: launch only, then sync
    launch = []
    for _ in range(30):
        torch.cuda.synchronize(); t = time.perf_counter(); prep.step(); launch.append((time.perf_counter() - t) * 1e3)
        torch.cuda.synchronize()
    walls = prep.time_steps(30)
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU]) as pr:
        for _ in range(10):
            prep.step()
        torch.cuda.synchronize()
    ka = pr.key_averages()
    top = sorted(ka, key=lambda e: -e.self_cpu_time_total)[:30]
    out[row] = dict(host_ms_median=statistics.median(launch), wall_ms_median=statistics.median(walls),
                    top=[dict(name=e.key[:120], self_cpu_us_per_step=e.self_cpu_time_total / 10, calls_per_step=e.count / 10,
                              cpu_total_us_per_step=e.cpu_time_total / 10) for e in top])
    print(row, "host", round(out[row]["host_ms_median"], 3), "wall", round(out[row]["wall_ms_median"], 3), flush=True)
    for e in out[row]["top"][:15]:
        print("   ", f"{e['self_cpu_us_per_step']:8.1f} us self {e['cpu_total_us_per_step']:8.1f} total {e['calls_per_step']:6.1f}x", e["name"][:90])
    del prep
    torch.cuda.empty_cache()
json.dump(out, open(sys.argv[2], "w"), indent=1)
