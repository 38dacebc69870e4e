"""tq_decode's duration per call in SmolLM2 1 x 4k decode steps (TurboQuantStaticCache k5v3): eager, compiled without
CUDA graphs, compiled with them (reduce-overhead, as the benchmarks run); cuDNN SDPA's with StaticCache alike."""
import json, sys
import torch, transformers
from tq_hf_cache import bench
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16).to("cuda").eval()
res = {}
for row, pick in (("tq_static_compiled", "tq_decode"), ("static_compiled", "sdpa")):
    torch._dynamo.reset()
    prep = bench._Prepared(model, row, 1, 4096, 4096 + 64, 3, 8192, "k5v3", None)
    graphs = prep.fwd
    for mode, fwd in (("cudagraphs", graphs), ("eager", model.forward),
                      ("compiled_no_graphs", torch.compile(model.forward, fullgraph=True))):
        prep.fwd = fwd
        for _ in range(3):
            prep.step()
        torch.cuda.synchronize()
        us, calls = bench.kernel_times(prep.step, 4)
        mine = {k: (round(v / max(calls[k], 1), 2), calls[k]) for k, v in us.items() if pick in k or "append" in k or "advance" in k}
        res[f"{row}_{mode}"] = dict(step_us=round(sum(us.values()), 1), per_call=mine)
        print(row, mode, "step", round(sum(us.values()), 1), mine, flush=True)
    del prep
    torch.cuda.empty_cache()
json.dump(res, open(sys.argv[2], "w"), indent=1)
