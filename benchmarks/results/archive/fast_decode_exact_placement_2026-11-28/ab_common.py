"""What this folder's A/B scripts share (run from the repository root on a GPU): for each case
"shape/preset/BxT", a random packed layer of that shape, each variant set up (`setv(name)`) and called once (its
kernel built), an optional check, then REPS interleaved rounds of CUDA-graph timings, cuDNN SDPA first in each; one
JSON row a case (us medians, every ms) and a printed line."""
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.getcwd())
sys.path.insert(0, "benchmarks")
import torch  # noqa: E402
from triton.testing import do_bench_cudagraph  # noqa: E402

import bench_attention as ba  # noqa: E402
from tq_hf_cache.kernels import decode_attention as da  # noqa: E402
from tq_hf_cache.kernels import fast  # noqa: E402

__all__ = ["da", "fast", "run"]  # (the scripts patch fast and call da)


def run(variants, setv, check=None):
    """argv: out cases reps; `check(q, kv)` (optional) returns extra fields for a case's row."""
    out, cases, reps = sys.argv[1], sys.argv[2].split(";"), int(sys.argv[3])
    rows = []
    for case in cases:
        shape, preset, bt = case.split("/")
        ba.HQ, ba.HKV, ba.D = ba.SHAPES[shape]
        b, t = map(int, bt.split("x"))
        kb, vb, _ = ba.parse_preset(preset)
        kv, _ = ba.packed_layer(b, t, kb, vb)
        q = torch.randn(b, ba.HQ, 1, ba.D, device="cuda", dtype=torch.bfloat16)
        for v in variants:
            setv(v)
            da.decode_attention(q, kv)
        extra = check(q, kv) if check else {}
        sdpa = ba.cudnn_sdpa(b, t)
        times = {"sdpa": [], **{v: [] for v in variants}}
        for _ in range(reps):
            times["sdpa"].append(do_bench_cudagraph(sdpa))
            for v in variants:
                setv(v)
                times[v].append(do_bench_cudagraph(lambda: da.decode_attention(q, kv)))
        med = {k: statistics.median(x) * 1e3 for k, x in times.items()}
        rows.append(dict(case=case, **extra, us=med, all_ms=times))
        print(case, extra, " ".join(f"{k} {x:.2f}" for k, x in med.items()), flush=True)
    with open(out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), when=time.strftime("%Y-%m-%d %H:%M"), argv=sys.argv,
                       rows=rows), f, indent=1)
