"""Per-layer decode attention: the fused kernel on packed K/V against SDPA on bf16 K/V, and against its byte floor.

One Llama-3.1-8B-shaped layer (32 query heads, 8 KV heads, head dim 128; --shape names others), one query token,
bf16. For each preset, batch and context: the fused kernel (`kernels.decode_attention.decode_attention` on a dynamic
layer's `PackedKV`: random codes and norms, a 128-token residual window, 4 sink tokens) and SDPA with GQA on bf16
K/V of the same length (cuDNN where torch offers it, else the backend torch picks; the JSON names it); with
--workspace 1, also the path of layers without the fused kernel (dequantize K and V into bf16, then SDPA). All are
timed as CUDA graph replays (`triton.testing.do_bench_cudagraph`, median), so host launch cost is out of all; each
replays one input set, so a row whose inputs fit in L2 (SDPA's at 1 x 4k) measures L2 (the one-layer study,
`studies/fast_decode_study.py`, cycles its inputs past L2 with `cold_sets` and `time_sets` below). The
byte floor is the bytes the kernel must read (codes, norms, residual, sinks, query) at the device-to-device copy
bandwidth (bytes read + written per second) measured in the same run. The workspace path's dequantize is timed per
width against the same copy bandwidth (1 to 8 bits; --dequant_sweep 1 also times its knobs, each variant's output
checked against the default's). A last part sweeps the kernel's tuning knobs (BLOCK_N, programs per SM, Triton
stages) at batch 1 / 128k and batch 8 / 32k, each variant's output checked against the default's.

A preset may name split keys (`key_split`) after a colon: "k4v2:32x6+32x4+64x3" splits each key into 32 channels
at 6 bits, 32 at 4 and 64 at 3 (a random channel order per KV head; the values keep the preset's width).

Usage: python benchmarks/bench_attention.py [--presets k5v3,k4v4,k4v2] [--contexts 4096,32768,131072]
       [--batches 1,8] [--sweep 1] [--dequant 1] [--dequant_sweep 0] [--shape llama-3.1-8b] [--workspace 0]
       [--out DIR]
                                                                  writes DIR/bench_attention.json and .png
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from triton.testing import do_bench_cudagraph  # noqa: E402

from tq_hf_cache import TurboQuantConfig, kernels  # noqa: E402
from tq_hf_cache.quant.codebook import theoretical_codebook  # noqa: E402
from tq_hf_cache.quant.pair_codebook import theoretical_pair_codebook  # noqa: E402
from tq_hf_cache.kernels import decode_attention as da  # noqa: E402
from tq_hf_cache.kernels import dequantize  # noqa: E402
from tq_hf_cache.quant.packed_kv import PackedKV  # noqa: E402
from tq_hf_cache.quant.packing import packed_bytes  # noqa: E402
from tq_hf_cache.quant.rotation import make_rotation  # noqa: E402

HQ, HKV, D, RESIDUAL, SINKS = 32, 8, 128, 128, 4
SHAPES = {"llama-3.1-8b": (32, 8, 128), "gemma-3-12b": (16, 8, 256), "gemma-3-4b": (8, 4, 256),
          "smollm2-1.7b": (32, 32, 64)}  # (Hq, Hkv, D)
DEV = torch.device("cuda")
SWEEP_CASES = ((1, 131072), (8, 32768))  # (batch, context) of the knob sweep


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth (bytes read + written per second) of a 1 GiB buffer."""
    src = torch.empty(2**30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    ms = do_bench_cudagraph(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3)


COLD_L2 = 4  # the input sets a timing cycles through hold together at least this many times the L2 cache


def cold_sets(nbytes: int) -> int:
    """How many independent input sets of `nbytes` bytes a timing cycles through so that no call finds its inputs in
    L2 from its last turn: together at least COLD_L2 times the L2 cache, at least one. A model's layers do the same:
    each reads its own K/V once a step, with every other layer's K/V and weights read in between."""
    l2 = torch.cuda.get_device_properties(DEV).L2_cache_size
    return max(1, -(-COLD_L2 * l2 // nbytes))


def time_sets(calls) -> float:
    """Median ms of one call, from CUDA-graph replays of a graph that makes every call of `calls` in turn."""
    return do_bench_cudagraph(lambda: [c() for c in calls]) / len(calls)


def sdpa_bytes(b: int, t: int) -> int:
    """Bytes cuDNN SDPA reads in one call at batch b and t tokens: the bf16 keys and values, and the query."""
    return 2 * b * HKV * t * D * 2 + b * HQ * D * 2


def parse_preset(name: str) -> tuple[int, int, list[tuple[int, int]] | None, str]:
    """(key bits, value bits, split parts [(channels, bits)] or None, codes) of "k4v2" or "k4v2:32x6+32x4+64x3"."""
    preset, _, split = name.partition(":")
    cfg = TurboQuantConfig.from_preset(preset)
    parts = [tuple(int(x) for x in p.split("x")) for p in split.split("+")] if split else None
    return cfg.key_bits, cfg.value_bits, parts, cfg.codes


def split_keys(kv: PackedKV, parts: list[tuple[int, int]]) -> tuple[PackedKV, int]:
    """kv with its keys split in `parts` [(channels, bits)], random codes and norms; and the bytes its keys add."""
    from dataclasses import replace

    from tq_hf_cache.quant.key_split import check_spec, make_split

    b, _, lq, _ = kv.k_packed.shape
    sizes, bits = [n for n, _ in parts], [w for _, w in parts]
    spec = check_spec({"sizes": sizes, "bits": bits, "order": [torch.randperm(D).tolist() for _ in range(HKV)]}, 0)
    split = make_split(spec, 0, HKV, D, lambda n: make_rotation(n, 0), theoretical_codebook).to(DEV)
    key_parts = tuple((torch.randint(0, 256, (b, HKV, lq, packed_bytes(n, w)), dtype=torch.uint8, device=DEV),
                       torch.rand(b, HKV, lq, device=DEV).add_(1).half()) for n, w in parts)
    added = sum(p.numel() + nm.numel() * 2 for p, nm in key_parts) - kv.k_packed.numel() - kv.k_norms.numel() * 2
    kv = replace(kv, k_packed=key_parts[0][0], k_norms=key_parts[0][1], k_codebook=split.parts[0][1],
                 key_split=split, key_parts=key_parts)
    return kv, added


def packed_layer(b: int, t: int, kbits: int, vbits: int, split=None, codes: str = "scalar") -> tuple[PackedKV, int]:
    """A dynamic layer's PackedKV of t positions (t - RESIDUAL packed) and the bytes a step reads of it; `split`:
    its keys split in these [(channels, bits)] parts; `codes`: "scalar" or "pair" codebooks."""
    lq = t - RESIDUAL
    rot = make_rotation(D, 0).to(DEV)
    book = theoretical_pair_codebook if codes == "pair" else theoretical_codebook
    kcb, vcb = book(kbits, D).to(DEV), book(vbits, D).to(DEV)
    kp = torch.randint(0, 256, (b, HKV, lq, packed_bytes(D, kbits)), dtype=torch.uint8, device=DEV)
    vp = torch.randint(0, 256, (b, HKV, lq, packed_bytes(D, vbits)), dtype=torch.uint8, device=DEV)
    kn = torch.rand(b, HKV, lq, device=DEV).add_(1).half()
    vn = torch.rand(b, HKV, lq, device=DEV).add_(1).half()
    rk = torch.randn(b, HKV, RESIDUAL, D, device=DEV, dtype=torch.bfloat16)
    rv = torch.randn_like(rk)
    sk, sv = rk[:, :, :SINKS].clone(), rv[:, :, :SINKS].clone()
    kv = PackedKV(kp, kn, vp, vn, sk, sv, rk, rv, t, lq, rot, kcb, vcb, SINKS, -1, -1)
    nbytes = sum(x.numel() * x.element_size() for x in (kp, vp, kn, vn, rk, rv, sk, sv))
    if split:
        kv, added = split_keys(kv, split)
        nbytes += added
    return kv, nbytes + b * HQ * D * 2


def cudnn_sdpa(b: int, t: int):
    """A call of cuDNN SDPA on random bf16 K/V of this layer's shape (batch b, t tokens, one query), run once."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(b, HQ, 1, D, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(b, HKV, t, D, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)

    def sdpa():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    sdpa()
    return sdpa


def sdpa_time(b: int, t: int) -> tuple[float, str]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(b, HQ, 1, D, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(b, HKV, t, D, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    f = torch.nn.functional.scaled_dot_product_attention
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        try:
            with sdpa_kernel([backend]):
                f(q, k, v, enable_gqa=True)
                ms = do_bench_cudagraph(lambda: f(q, k, v, enable_gqa=True))
            return ms, backend.name
        except RuntimeError:
            continue
    ms = do_bench_cudagraph(lambda: f(q, k, v, enable_gqa=True))
    return ms, "default"


def kernel_time(kv: PackedKV, b: int, **knobs) -> tuple[float, torch.Tensor]:
    """(median ms, the output of one call); the query is the same for every call with the same batch."""
    q = torch.randn(b, HQ, 1, D, device=DEV, dtype=torch.bfloat16, generator=torch.Generator(DEV).manual_seed(b))
    out = da.decode_attention(q, kv, None, None, **knobs)  # compile, grow the scratch: outside the graph
    torch.cuda.synchronize()  # do_bench_cudagraph works on a side stream that does not wait for this one
    return do_bench_cudagraph(lambda: da.decode_attention(q, kv, None, None, **knobs)), out


def workspace_path(kv: PackedKV, b: int):
    """The workspace path of one step (what layers without the fused kernel run) as a callable: the packed keys and
    values dequantized into bf16 buffers, then SDPA (the backend torch picks) over them; run once."""
    lq = kv.k_packed.shape[2]
    kw = torch.empty(b, HKV, lq, D, device=DEV, dtype=torch.bfloat16)
    vw = torch.empty_like(kw)
    q = torch.randn(b, HQ, 1, D, device=DEV, dtype=torch.bfloat16)

    def step():
        kernels.dequantize_into(kv.k_packed, kv.k_norms, kv.rotation, kv.k_codebook, kw)
        kernels.dequantize_into(kv.v_packed, kv.v_norms, kv.rotation, kv.v_codebook, vw)
        return torch.nn.functional.scaled_dot_product_attention(q, kw, vw, enable_gqa=True)

    step()
    torch.cuda.synchronize()
    return step


def workspace_time(kv: PackedKV, b: int) -> float:
    """The workspace path's median ms of CUDA-graph replays (`workspace_path`)."""
    return do_bench_cudagraph(workspace_path(kv, b))


def dequant_row(bits: int, bw: float, b: int = 1, t: int = 32768, **knobs) -> dict:
    """The workspace path's dequantize (packed + norms -> bf16 K or V) of one layer at batch b, context t: time and
    bytes moved (read + written) against the copy bandwidth. With knobs: also the largest difference from the
    default knobs' output."""
    kv, _ = packed_layer(b, t + RESIDUAL, bits, bits)
    out = torch.empty(b, HKV, t, D, device=DEV, dtype=torch.bfloat16)
    want = None
    if knobs:
        want = torch.empty_like(out)
        kernels.dequantize_into(kv.k_packed, kv.k_norms, kv.rotation, kv.k_codebook, want)
    f = lambda: kernels.dequantize_into(kv.k_packed, kv.k_norms, kv.rotation, kv.k_codebook, out, **knobs)  # noqa: E731
    f()
    torch.cuda.synchronize()
    ms = do_bench_cudagraph(f)
    moved = kv.k_packed.numel() + kv.k_norms.numel() * 2 + out.numel() * 2
    unit = knobs.get("words", dequantize.word_unit(kv.k_packed, bits))
    r = {"bits": bits, "batch": b, "context": t, **knobs, "words": unit, "dequantize_ms": round(ms, 4),
         "bytes_moved": moved,
         "GBps": round(moved / (ms * 1e-3) / 1e9, 1), "fraction_of_copy_bw": round(moved / bw / (ms * 1e-3), 3)}
    if want is not None:
        r["max_abs_diff_vs_default"] = float((out.float() - want.float()).abs().max())
    return r


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--presets", default="k5v3,k4v4,k4v2")
    p.add_argument("--contexts", default="4096,32768,131072")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--sweep", type=int, default=1)
    p.add_argument("--dequant", type=int, default=1)
    p.add_argument("--dequant_sweep", type=int, default=0, help="also time the dequantize's knobs per width")
    p.add_argument("--dequant_bits", default="1,2,3,4,5,6,7,8", help="the widths of the dequantize rows and sweep")
    p.add_argument("--dequant_words", default="", help="e.g. 4,8: also time the group widths (3, 5, 6, 7) with packed "
                   "rows read in each of these units (int32 / int64 words)")
    p.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES),
                   help="one layer's query / KV heads and head dim")
    p.add_argument("--workspace", type=int, default=0, help="also time the workspace path (dequantize + SDPA)")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    a = p.parse_args()
    global HQ, HKV, D
    HQ, HKV, D = SHAPES[a.shape]
    t0 = time.time()
    bw = copy_bandwidth()
    env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_GBps": round(bw / 1e9, 1),
           "shape": {"name": a.shape, "query_heads": HQ, "kv_heads": HKV, "head_dim": D}}
    print(env, flush=True)
    rows = []
    sdpa_cache = {}
    for preset, b, t in itertools.product(a.presets.split(","), map(int, a.batches.split(",")),
                                          map(int, a.contexts.split(","))):
        kv, nbytes = packed_layer(b, t, *parse_preset(preset))
        ms, _ = kernel_time(kv, b)
        if (b, t) not in sdpa_cache:
            sdpa_cache[(b, t)] = sdpa_time(b, t)
        sdpa_ms, backend = sdpa_cache[(b, t)]
        floor_ms = nbytes / bw * 1e3  # the kernel's bytes moved at the copy's (read + write) bandwidth
        row = {"preset": preset, "batch": b, "context": t, "kernel_ms": round(ms, 4), "sdpa_ms": round(sdpa_ms, 4),
               "sdpa_backend": backend, "speedup_vs_sdpa": round(sdpa_ms / ms, 3), "bytes_read": nbytes,
               "byte_floor_ms": round(floor_ms, 4), "GBps": round(nbytes / (ms * 1e-3) / 1e9, 1),
               "fraction_of_copy_bw": round(floor_ms / ms, 3)}
        if a.workspace:
            ws = workspace_time(kv, b)
            row.update(workspace_ms=round(ws, 4), speedup_vs_workspace=round(ws / ms, 3))
        rows.append(row)
        print(row, flush=True)
        del kv
        torch.cuda.empty_cache()
    sweep = []
    if a.sweep:
        for b, t in SWEEP_CASES:
            kv, nbytes = packed_layer(b, t, 5, 3)
            _, want = kernel_time(kv, b)
            for block_n, warps, per_sm, stages in itertools.product((16, 32, 64), (1,), (4, 6, 8), (1, 2)):
                splits = kernels.num_splits_for(b * HKV, t - RESIDUAL, DEV, per_sm)
                try:
                    ms, out = kernel_time(kv, b, block_n=block_n, num_warps=warps, num_splits=splits, num_stages=stages)
                except Exception as e:  # noqa: BLE001  (a variant that does not compile: reported, not fatal)
                    ms, err = None, f"{type(e).__name__}: {str(e)[:120]}"
                else:
                    err = None
                r = {"batch": b, "context": t, "preset": "k5v3", "block_n": block_n, "num_warps": warps,
                     "programs_per_sm": per_sm, "num_splits": splits, "num_stages": stages, "kernel_ms": None if ms is None else round(ms, 4)}
                if err:
                    r["error"] = err
                else:  # every variant must compute the default's function
                    r["max_abs_diff_vs_default"] = float((out.float() - want.float()).abs().max())
                sweep.append(r)
                print(r, flush=True)
            del kv
            torch.cuda.empty_cache()
    dq_bits = [int(x) for x in a.dequant_bits.split(",")]
    dequant = [dequant_row(bits, bw) for bits in dq_bits] if a.dequant else []
    units = [int(x) for x in a.dequant_words.split(",") if x]
    dequant += [dequant_row(bits, bw, words=u) for bits in dq_bits if bits in dequantize.WIDE_WORDS for u in units]
    for r in dequant:
        print(r, flush=True)
    dequant_sweep = []
    if a.dequant_sweep:
        for bits in dq_bits:
            for block_t, warps, per_sm, stages in itertools.product((64, 128), (4, 8), (0, 2, 4), (1, 2)):
                r = dequant_row(bits, bw, block_t=block_t, num_warps=warps, progs_per_sm=per_sm, stages=stages)
                dequant_sweep.append(r)
                print(r, flush=True)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "bench_attention.json")
    with open(path, "w") as f:
        json.dump({"env": env, "rows": rows, "sweep": sweep, "dequant": dequant, "dequant_sweep": dequant_sweep,
                   "seconds": round(time.time() - t0, 1)}, f, indent=1)
    plot(rows, os.path.join(a.out, "bench_attention.png"), env["device"])
    print("wrote", path)
    print(f"{'preset':7} {'batch':>5} {'context':>8} {'kernel ms':>10} {'SDPA ms':>8} {'speedup':>8} {'of copy bw':>10}")
    for r in rows:
        print(f"{r['preset']:7} {r['batch']:5} {r['context']:8} {r['kernel_ms']:10.4f} {r['sdpa_ms']:8.4f} "
              f"{r['speedup_vs_sdpa']:8.2f} {r['fraction_of_copy_bw']:10.2f}")


def plot(rows, path, device):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["batch"], r["context"]) for r in rows})
    presets = list(dict.fromkeys(r["preset"] for r in rows))
    fig, ax = plt.subplots(figsize=(2 + 1.8 * len(keys), 4))
    w = 0.8 / (len(presets) + 1)
    xs = range(len(keys))
    sd = [next(r["sdpa_ms"] for r in rows if (r["batch"], r["context"]) == k) for k in keys]
    ax.bar([x for x in xs], sd, w, label="SDPA, bf16 K/V")
    for i, pr in enumerate(presets):
        ys = [next((r["kernel_ms"] for r in rows if r["preset"] == pr and (r["batch"], r["context"]) == k), 0)
              for k in keys]
        ax.bar([x + (i + 1) * w for x in xs], ys, w, label=f"fused, {pr}")
    ax.set_xticks([x + 0.4 - w / 2 for x in xs], [f"b{b} / {c // 1024}k" for b, c in keys])
    ax.set_yscale("log")
    ax.set_ylabel("ms per layer (CUDA graph replay, median)")
    ax.set_title(f"decode attention, one layer, {device}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
