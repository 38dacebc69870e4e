"""Write the bound variants of decode_mma.cu (timing only; their outputs are wrong by design) to .dev/s33/var_*.cu"""
src = open("tq_hf_cache/kernels/fast/decode_mma.cu").read()
SHF = """  if (off + B2 <= 32) {
    x = off >= SH ? (w[wi] >> (off - SH)) : (w[wi] << (SH - off));
  } else {
    x = shf_r(w[wi], w[wi + 1], off - SH);
  }"""
PR = """      const u32 a0 = prmt(L[0], L[1], 0x5410), a1 = prmt(L[0], L[1], 0x7632);
      const u32 a2 = prmt(L[2], L[3], 0x5410), a3 = prmt(L[2], L[3], 0x7632);"""
assert src.count(SHF) == 1 and src.count(PR) == 1
noshf = src.replace(SHF, "  x = w[wi];")
noprmt = lambda s: s.replace(PR, "      const u32 a0 = L[0], a1 = L[1], a2 = L[2], a3 = L[3];")
for name, s in {"noshf": noshf, "noprmt": noprmt(src), "both": noprmt(noshf)}.items():
    open(f".dev/s33/var_{name}.cu", "w").write(s)
# real variants (outputs must equal the base's): the shifts on the FMA pipe (IMAD.HI / IMAD.SHL), not the ALU's SHF
MUL = """  if (off + B2 <= 32) {
    if (off > SH) {
      asm("mul.hi.u32 %0, %1, %2;" : "=r"(x) : "r"(w[wi]), "r"(1u << (32 - (off - SH))));
    } else {
      x = off == SH ? w[wi] : w[wi] * (1u << (SH - off));
    }
  } else {
    asm("mad.hi.u32 %0, %1, %2, %3;" : "=r"(x) : "r"(w[wi]), "r"(1u << (32 - (off - SH))),
        "r"(w[wi + 1] * (1u << (32 - (off - SH)))));
  }"""
open(".dev/s33/var_mulhi.cu", "w").write(src.replace(SHF, MUL))
IM = "  x = w[wi] * (2u * p + 1u);"
open(".dev/s33/var_imad.cu", "w").write(src.replace(SHF, IM))
open(".dev/s33/var_imadnoprmt.cu", "w").write(noprmt(src.replace(SHF, IM)))
open(".dev/s33/var_mulhinoprmt.cu", "w").write(noprmt(src.replace(SHF, MUL)))
# bound: the query's fragments of 2 k-steps in registers (loaded once), reused for every k-step (no LDS.128 a k-step)
Q1 = "  u32 qa[QREG ? KS : 1][4];"
Q2 = "        a0 = qa[ks][0]; a1 = qa[ks][1]; a2 = qa[ks][2]; a3 = qa[ks][3];"
Q3 = """  if constexpr (QREG)
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)"""
assert src.count(Q1) == src.count(Q2) == src.count(Q3) == 1
def q2(s):
    s = s.replace("#define QREG (D == 64)", "#define QREG 1")
    s = s.replace(Q1, "  u32 qa[2][4];").replace(Q2, "        a0 = qa[ks & 1][0]; a1 = qa[ks & 1][1]; a2 = qa[ks & 1][2]; a3 = qa[ks & 1][3];")
    return s.replace(Q3, """  if constexpr (QREG)
#pragma unroll
    for (int ks = 0; ks < 2; ++ks)""")
open(".dev/s33/var_q2.cu", "w").write(q2(src))
open(".dev/s33/var_q2noprmt.cu", "w").write(noprmt(q2(src)))
# bound: half the score MMAs (n-tile 1's lookups kept alive, its scores a copy of n-tile 0's)
M1 = "        mma(s[n], a0, a1, a2, a3, b0, b1);"
M2 = "    u32 vw[4][Span<VSPAN, VPT>::NW];"
assert src.count(M1) == 1 and src.count(M2) == 1
def half(s):
    s = s.replace(M1, """        if (n == 0) mma(s[0], a0, a1, a2, a3, b0, b1);
        else s[1][ks & 1] = __uint_as_float(b0 ^ b1 ^ __float_as_uint(s[1][ks & 1]));""")
    return s.replace(M2, "    s[1][0] = s[0][1] + 1e-30f * s[1][0]; s[1][1] = s[0][0] + 1e-30f * s[1][1];\n" + M2)
open(".dev/s33/var_half.cu", "w").write(half(src))
open(".dev/s33/var_q2half.cu", "w").write(half(q2(src)))
open(".dev/s33/var_q2halfnoprmt.cu", "w").write(noprmt(half(q2(src))))
