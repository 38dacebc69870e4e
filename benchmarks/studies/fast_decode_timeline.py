"""Where one call of the fast decode kernel spends its time, CTA by CTA (H100, Llama-3.1-8B shape, one query).

The kernel's source is instrumented in memory (timing only): each CTA's thread 0 writes `%globaltimer` when the CTA
starts, when the last split's CTA is done with the exact copies, when its packed loop starts (after its prologue:
query rotation, table fill, first copies) and when it arrives at the merge counter, with `%smid`; the merging CTA
writes when its merge ends. Inside a split's CTA also: warp 0's first tile in the ring and its first tile computed, the
last warp out of the loop, the warps' partials merged in shared memory, and warp 0's second tile in the ring and
computed; inside an exact copies' CTA: its first batch in shared memory, its tokens done, its warps' partials
written; inside the merging CTA: its merge begun (the arrival counter read), its first chunk of the splits'
partials in shared memory (where it stages them), its pass over the splits and its rotation done. From three calls
after two warm-ups per case, the last call's CTAs are summarized (min / median / max): when the exact copies' own CTAs
arrive, or their time in the last splits' CTAs where those take them, the other splits' prologue and loop times and
the parts of each, when each kind arrives, and the merge's length and parts.
Usage:
    python benchmarks/studies/fast_decode_timeline.py [--cases 1x4096,1x131072,8x32768] [--presets k5v3]
        [--shape llama-3.1-8b] --out F
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import bench_attention as ba  # noqa: E402
from tq_hf_cache.kernels import decode_attention as da  # noqa: E402
from tq_hf_cache.kernels import cuda  # noqa: E402

SLOTS = 16  # int64 words a CTA writes: 0 start, 1 arrival, 2 loop start, 3 merge end, 4 SM id, 5 exact copies done,
# 6-15 the parts of a CTA and of the merge (EDITS)

_NOW = 'unsigned long long t_; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_));'
_SLOT = "reinterpret_cast<unsigned long long*>(TL_PTR) + (static_cast<i64>(bh) * gridDim.y + blockIdx.y) * 16"


def _at(k: int, cond: str = "threadIdx.x == 0") -> str:
    """The C statement that writes the time to word k of the CTA's slot, where cond holds."""
    return f"if ({cond}) {{ {_NOW} ({_SLOT})[{k}] = t_; }}"


EDITS = [
    ("  const int bh = blockIdx.x, split = blockIdx.y;\n",
     "  const int bh = blockIdx.x, split = blockIdx.y;\n  unsigned long long* tl_ = " + _SLOT + ";\n"
     "  if (threadIdx.x == 0) { " + _NOW + " tl_[0] = t_; unsigned s_; asm(\"mov.u32 %0, %%smid;\" : \"=r\"(s_)); "
     "tl_[4] = s_; }\n"),
    ("  if (threadIdx.x == 0) {\n    int before;",
     "  if (threadIdx.x == 0) { " + _NOW + " tl_[1] = t_; }\n  if (threadIdx.x == 0) {\n    int before;"),
    ("  merge_last(p, smem, bh, bq);\n}",
     "  " + _at(12) + "\n  merge_last(p, smem, bh, bq);\n  __syncthreads();\n  if (threadIdx.x == 0) { " + _NOW
     + " tl_[3] = t_; }\n}"),
    # inside the merge: 15 its first chunk of the splits' partials in shared memory (where it stages them), 13 its
    # pass over the splits done, 14 its rotation done
    ("      cp_wait<0>();\n      __syncthreads();  // the chunk in shared memory\n",
     "      cp_wait<0>();\n      __syncthreads();  // the chunk in shared memory\n      "
     + _at(15, "c0 == 0 && threadIdx.x == 0") + "\n"),
    ("  __syncthreads();\n#if HAD\n  for (int r = warp;", "  __syncthreads();\n  " + _at(13) + "\n#if HAD\n  for (int r = warp;"),
    ("  __syncthreads();\n\n  // out[r, x]", "  __syncthreads();\n  " + _at(14) + "\n\n  // out[r, x]"),
    ("    __syncthreads();  // the exact partial is out of shared memory\n",
     "    __syncthreads();  // the exact partial is out of shared memory\n    if (threadIdx.x == 0) { " + _NOW + " tl_[5] = t_; }\n"),
    ("  __syncthreads();  // the tables and the query fragments written\n",
     "  __syncthreads();  // the tables and the query fragments written\n"
     "  " + _at(2) + "\n"),
    # inside a split's CTA: 6 warp 0's first tile in the ring, 7 computed, 8 the last warp out of the loop, 9 the
    # warps' partials merged in shared memory, 10 / 11 warp 0's second tile in the ring / computed
    ("  int stage = 0;\n  for (int t = t0; t < end; t += step) {",
     "  int stage = 0, tl_tile = 0;\n  for (int t = t0; t < end; t += step) {"),
    ("    cp_wait<STAGES - 1>();\n    __syncwarp();\n    compute(t, ring + stage * TILE_BYTES, mk);\n"
     "    __syncwarp();  // every lane is done with this stage before it is refilled\n",
     "    cp_wait<STAGES - 1>();\n    __syncwarp();\n"
     "    " + _at(6, "tl_tile == 0 && threadIdx.x == 0") + " " + _at(10, "tl_tile == 1 && threadIdx.x == 0") + "\n"
     "    compute(t, ring + stage * TILE_BYTES, mk);\n"
     "    __syncwarp();  // every lane is done with this stage before it is refilled\n"
     "    " + _at(11, "tl_tile == 1 && threadIdx.x == 0") + " " + _at(7, "tl_tile++ == 0 && threadIdx.x == 0") + "\n"),
    ("  cp_wait<0>();\n\n  // merge the warps' partials",
     "  cp_wait<0>();\n  if (lane == 0) { " + _NOW + " atomicMax(reinterpret_cast<unsigned long long*>(" + _SLOT + ") + 8, t_); }"
     "\n\n  // merge the warps' partials"),
    ("  __syncthreads();\n  store_partial<RQ, true>(",
     "  __syncthreads();\n  " + _at(9) + "\n  store_partial<RQ, true>("),
    # inside an exact copies' CTA (on tensor cores: fp16 / bf16 copies): 6 its first batch in shared memory, 7 its
    # tokens done, 9 its warps' partials
    ("    __syncthreads();  // the batch (and, the first time, the query's fragments) in shared memory\n",
     "    __syncthreads();  // the batch (and, the first time, the query's fragments) in shared memory\n"
     "    " + _at(6, "e0 == e_lo && threadIdx.x == 0") + "\n"),
    ("#pragma unroll\n  for (int i = 0; i < NMROWS; ++i) {\n    l_i[i] += __shfl_xor_sync(0xffffffffu, l_i[i], 1);\n"
     "    l_i[i] += __shfl_xor_sync(0xffffffffu, l_i[i], 2);\n    if (l4 == 0) {",
     "  " + _at(7) + "\n#pragma unroll\n  for (int i = 0; i < NMROWS; ++i) {\n"
     "    l_i[i] += __shfl_xor_sync(0xffffffffu, l_i[i], 1);\n    l_i[i] += __shfl_xor_sync(0xffffffffu, l_i[i], 2);\n"
     "    if (l4 == 0) {"),
    ("  __syncthreads();\n  store_partial<RQ, false>(",
     "  __syncthreads();\n  " + _at(9) + "\n  store_partial<RQ, false>("),
]


def instrumented(src: str) -> str:
    for a, b in EDITS:
        if src.count(a) != 1:
            raise SystemExit(f"the kernel source changed: {a.strip()[:60]!r} is not there once")
        src = src.replace(a, b)
    return src


def spread(v: list[float]) -> dict:
    if not v:  # (no CTA of this kind in the call)
        return None
    return {"min": round(min(v), 2), "median": round(statistics.median(v), 2), "max": round(max(v), 2)}


def one_call(q, kv, tl, b: int) -> dict:
    tl.zero_()
    da.decode_attention(q, kv)
    torch.cuda.synchronize()
    x = tl.view(-1, SLOTS).cpu()
    x = x[x[:, 0] > 0]
    t0 = int(x[:, 0].min())
    us = lambda col: ((col - t0) / 1000).tolist()  # noqa: E731
    exact = x[x[:, 2] == 0]  # the exact copies' own CTAs (no packed loop)
    packed = x[(x[:, 2] > 0) & (x[:, 5] == 0)]
    last = x[x[:, 5] > 0]  # the last splits' CTAs, where they take the exact copies too
    merges = x[x[:, 3] > 0]
    start, loop, arrive = us(packed[:, 0]), us(packed[:, 2]), us(packed[:, 1])
    def part(rows, a, b):  # (a stamp a CTA does not reach stays 0: the merge's staged partials on the direct path)
        return spread([(int(r[a]) - int(r[b])) / 1000 for r in rows if r[a] > 0 and r[b] > 0])
    return {
        "ctas": int(x.shape[0]), "sms": len(set(x[:, 4].tolist())),
        "exact_cta_arrive_us": spread(us(exact[:, 1])),
        "last_split_exact_us": spread([(int(r[5]) - int(r[0])) / 1000 for r in last]),
        "last_split_loop_us": spread([(int(r[1]) - int(r[2])) / 1000 for r in last]),
        "last_split_arrive_us": spread(us(last[:, 1])),
        "packed_start_us": spread(start),
        "packed_prologue_us": spread([lo - s for lo, s in zip(loop, start)]),
        "packed_loop_us": spread([a - lo for a, lo in zip(arrive, loop)]),
        "packed_arrive_us": spread(arrive),
        "packed_first_tile_wait_us": part(packed, 6, 2), "packed_first_tile_compute_us": part(packed, 7, 6),
        "packed_last_warp_out_us": part(packed, 8, 2), "packed_warps_merge_us": part(packed, 9, 8),
        "packed_store_us": part(packed, 1, 9),
        "exact_first_batch_us": part(exact, 6, 0), "exact_tokens_us": part(exact, 7, 6),
        "exact_write_us": part(exact, 9, 7), "exact_store_us": part(exact, 1, 9),
        "packed_second_tile_wait_us": part(packed[packed[:, 10] > 0], 10, 7),
        "packed_second_tile_compute_us": part(packed[packed[:, 10] > 0], 11, 10),
        "merge_us": spread([(int(m[3]) - int(m[1])) / 1000 for m in merges]),
        "merge_arrival_us": part(merges, 12, 1), "merge_splits_us": part(merges, 13, 12),
        "merge_partials_in_us": part(merges, 15, 12),
        "merge_rotation_us": part(merges, 14, 13), "merge_output_us": part(merges, 3, 14),
        "call_us": round((int(merges[:, 3].max()) - t0) / 1000, 2),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="1x4096,1x131072,8x32768")
    ap.add_argument("--presets", default="k5v3")
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    ba.HQ, ba.HKV, ba.D = ba.SHAPES[a.shape]
    tl = torch.zeros(1 << 20, dtype=torch.int64, device="cuda")
    src = instrumented(cuda.source())
    cuda.source = lambda: src
    defines = cuda.defines
    cuda.defines = lambda *x, **k: {**defines(*x, **k), "TL_PTR": tl.data_ptr()}
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "command": " ".join(sys.argv),
           "rows": []}
    for case in a.cases.split(","):
        b, t = map(int, case.split("x"))
        for preset in a.presets.split(","):
            kb, vb = map(int, preset[1:].split("v"))
            kv, _ = ba.packed_layer(b, t, kb, vb)
            q = torch.randn(b, ba.HQ, 1, ba.D, device="cuda", dtype=torch.bfloat16)
            for _ in range(2):
                one_call(q, kv, tl, b)
            calls = [one_call(q, kv, tl, b) for _ in range(3)]
            row = {"case": case, "preset": preset, **calls[-1],
                   "call_us_each": [c["call_us"] for c in calls]}
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
            del kv
            torch.cuda.empty_cache()
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
