"""Where in a layer does the slow state of the first tq_decode launch come from? An extra launch (the last call's
arguments) placed at one point of each layer; the layer's own launch timed after it. argv: DIR OUT"""
import json, os, statistics, sys
import torch, transformers
from torch.profiler import profile, ProfilerActivity
sys.path.insert(0, os.getcwd())
from tq_hf_cache import bench
from tq_hf_cache.kernels import fast, quantize
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16).to("cuda").eval()
prep = bench._Prepared(model, "tq_static_compiled", 1, 4096, 4096 + 128, 0, 8192, "k5v3", None)
prep.fwd = model.forward
launch = fast.decode
last, tags, where = [], [], [None]

def warm(pos):
    if where[0] == pos and last:
        a, k = last[0]
        tags.append("warm")
        launch(*a, **k)

def real(*a, **k):
    warm("T")
    last[:] = [(a, k)]
    tags.append("real")
    return launch(*a, **k)

class Wrap:
    def __init__(self, f, pos):
        self.f, self.pos = f, pos
    def __getitem__(self, g):
        run = self.f[g]
        def call(*a, **k):
            warm(self.pos)
            return run(*a, **k)
        return call
quantize._append_kv_kernel = Wrap(quantize._append_kv_kernel, "P")
quantize._advance_kernel = Wrap(quantize._advance_kernel, "V")
for layer in model.model.layers:
    layer.register_forward_pre_hook(lambda m, a: warm("L"))
    layer.self_attn.register_forward_pre_hook(lambda m, a: warm("A"))
    layer.self_attn.o_proj.register_forward_hook(lambda m, a, o: warm("O"))  # right after the launch's consumer
    layer.mlp.register_forward_pre_hook(lambda m, a: warm("M"))
    layer.mlp.down_proj.register_forward_pre_hook(lambda m, a: warm("D"))
fast.decode = real
res = {}
for rep in range(2):
    for pos in ("none", "L", "A", "P", "V", "T", "O", "M", "D"):
        where[0] = pos
        prep.step()
        torch.cuda.synchronize()
        tags.clear()
        with profile(activities=[ProfilerActivity.CUDA]) as pr:
            for _ in range(3):
                prep.step()
            torch.cuda.synchronize()
        us = [e.time_range.elapsed_us() for e in sorted(pr.events(), key=lambda e: e.time_range.start)
              if e.device_type == torch.autograd.DeviceType.CUDA and e.name == fast.NAME]
        assert len(us) == len(tags), (len(us), len(tags))
        r = [u for u, t in zip(us, tags) if t == "real"]
        w = [u for u, t in zip(us, tags) if t == "warm"]
        row = dict(real_us=statistics.median(r), n=len(r), warm_us=statistics.median(w) if w else None, nw=len(w))
        res.setdefault(pos, []).append(row)
        print(rep, pos, {k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
json.dump(res, open(sys.argv[2], "w"), indent=1)
