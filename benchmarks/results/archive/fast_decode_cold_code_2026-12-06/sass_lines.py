"""SASS of one config with line info: instructions per source line range (function) -> which code a CTA runs.
argv: D KB VB W [k=v ...]; prints per-function SASS counts, in address order runs."""
import collections, ctypes, os, re, subprocess, sys, tempfile
import triton
from tq_hf_cache.kernels import fast
from tq_hf_cache.kernels.fast import jit
bind = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
d, kb, vb, w = map(int, sys.argv[1:5])
df = fast.defines(d, kb, vb, 1, 1, 0, False, False, True, 16, True, w=w)
df.update(ROWS=4, Q_DT=1, X_DT=1, O_DT=1, HAD=1, QPAIR=0, NXMAX=1, MASK_ROW=1, XVEC=16, QV=1, MDIRECT=1)
smem = fast.packed_smem(df)
df.update(XB=fast.exact_batch(d, 4, 2, smem, w))
ms, smem = fast.merge_splits(d, 4, max(smem, fast.exact_smem(d, 4, df["XB"], 2, w)), w, True)
df["MSPLITS"] = ms
for kv in sys.argv[5:]:
    k, v = kv.split("="); df[k] = int(v)
print(df, "smem", smem)
src = open(os.environ["SRC"]).read() if "SRC" in os.environ else fast.source()
lib = jit.nvrtc()
prog = ctypes.c_void_p()
lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"k.cu", 0, None, None)
opts = ["--gpu-architecture=sm_90", "-std=c++17", "--extra-device-vectorization", "-lineinfo"] + [f"-D{k}={v}" for k, v in sorted(df.items())]
arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
assert lib.nvrtcCompileProgram(prog, len(opts), arr) == 0
size = ctypes.c_size_t(); lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
buf = ctypes.create_string_buffer(size.value); lib.nvrtcGetCUBIN(prog, buf)
with tempfile.TemporaryDirectory() as t:
    p = os.path.join(t, "k.cubin"); open(p, "wb").write(buf.raw)
    print(subprocess.run([os.path.join(bind, "cuobjdump"), "-res-usage", p], capture_output=True, text=True).stdout.strip().splitlines()[-1])
    out = subprocess.run([os.path.join(bind, "nvdisasm"), "-g", "-c", p], capture_output=True, text=True).stdout
# map each instruction to its source line (the latest "//## File ..., line N" comment before it)
lines = open(os.environ.get("SRCFILE", "tq_hf_cache/kernels/fast/decode_mma.cu")).read().splitlines()
funcs = []  # (start line, name)
for i, l in enumerate(lines, 1):
    m = re.match(r"(?:__device__|extern \"C\" __global__).*?(\w+)\(", l)
    if m:
        funcs.append((i, m.group(1)))
def func_of(n):
    f = "?"
    for s, name in funcs:
        if s <= n: f = name
    return f
cur = 0
seq = []
for l in out.splitlines():
    m = re.search(r'line (\d+)', l)
    if "//##" in l and m:
        cur = int(m.group(1)); continue
    m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*)", l)
    if m:
        seq.append((int(m.group(1), 16) // 16, cur, m.group(2)))
print("instructions", len(seq))
runs = []
for idx, ln, txt in seq:
    f = func_of(ln)
    if runs and runs[-1][0] == f:
        runs[-1][2] = idx; runs[-1][3] += 1
    else:
        runs.append([f, idx, idx, 1])
for f, a, b, n in runs:
    if n >= 20:
        print(f"{a:5d}-{b:5d} {n:5d} {f}")
c = collections.Counter(func_of(ln) for _, ln, _ in seq)
print(c.most_common())
if os.environ.get("DUMP"):
    open(os.environ["DUMP"], "w").write("\n".join(f"{i:5d} {ln:5d} {t}" for i, ln, t in seq))
