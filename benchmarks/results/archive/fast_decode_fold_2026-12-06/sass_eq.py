"""Whether two kernel sources compile to the same sm_90 SASS.
argv: SRC_A SRC_B D KB VB W [K=V ... for A] -- [K=V ... for B]"""
import os, subprocess, sys, tempfile
import triton
from tq_hf_cache.kernels import fast
from tq_hf_cache.kernels.fast import jit
bind = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
def sass(src, d, kb, vb, w, extra):
    df = fast.defines(d, kb, vb, 1, 1, 0, False, False, True, 16, True, w=w)
    df.update(ROWS=4, Q_DT=1, X_DT=1, O_DT=1, HAD=1, QPAIR=0, NXMAX=1, MASK_ROW=1, XVEC=16, QV=1, MDIRECT=1, XB=16,
              MSPLITS=8)
    df.update(extra)
    cub = jit.compile_cubin(src, "k.cu", df, 90)
    with tempfile.TemporaryDirectory() as t:
        p = os.path.join(t, "k.cubin"); open(p, "wb").write(cub)
        out = subprocess.run([os.path.join(bind, "cuobjdump"), "-sass", p], capture_output=True, text=True).stdout
    ins = [l.split("*/", 1)[1].strip() for l in out.splitlines()
           if l.strip().startswith("/*") and "*/" in l and ";" in l]
    return ins
a, b = sys.argv[1], sys.argv[2]
d, kb, vb, w = map(int, sys.argv[3:7])
rest = sys.argv[7:]
i = rest.index("--") if "--" in rest else len(rest)
ea = dict((k, int(v)) for k, v in (x.split("=") for x in rest[:i]))
eb = dict((k, int(v)) for k, v in (x.split("=") for x in rest[i + 1:]))
sa, sb = sass(open(a).read(), d, kb, vb, w, ea), sass(open(b).read(), d, kb, vb, w, eb)
print(len(sa), len(sb), "identical" if sa == sb else "DIFFERENT")
