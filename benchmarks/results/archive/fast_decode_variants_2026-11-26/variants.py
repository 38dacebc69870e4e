"""Where the fast kernel's fixed cost goes: knockout variants (parts of the kernel skipped: timing only, outputs wrong)
and the Q-in-shared-memory 3-CTA variant, CUDA-graph timed against cuDNN SDPA, plus per-kernel profiler times."""
import sys, json, torch
sys.path.insert(0, "benchmarks")
import bench_attention as ba
from tq_hf_cache.kernels import decode_attention as da
from tq_hf_cache.kernels import fast

BASE = fast.source()


def knock_source():
    s = BASE
    pre = "".join(f"#ifndef {k}\n#define {k} 0\n#endif\n" for k in ("KNOCK_EXACT", "KNOCK_MERGE", "KNOCK_LOOP",
                                                                    "KNOCK_TABLE", "KNOCK_WAIT"))
    reps = [
        ("const int ne = ls + lr;", "const int ne = KNOCK_EXACT ? 0 : ls + lr;"),
        ("if (!last) return;", "if (!last || KNOCK_MERGE) return;"),
        ("const int end = min(split * p.tok_per_split + p.tok_per_split, lq);",
         "const int end = KNOCK_LOOP ? start : min(split * p.tok_per_split + p.tok_per_split, lq);"),
        ("    fill_table<KENT, KR, LOGKR>(ks,", "    if (!KNOCK_TABLE) fill_table<KENT, KR, LOGKR>(ks,"),
        ("    fill_table<VENT, VR, LOGVR>(vs,", "    if (!KNOCK_TABLE) fill_table<VENT, VR, LOGVR>(vs,"),
        ('#define GRID_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")',
         '#define GRID_WAIT() if (!KNOCK_WAIT) asm volatile("griddepcontrol.wait;" ::: "memory")'),
    ]
    for a, b in reps:
        assert s.count(a) == 1, a
        s = s.replace(a, b)
    return pre + s


def qsm_source():
    s = BASE
    reps = [
        ("  u32 qa[KS][4];\n", "  const u32 qsm = shared_addr(smem) + STAGE_BYTES + KTAB_BYTES + VTAB_BYTES;\n"),
        ("""#pragma unroll
    for (int s = 0; s < KS; ++s) {
      const int c = l4 * (D / 4) + 4 * s;
      qa[s][0] = q[(g * D + c) / 2];
      qa[s][1] = q[((g + 8) * D + c) / 2];
      qa[s][2] = q[(g * D + c + 2) / 2];
      qa[s][3] = q[((g + 8) * D + c + 2) / 2];
    }""", """    u32* qs = reinterpret_cast<u32*>(smem + STAGE_BYTES + KTAB_BYTES + VTAB_BYTES);
    for (int i = tid; i < KS * 128; i += WARPS * 32) {
      const int s = i >> 7, ln = (i >> 2) & 31, r = i & 3;
      const int gg = (ln >> 2) + 8 * (r & 1), c = (ln & 3) * (D / 4) + 4 * s + 2 * (r >> 1);
      qs[i] = q[(gg * D + c) / 2];
    }"""),
        ("""    float s[2][4];
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {""", """    float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      u32 a0, a1, a2, a3;
      asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(a0), "=r"(a1), "=r"(a2), "=r"(a3)
                   : "r"(qsm + (ks * 32 + lane) * 16));
#pragma unroll
      for (int n = 0; n < 2; ++n) {"""),
        ("mma(s[n], qa[ks][0], qa[ks][1], qa[ks][2], qa[ks][3], b0, b1);", "mma(s[n], a0, a1, a2, a3, b0, b1);"),
    ]
    for a, b in reps:
        assert s.count(a) == 1, a[:60]
        s = s.replace(a, b)
    return s


SOURCES = {"base": BASE}
orig = dict(layout=fast.layout, defines=fast.defines, packed_smem=fast.packed_smem, source=fast.source,
            cps=fast.CTAS_PER_SM, smem_kb=dict(fast._SMEM_KB))


def use(v):
    fast.layout = (lambda *a, **k: tuple(v["layout"])) if v.get("layout") else orig["layout"]
    fast._SMEM_KB = dict(orig["smem_kb"])
    if v.get("smem_kb"):  # the chosen layout, in this much shared memory per SM
        fast._SMEM_KB[(9, 0)] = v["smem_kb"]
        fast.layout = orig["layout"].__wrapped__
    extra = v.get("extra", {})
    fast.defines = lambda *a, **k: {**orig["defines"](*a, **k), **extra}
    name = v.get("source", "base")
    src = open(name).read() if name.endswith(".cu") else SOURCES[name]
    fast.source = lambda: src
    qb = v.get("qbytes", 0)
    fast.packed_smem = lambda df: orig["packed_smem"](df) + qb * df["D"]
    fast.CTAS_PER_SM = v.get("cps", orig["cps"])
    fast.FUSED = v.get("fused", True)


def main():
    mode = sys.argv[1]
    if mode == "compile":  # local: every variant's source compiles for sm_90 (no GPU)
        from tq_hf_cache.kernels.fast import jit
        for name in ("knock", "qsm"):
            for kb, vb in ((5, 3), (4, 4), (4, 2)):
                df = fast.defines(128, kb, vb, 1, 0, 0, False, False, False, 16, True, pdl=True)
                if name == "qsm":
                    df.update(MIN_CTAS=3, STAGES=2, KR=8, VR=16)
                else:
                    df.update(KNOCK_EXACT=1, KNOCK_MERGE=1, KNOCK_LOOP=1, KNOCK_TABLE=1, KNOCK_WAIT=1)
                jit.compile_cubin(SOURCES[name], fast.NAME, df, 90)
                print(name, kb, vb, "ok")
        return
    cases = sys.argv[2].split(",")
    presets = [tuple(map(int, p[1:].split("v"))) for p in sys.argv[3].split(",")]
    variants = json.loads(sys.argv[4])
    out = sys.argv[5]
    res = {"device": torch.cuda.get_device_name(), "variants": variants, "rows": [], "profile": []}
    from torch.nn.attention import sdpa_kernel, SDPBackend
    from torch.profiler import profile, ProfilerActivity
    for case in cases:
        b, t = map(int, case.split("x"))
        qq = torch.randn(b, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
        sk = torch.randn(b, 8, t, 128, device="cuda", dtype=torch.bfloat16)
        sv = torch.randn_like(sk)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(qq, sk, sv, enable_gqa=True)
            gs = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gs):
                for _ in range(10): torch.nn.functional.scaled_dot_product_attention(qq, sk, sv, enable_gqa=True)
        x1, x2 = torch.zeros(8, device="cuda"), torch.zeros(8, device="cuda")
        g2 = torch.cuda.CUDAGraph()
        x1.add_(1); x2.add_(1)
        with torch.cuda.graph(g2):
            for _ in range(10): x1.add_(1); x2.add_(1)
        for kb, vb in presets:
            kv, _ = ba.packed_layer(b, t, kb, vb)
            q = torch.randn(b, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
            ref = da.decode_attention(q, kv, fast=False).float()
            graphs, errs = {"sdpa": gs, "two_tiny_kernels": g2}, {}
            for name, v in variants.items():
                try:
                    use(v)
                    s = torch.cuda.Stream()
                    with torch.cuda.stream(s):
                        for _ in range(3): o = da.decode_attention(q, kv)
                    torch.cuda.synchronize()
                    errs[name] = float((o.float() - ref).abs().max())
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        for _ in range(10): da.decode_attention(q, kv)
                    graphs[name] = g
                    if name == "base":
                        torch.cuda.synchronize()
                        with profile(activities=[ProfilerActivity.CUDA]) as prof:
                            for _ in range(20): da.decode_attention(q, kv)
                            torch.cuda.synchronize()
                        ker = {e.key[:40]: round(e.device_time_total / e.count, 2) for e in prof.key_averages()
                               if e.device_time_total > 0}
                        res["profile"].append({"case": case, "preset": f"k{kb}v{vb}", "us": ker})
                        print("profile", case, ker, flush=True)
                except Exception as e:
                    print("variant", name, "failed:", repr(e)[:300], flush=True)
                    errs[name] = repr(e)[:200]
            use({})
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ts = {k: [] for k in graphs}
            for _ in range(25):
                for k, g in graphs.items():
                    torch.cuda.synchronize(); e0.record(); g.replay(); e1.record(); torch.cuda.synchronize()
                    ts[k].append(e0.elapsed_time(e1) * 100)
            med = {k: round(sorted(v)[len(v) // 2], 2) for k, v in ts.items()}
            row = {"case": case, "preset": f"k{kb}v{vb}", "us_per_call": med, "max_err_vs_triton": errs,
                   "x_sdpa": {k: round(med["sdpa"] / v, 3) for k, v in med.items() if k != "sdpa"}}
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
            del kv
            torch.cuda.empty_cache()
        with open(out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
