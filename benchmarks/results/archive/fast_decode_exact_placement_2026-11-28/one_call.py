"""One layer's decode attention, warmed up, then called once more (for ncu: -k tq_decode --launch-skip 5
--launch-count 1). argv: shape preset batch history"""
import os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, "benchmarks")
import torch
import bench_attention as ba
from tq_hf_cache.kernels import decode_attention as da
shape, preset, b, t = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
ba.HQ, ba.HKV, ba.D = ba.SHAPES[shape]
kb, vb, _ = ba.parse_preset(preset)
kv, _ = ba.packed_layer(b, t, kb, vb)
q = torch.randn(b, ba.HQ, 1, ba.D, device="cuda", dtype=torch.bfloat16)
for _ in range(6):
    da.decode_attention(q, kv)
torch.cuda.synchronize()
