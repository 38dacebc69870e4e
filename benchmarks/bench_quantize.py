"""Check, then time, the Triton quantize/dequantize kernels on a Llama-3.1-8B-shaped layer (8 KV heads, D=128, bf16).

    PYTHONPATH=. python benchmarks/bench_quantize.py --out benchmarks/results

(a) correctness on CUDA against the torch reference (index mismatch fraction, norms, dequantized error);
(b) a device-to-device copy (bytes read + written) as the bandwidth ceiling, then each kernel's median time
    (triton.testing.do_bench) and achieved bandwidth, bytes read + written, over B in {1, 8}, T in {4096,
    32768}, bits in --bits (default {2, 3, 4, 5, 8}); rotation / block-size / centroid-term variants at one size;
(c) the decode step: 32 layers x (K, V) quantize of one token, host wall time per step and GPU time of a
    captured CUDA graph of it;
(d) JSON and a PNG plot in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch
import triton
from triton.testing import do_bench

from tq_hf_cache import ops, reference
from tq_hf_cache.quant.codebook import Codebook, theoretical_codebook
from tq_hf_cache.kernels import dequantize as DQ
from tq_hf_cache.kernels import quantize as Q
from tq_hf_cache.quant.packing import packed_bytes, unpack_indices
from tq_hf_cache.quant.rotation import make_rotation

H, D = 8, 128
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: --quick dry run under TRITON_INTERPRET=1


def codebook(bits: int) -> Codebook:
    """The Lloyd-Max codebook for D=128, what the presets use."""
    return theoretical_codebook(bits, D)


def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def med(fn) -> float:
    """Median ms over do_bench's repeats (it flushes L2 between them); one untimed-ish call on the CPU dry run."""
    if DEV.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def check(rot, cbs, tokens=1000) -> list[dict]:
    rows = []
    g = torch.Generator(device="cpu").manual_seed(int.from_bytes(os.urandom(4), "little"))
    for bits, cb in cbs.items():
        for xdt in (torch.bfloat16, torch.float16, torch.float32):
            x = (torch.randn(2, H, tokens, D, generator=g) * torch.rand(2, H, tokens, 1, generator=g).add(0.1)).to(DEV, xdt)
            p = torch.empty(2, H, tokens, packed_bytes(D, bits), dtype=torch.uint8, device=DEV)
            n = torch.empty(2, H, tokens, dtype=torch.float16, device=DEV)
            Q.quantize_into(x, rot, cb, p, n)
            rp, rn = reference.quantize(x, rot, cb, torch.float16)
            mism = float((unpack_indices(p, bits, D) != unpack_indices(rp, bits, D)).float().mean())
            nerr = float(((n.float() - rn.float()).abs() / rn.float()).max())
            row = {"bits": bits, "x_dtype": str(xdt), "index_mismatch": mism, "norm_max_rel_err": nerr}
            want = reference.dequantize(rp, rn, rot, cb, torch.float32)
            for odt in (torch.bfloat16, torch.float16, torch.float32):
                out = torch.empty(2, H, tokens, D, dtype=odt, device=DEV)
                DQ.dequantize_into(rp, rn, rot, cb, out)
                row[f"deq_rel_err_{str(odt)[6:]}"] = float((out.float() - want).norm() / want.norm())
                row[f"deq_vs_rounded_max_abs_{str(odt)[6:]}"] = float((out.float() - want.to(odt).float()).abs().max())
            rows.append(row)
            ok = mism < 1e-3 and nerr < 1e-3 and row["deq_rel_err_float32"] < 1e-5 and row["deq_rel_err_bfloat16"] < 5e-3
            row["ok"] = ok
            print(f"check bits={bits} x={str(xdt)[6:]}: mismatch {mism:.2e} norm {nerr:.1e} "
                  f"deq fp32 {row['deq_rel_err_float32']:.1e} bf16 {row['deq_rel_err_bfloat16']:.1e} {'OK' if ok else 'FAIL'}")
    return rows


def copy_bandwidth(n: int) -> dict:
    a = torch.randn(n, device=DEV, dtype=torch.bfloat16)
    b = torch.empty_like(a)
    ms = med(lambda: b.copy_(a))
    byts = 2 * a.numel() * a.element_size()
    del a, b
    if DEV.type == "cuda":
        torch.cuda.empty_cache()
    return {"bytes": byts, "ms": ms, "GBps": byts / ms / 1e6}


def time_pair(rot, cb, bsz, tokens, qkw=None, dkw=None) -> dict:
    bits = cb.bits
    nb = packed_bytes(D, bits)
    x = torch.randn(bsz, H, tokens, D, device=DEV, dtype=torch.bfloat16)
    p = torch.empty(bsz, H, tokens, nb, dtype=torch.uint8, device=DEV)
    n = torch.empty(bsz, H, tokens, dtype=torch.float16, device=DEV)
    out = torch.empty_like(x)
    qkw, dkw = qkw or {}, dkw or {}
    kq = Q.quantize_into(x, rot, cb, p, n, **qkw)
    kd = DQ.dequantize_into(p, n, rot, cb, out, **dkw)
    sync()
    tq = med(lambda: Q.quantize_into(x, rot, cb, p, n, **qkw))
    td = med(lambda: DQ.dequantize_into(p, n, rot, cb, out, **dkw))
    vec = bsz * H * tokens
    bq = vec * (D * 2 + nb + 2)  # read x, write packed + fp16 norm
    bd = vec * (nb + 2 + D * 2)  # read packed + norm, write bf16 out
    r = {
        "B": bsz, "T": tokens, "bits": bits, "quant_ms": tq, "dequant_ms": td,
        "quant_bytes": bq, "dequant_bytes": bd, "quant_GBps": bq / tq / 1e6, "dequant_GBps": bd / td / 1e6,
        "quant_regs": getattr(kq, "n_regs", None), "quant_spills": getattr(kq, "n_spills", None),
        "dequant_regs": getattr(kd, "n_regs", None), "dequant_spills": getattr(kd, "n_spills", None),
        "quant_cfg": qkw, "dequant_cfg": dkw,
    }
    del x, p, n, out
    return r


def decode_step(rot, kcb, vcb, layers=32, steps=200) -> dict:
    """One decode step: each layer quantizes one new K and V token (B=1) into slot 1000 of its packed buffers."""
    bufs = []
    for _ in range(layers):
        k = torch.randn(1, H, 1, D, device=DEV, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        pk = torch.empty(1, H, 4096, packed_bytes(D, kcb.bits), dtype=torch.uint8, device=DEV)[:, :, 1000:1001]
        pv = torch.empty(1, H, 4096, packed_bytes(D, vcb.bits), dtype=torch.uint8, device=DEV)[:, :, 1000:1001]
        nk = torch.empty(1, H, 4096, dtype=torch.float16, device=DEV)[:, :, 1000:1001]
        nv = torch.empty(1, H, 4096, dtype=torch.float16, device=DEV)[:, :, 1000:1001]
        bufs.append((k, v, pk, nk, pv, nv))

    def two_launches():
        for k, v, pk, nk, pv, nv in bufs:
            Q.quantize_into(k, rot, kcb, pk, nk)
            Q.quantize_into(v, rot, vcb, pv, nv)

    def fused():
        for k, v, pk, nk, pv, nv in bufs:
            Q.quantize_kv_into(k, v, rot, kcb, vcb, pk, nk, pv, nv)

    def via_ops():
        for k, v, pk, nk, pv, nv in bufs:
            ops.quantize_into(k, rot, kcb, pk, nk)
            ops.quantize_into(v, rot, vcb, pv, nv)

    def torch_reference():
        for k, v, pk, nk, pv, nv in bufs:
            a, b = reference.quantize(k, rot, kcb, torch.float16)
            pk.copy_(a), nk.copy_(b)
            a, b = reference.quantize(v, rot, vcb, torch.float16)
            pv.copy_(a), nv.copy_(b)

    res = {"layers": layers, "B": 1, "T": 1, "key_bits": kcb.bits, "value_bits": vcb.bits}
    for name, fn, n_steps in (("two_launches", two_launches, steps), ("fused_kv", fused, steps),
                              ("ops_quantize_into", via_ops, steps), ("torch_reference", torch_reference, 20)):
        fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(n_steps):
            fn()
        sync()
        res[f"{name}_host_us_per_step"] = (time.perf_counter() - t0) / n_steps * 1e6
    for name, fn in (("two_launches", two_launches), ("fused_kv", fused)) if DEV.type == "cuda" else ():
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
            torch.cuda.synchronize()
            with torch.cuda.graph(g, stream=s):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        g.replay()
        torch.cuda.synchronize()
        res[f"{name}_graph_us_per_step"] = med(g.replay) * 1e3
    return res


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    copy = result["copy"]["GBps"]
    rows = result["grid"]
    labels = [f"B{r['B']}\nT{r['T'] // 1024}k\n{r['bits']}b" for r in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(12, 4.5))
    w = 0.4
    ax.bar([i - w / 2 for i in xs], [r["quant_GBps"] for r in rows], w, label="quantize")
    ax.bar([i + w / 2 for i in xs], [r["dequant_GBps"] for r in rows], w, label="dequantize")
    ax.axhline(copy, color="k", ls="--", lw=1, label=f"D2D copy {copy:.0f} GB/s")
    ax.axhline(0.6 * copy, color="r", ls=":", lw=1, label="60% of copy (floor)")
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("GB/s (bytes read + written)")
    ax.set_title(f"TurboQuant kernels, H={H} D={D} bf16, {result['device']}")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--quick", action="store_true", help="tiny sizes, to dry-run the script (CPU interpreter)")
    ap.add_argument("--plot-only", help="make the PNG from an existing JSON and exit")
    ap.add_argument("--bits", default="2,3,4,5,8", help="widths of the size grid (comma-separated)")
    args = ap.parse_args()
    widths = [int(b) for b in args.bits.split(",")]
    os.makedirs(args.out, exist_ok=True)
    if args.plot_only:
        with open(args.plot_only) as f:
            plot(json.load(f), os.path.join(args.out, "bench_quantize.png"))
        return
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    rot = make_rotation(D, 0).to(DEV)
    cbs = {b: codebook(b).to(DEV) for b in sorted({*widths, 4, 8})}
    result = {
        "device": torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu (interpreter dry run)", "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(), "H": H, "D": D, "dtype": "bfloat16", "norm_dtype": "float16",
        "command": "PYTHONPATH=. python benchmarks/bench_quantize.py --out <dir>",
    }
    quick = args.quick
    result["check"] = check(rot, cbs, 40 if quick else 1000)
    result["copy"] = copy_bandwidth(1 << 16 if quick else 1 << 30)
    print(f"copy: {result['copy']['GBps']:.0f} GB/s (read + write)")

    grid = []
    for bsz in (1,) if quick else (1, 8):
        for tokens in (64,) if quick else (4096, 32768):
            for bits in widths:
                r = time_pair(rot, cbs[bits], bsz, tokens)
                grid.append(r)
                print(f"B={bsz} T={tokens} bits={bits}: quant {r['quant_ms'] * 1e3:.1f} us {r['quant_GBps']:.0f} GB/s, "
                      f"dequant {r['dequant_ms'] * 1e3:.1f} us {r['dequant_GBps']:.0f} GB/s")
    result["grid"] = grid

    variants = []
    for bits, qkw, dkw in (
        (4, {"progs_per_sm": 0}, {"progs_per_sm": 0}),  # one program per tile
        (4, {"progs_per_sm": 1}, {"progs_per_sm": 1}),
        (4, {"progs_per_sm": 4}, {"progs_per_sm": 4}),
        (4, {"block_t": 32}, {"block_t": 32}),
        (4, {"search": "linear"}, {"terms": 2}),
        (8, {"search": "binary"}, {"terms": 2}),
    ):
        try:
            r = time_pair(rot, cbs[bits], 1 if quick else 8, 64 if quick else 32768, qkw, dkw)
        except Exception as e:  # a variant the installed triton cannot compile must not lose the run
            variants.append({"bits": bits, "quant_cfg": qkw, "dequant_cfg": dkw, "error": repr(e)[:300]})
            print(f"variant bits={bits} q{qkw} d{dkw}: FAILED {repr(e)[:120]}")
            continue
        variants.append(r)
        print(f"variant bits={bits} q{qkw} d{dkw}: quant {r['quant_GBps']:.0f} GB/s, dequant {r['dequant_GBps']:.0f} GB/s")
    result["variants"] = variants

    result["decode"] = d = decode_step(rot, cbs[8], cbs[4], 2 if quick else 32, 2 if quick else 200)
    print("decode (32 layers, B=1, k8v4): " + ", ".join(f"{k} {v:.1f}" for k, v in d.items() if k.endswith("step")))

    with open(os.path.join(args.out, "bench_quantize.json"), "w") as f:
        json.dump(result, f, indent=1)
    try:
        plot(result, os.path.join(args.out, "bench_quantize.png"))
    except ImportError as e:
        print(f"no plot: {e}")
    copy = result["copy"]["GBps"]
    print(f"\n{'B':>2} {'T':>6} {'bits':>4} {'quant GB/s':>10} {'%copy':>6} {'dequant GB/s':>12} {'%copy':>6}")
    for r in grid:
        print(f"{r['B']:>2} {r['T']:>6} {r['bits']:>4} {r['quant_GBps']:>10.0f} {100 * r['quant_GBps'] / copy:>5.0f}% "
              f"{r['dequant_GBps']:>12.0f} {100 * r['dequant_GBps'] / copy:>5.0f}%")
    print("all checks OK" if all(r["ok"] for r in result["check"]) else "SOME CHECKS FAILED")


if __name__ == "__main__":
    main()
