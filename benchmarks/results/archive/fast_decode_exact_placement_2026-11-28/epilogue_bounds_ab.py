"""Timing-only bounds (hacked outputs are wrong): base; norot (the merge's butterflies skipped); nostore (a split's
partial from warp 0 only, no combine over warps); both. argv: out cases reps (run 7; `ab_common.py` factored out of
it after the run)"""
import ab_common as ab

SRC = ab.fast.source()
ROT = "  for (int r = warp; r < live; r += WARPS) {  // red[r] = ys[r] Pi = H ys[r] * s / sqrt(D), a warp a row"
W1 = "      for (int w = 0; w < WARPS; ++w) {\n        const float f = ex2(wm[w * RQ + r] - Mu);"
M1 = "      for (int w = 0; w < WARPS; ++w) M = fmaxf(M, wm[w * RQ + r]);"
assert SRC.count(ROT) == SRC.count(W1) == SRC.count(M1) == 1
NOROT = SRC.replace(ROT, "  for (int r = warp; r < 0; r += WARPS) {")


def nostore(s):
    return s.replace(W1, W1.replace("w < WARPS", "w < 1")).replace(M1, "      M = wm[r];")


VARS = {"base": SRC, "norot": NOROT, "nostore": nostore(SRC), "both": nostore(NOROT)}


def setv(v):
    ab.fast.source = lambda: VARS[v]


if __name__ == "__main__":
    ab.run(VARS, setv)
