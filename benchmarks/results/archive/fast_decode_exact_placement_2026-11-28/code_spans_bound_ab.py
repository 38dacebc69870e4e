"""Timing-only bound (the variants read the wrong code bits): the 5-bit key span of head dim 64 (10 bytes at l4 x 10)
read as one aligned LDS.64 and one LDS.U16 ("kfast"), and also the 3-bit value span (3 bytes at g x 3) as one
LDS.U16 and one LDS.U8 ("kvfast"), the loads a row-level reorder of the packed layout would need.
argv: out cases reps"""
import json, os, statistics, sys, time
sys.path.insert(0, os.getcwd()); sys.path.insert(0, "benchmarks")
import torch
from triton.testing import do_bench_cudagraph
import bench_attention as ba
from tq_hf_cache.kernels import decode_attention as da
from tq_hf_cache.kernels import fast

SRC = fast.source()
HEAD = "  constexpr int NW = Span<SPAN, ROWB>::NW;\n  if constexpr (VEC >= 16 && SPAN % 16 == 0 && ROWB % 16 == 0) {"
assert SRC.count(HEAD) == 1
K = """  constexpr int NW = Span<SPAN, ROWB>::NW;
  if constexpr (SPAN == 10 && ROWB == 40) {
    const uint2 v = *reinterpret_cast<const uint2*>(row + (start / 10) * 8);
    w[0] = v.x; w[1] = v.y; w[2] = *reinterpret_cast<const u16*>(row + 32 + 2 * (start / 10));
  } else """
V = """  if constexpr (SPAN == 3 && ROWB == 24) {
    w[0] = *reinterpret_cast<const u16*>(row + 2 * (start / 3)) | (static_cast<u32>(row[16 + start / 3]) << 16);
  } else """
tail = "if constexpr (VEC >= 16 && SPAN % 16 == 0 && ROWB % 16 == 0) {"
VARS = {"base": SRC, "kfast": SRC.replace(HEAD, K + tail), "kvfast": SRC.replace(HEAD, K + V + tail)}
assert len(set(VARS.values())) == 3
if __name__ == "__main__":
    out, CASES, REPS = sys.argv[1], sys.argv[2].split(";"), int(sys.argv[3])
    rows = []
    for case in CASES:
        shape, preset, bt = case.split("/")
        ba.HQ, ba.HKV, ba.D = ba.SHAPES[shape]
        b, t = map(int, bt.split("x"))
        kb, vb, _ = ba.parse_preset(preset)
        kv, _ = ba.packed_layer(b, t, kb, vb)
        q = torch.randn(b, ba.HQ, 1, ba.D, device="cuda", dtype=torch.bfloat16)
        for v, s in VARS.items():
            fast.source = lambda s=s: s
            da.decode_attention(q, kv)
        sdpa = ba.cudnn_sdpa(b, t)
        times = {"sdpa": [], **{v: [] for v in VARS}}
        for _ in range(REPS):
            times["sdpa"].append(do_bench_cudagraph(sdpa))
            for v, s in VARS.items():
                fast.source = lambda s=s: s
                times[v].append(do_bench_cudagraph(lambda: da.decode_attention(q, kv)))
        med = {k: statistics.median(x) * 1e3 for k, x in times.items()}
        rows.append(dict(case=case, us=med, all_ms=times))
        print(case, " ".join(f"{k} {x:.2f}" for k, x in med.items()), flush=True)
    json.dump(dict(device=torch.cuda.get_device_name(), when=time.strftime("%Y-%m-%d %H:%M"), argv=sys.argv,
                   rows=rows), open(out, "w"), indent=1)
