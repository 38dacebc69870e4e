"""base (b1ff60c's decode_mma.cu) against the tree's source (`ticket.patch` applied): NCHECK calls of the tree's,
eager and replayed from a CUDA graph, compared bit for bit with base's output (the arrival protocol must not change a
bit, call after call), then interleaved timings. argv: out cases reps ncheck (run 11; `ab_common.py` factored out of
it after the run)"""
import subprocess
import sys

import torch

import ab_common as ab

fast, da = ab.fast, ab.da
SRC = {"base": subprocess.run(["git", "show", "b1ff60c:tq_hf_cache/kernels/fast/decode_mma.cu"], check=True,
                              capture_output=True, text=True).stdout, "new": fast.source()}
NCHECK = int(sys.argv[4])


def setv(v):
    fast.source = lambda: SRC[v]


def check(q, kv):
    setv("base")
    ref = da.decode_attention(q, kv).clone()
    setv("new")
    bad = sum(int(not torch.equal(da.decode_attention(q, kv), ref)) for _ in range(NCHECK))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        og = da.decode_attention(q, kv)
    for _ in range(NCHECK):
        g.replay()
        bad += int(not torch.equal(og, ref))
    return dict(mismatches=bad, checked=2 * NCHECK)


if __name__ == "__main__":
    ab.run(list(SRC), setv, check)
