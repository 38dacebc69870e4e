"""Compile the fused decode kernel for the H100 (sm_90) on any machine, GPU or not, and print what the machine code
says: registers, stack, and the instruction mix of the packed loop (the basic block with the tensor-core ops).

This is how the kernel's 4-warp layout was found to redo all 16 rows in every warp (4x the HMMA and loads per
tile): the loop's HMMA count per iteration is the tell. It reads no GPU; the triton wheel's ptxas and nvdisasm do
the work. Timings still need the GPU (benchmarks/bench_attention.py).

Usage: python benchmarks/studies/kernel_sass.py [--bits 5,3] [--block-n 16,32] [--warps 1,4] [--stages 2,3]
       [--prefetch 2] [--head-dim 128] [--group 4] [--sass-out DIR]
"""

from __future__ import annotations

import argparse
import collections
import inspect
import itertools
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from tq_hf_cache.kernels import decode_attention as da  # noqa: E402

TABLE_TYPES = {2: "*i64", 4: "*i32", 8: "*i16"}  # lookup_table's entry type per width (else pairs: int32)
POINTERS = {"q_ptr": "*bf16", "o_ptr": "*bf16", "pi_ptr": "*fp32", "kp_ptr": "*u8", "vp_ptr": "*u8",
            "kn_ptr": "*fp16", "vn_ptr": "*fp16", "rk_ptr": "*bf16", "rv_ptr": "*bf16", "sk_ptr": "*bf16",
            "sv_ptr": "*bf16", "m_ptr": "*u8", "acc_ptr": "*fp32", "ml_ptr": "*fp32", "cnt_ptr": "*i32",
            "len_ptr": "*i32", "from_ptr": "*i32"}


def tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def compile_kernel(kbits, vbits, d, group, block_n, warps, stages, prefetch):
    """The cubin of `_decode_kernel` for one configuration (one query, no mask, dynamic layer)."""
    params = list(inspect.signature(da._decode_kernel.fn).parameters)
    kp, vp = da.planes(kbits), da.planes(vbits)
    block_m, rows, sc = da._rows(group, 1, d)
    cons = dict(G=group, D=d, KBITS=kbits, VBITS=vbits, KPT=d * kbits // 8, VPT=d * vbits // 8, KT_SH=0, VT_SH=0,
                KP=kp, VP=vp, KW=max(16, d // kp), VW=max(16, d // vp), BLOCK_M=block_m, R=rows, SC=sc,
                BLOCK_N=block_n, MASK_KIND=0, PREFETCH=prefetch, STATIC=False, ROTATE_ONCE=d > 128, FP_BLOCK_N=16 if d > 128 else block_n, NPARTS=0, QC=16, K0D=0, K0W=0,
                Q1OFF=0, Q2OFF=0, T1_SH=0, T2_SH=0, **{f"K{p}{k}": 0 for p in (1, 2) for k in ("BITS", "D", "PT", "W")})
    ptrs = dict(POINTERS, kt_ptr=TABLE_TYPES.get(kbits, "*i32"), vt_ptr=TABLE_TYPES.get(vbits, "*i32"), qs_ptr="*fp16",
                k1_ptr="*u8", n1_ptr="*fp16", t1_ptr="*i32", k2_ptr="*u8", n2_ptr="*fp16", t2_ptr="*i32")
    sig = {p: "constexpr" if p in cons else ptrs.get(p, "fp32" if p == "scale_log2" else "i32") for p in params}
    src = ASTSource(fn=da._decode_kernel, signature=sig, constexprs={(params.index(k),): v for k, v in cons.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


def loop_mix(sass: str) -> collections.Counter:
    """Instruction counts of the packed loop's body: the self-looping basic block (a label whose block branches
    back to it) with the most fp16 HMMA (HMMA.16816; the exact-copy loop's dots are tf32, HMMA.1688)."""
    best, cur, label, loops = collections.Counter(), collections.Counter(), None, False
    for line in sass.splitlines() + [".L_end:"]:
        m = re.match(r"\s*(\.L_x_\d+|\.L_end):", line)
        if m:
            if loops and cur["fp16 HMMA"] > best["fp16 HMMA"]:
                best = cur
            cur, label, loops = collections.Counter(), m.group(1), False
            continue
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m:
            cur[m.group(1)] += 1
            cur["fp16 HMMA"] += "HMMA.16816" in line
            loops = loops or (m.group(1) == "BRA" and label is not None and f"{label})" in line or f"{label} " in line)
    return best


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bits", default="5,3", help="key and value bits")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--group", type=int, default=4, help="query heads per KV head")
    p.add_argument("--block-n", default="16,32")
    p.add_argument("--warps", default="1,4")
    p.add_argument("--stages", default="2")
    p.add_argument("--prefetch", default="2")
    p.add_argument("--sass-out", default=None, help="also write each variant's SASS here")
    a = p.parse_args()
    kbits, vbits = map(int, a.bits.split(","))
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    print(f"{'block_n':>7} {'warps':>5} {'stages':>6} {'prefetch':>8} {'regs':>4} {'stack':>5} {'loop':>5} "
          f"{'per token':>9}  top instructions of the loop")
    for bn, w, st, pf in itertools.product(ints(a.block_n), ints(a.warps), ints(a.stages), ints(a.prefetch)):
        k = compile_kernel(kbits, vbits, a.head_dim, a.group, bn, w, st, pf)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            sass = subprocess.run([tool("nvdisasm"), "-c", f.name], capture_output=True, text=True, check=True).stdout
            usage = subprocess.run([tool("cuobjdump"), "--dump-resource-usage", f.name], capture_output=True,
                                   text=True, check=True).stdout
        regs = re.search(r"REG:(\d+)", usage).group(1)
        stack = re.search(r"STACK:(\d+)", usage).group(1)
        mix = loop_mix(sass)
        mix.pop("fp16 HMMA", None)
        n = sum(mix.values())
        per_token = n * 32 * w / bn  # thread-instructions per token per KV head (the loop's share)
        top = ", ".join(f"{op} {c}" for op, c in mix.most_common(8))
        print(f"{bn:7} {w:5} {st:6} {pf:8} {regs:>4} {stack:>5} {n:5} {per_token:9.0f}  {top}")
        if a.sass_out:
            os.makedirs(a.sass_out, exist_ok=True)
            with open(os.path.join(a.sass_out, f"k{kbits}v{vbits}_n{bn}_w{w}_s{st}_p{pf}.sass"), "w") as f:
                f.write(sass)


if __name__ == "__main__":
    main()
