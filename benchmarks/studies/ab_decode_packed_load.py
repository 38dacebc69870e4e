"""A/B of how the fused decode kernel reads 3- and 5-bit packed rows: byte loads assembled into a word ("bytes":
the 3-bit path as shipped before 2026-11-22, the 5-bit path as first written) vs two aligned int32 words per group
of 8 indices ("words", shipped). One variant per process (the kernel compiles
once per process), then the plot:

    PYTHONPATH=. python benchmarks/studies/ab_decode_packed_load.py words /tmp/ab_words.json
    PYTHONPATH=. python benchmarks/studies/ab_decode_packed_load.py bytes /tmp/ab_bytes.json
    python benchmarks/studies/ab_decode_packed_load.py plot /tmp/ab_bytes.json /tmp/ab_words.json \
        benchmarks/results/ab_decode_packed_load_h100

Random packed bytes (timing does not depend on the values), 8 KV heads, 32 query heads, D=128, bf16, residual 128.
"""
import json, sys

if sys.argv[1] == "plot":
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for f in sys.argv[2:-1] for r in json.load(open(f))]
    json.dump(rows, open(sys.argv[-1] + ".json", "w"), indent=1)
    keys = sorted({(r["k"], r["v"], r["B"], r["T"]) for r in rows})
    fig, ax = plt.subplots(figsize=(9, 4))
    for i, var in enumerate(("bytes", "words")):
        ms = [next(r["ms"] for r in rows if r["variant"] == var and (r["k"], r["v"], r["B"], r["T"]) == k) for k in keys]
        ax.bar([j + 0.4 * i for j in range(len(keys))], ms, 0.4, label=var)
    ax.set_xticks([j + 0.2 for j in range(len(keys))], [f"k{k}v{v}\nB{b} {t // 1024}k" for k, v, b, t in keys], fontsize=7)
    ax.set_ylabel("fused decode attention, ms (one layer)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(sys.argv[-1] + ".png", dpi=110)
    sys.exit(0)

import torch, triton, triton.language as tl
from triton.testing import do_bench
import tq_hf_cache.kernels.decode_attention as da
from tq_hf_cache.codebook import theoretical_codebook
from tq_hf_cache.rotation import make_rotation
from tq_hf_cache.packing import packed_bytes

variant = sys.argv[1]
if variant == "bytes":
    @triton.jit
    def _old(base, offs_t, t_ok, BITS: tl.constexpr, D: tl.constexpr, STRIDE_T: tl.constexpr):
        rows = base + offs_t[:, None] * STRIDE_T
        if BITS == 2 or BITS == 4 or BITS == 8:
            cols = tl.arange(0, (D * BITS) // 8)
            v = tl.load(rows + cols[None, :], mask=t_ok[:, None], other=0).to(tl.int32)
        elif BITS <= 3:
            grp = rows + (tl.arange(0, D // 8) * BITS)[None, :]
            v = tl.load(grp, mask=t_ok[:, None], other=0).to(tl.int32)
            for j in tl.static_range(1, BITS):
                v = v | (tl.load(grp + j, mask=t_ok[:, None], other=0).to(tl.int32) << (8 * j))
        else:
            grp = rows + (tl.arange(0, D // 8) * BITS)[None, :]
            v = tl.load(grp, mask=t_ok[:, None], other=0).to(tl.int64)
            for j in tl.static_range(1, BITS):
                v = v | (tl.load(grp + j, mask=t_ok[:, None], other=0).to(tl.int64) << (8 * j))
        return v
    da._load_packed = _old
dev = "cuda"
D, H, G = 128, 8, 4
rows = []
for kb, vb in [(3, 3), (5, 3), (4, 4)]:
    for B, T in [(1, 32768), (8, 32768), (1, 131072)]:
        kp = torch.randint(0, 256, (B, H, T, packed_bytes(D, kb)), dtype=torch.uint8, device=dev)
        vp = torch.randint(0, 256, (B, H, T, packed_bytes(D, vb)), dtype=torch.uint8, device=dev)
        kn = torch.rand(B, H, T, device=dev).half(); vn = torch.rand(B, H, T, device=dev).half()
        z = torch.randn(B, H, 128, D, device=dev, dtype=torch.bfloat16)
        nk = torch.randn(B, H, 1, D, device=dev, dtype=torch.bfloat16)
        st = {"k_packed": kp, "k_norms": kn, "v_packed": vp, "v_norms": vn, "res_k": z, "res_v": z.clone(),
              "new_k": nk, "new_v": nk.clone(), "rotation": make_rotation(D, 0).to(dev),
              "k_codebook": theoretical_codebook(kb, D).to(dev), "v_codebook": theoretical_codebook(vb, D).to(dev)}
        q = torch.randn(B, H * G, 1, D, device=dev, dtype=torch.bfloat16)
        o = da.decode_attention(q, st)
        ms = do_bench(lambda: da.decode_attention(q, st), warmup=25, rep=200, return_mode="median")
        rows.append({"variant": variant, "k": kb, "v": vb, "B": B, "T": T, "ms": ms, "checksum": float(o.float().abs().sum())})
        print(rows[-1], flush=True)
json.dump(rows, open(sys.argv[2], "w"))
