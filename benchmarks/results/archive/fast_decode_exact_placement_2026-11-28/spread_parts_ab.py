"""Diagnostic A/B (timing only; outputs of the hacked variants are wrong), with `spread.patch` applied: fold, spread,
spread with a ring of 2 (the patch's TQ_DIAG_STAGES), without the warps' exact work ("norun"), with the merge reading
one exact part ("merge1"). argv: out cases reps (run 5; run 4 had fold, spread, norun, merge1 without the ring of 2;
`ab_common.py` factored out of it after the runs)"""
import os

import ab_common as ab

fast = ab.fast
SRC = fast.source()
RUN = "  if (warp >= WARPS - p.spread) spread_run(p, bh, split, warp, xregion);"
assert SRC.count(RUN) == 1
VARS = {"fold": ("0", SRC, None, ""), "spread": ("1", SRC, None, ""), "spread_st2": ("1", SRC, None, "2"),
        "norun_st2": ("1", SRC.replace(RUN, ""), None, "2"), "merge1_st2": ("1", SRC, 1, "2")}
real, cur = fast.jit.kernel, {}


def kernel(src, name, df, *a):
    df = dict(df)
    if cur.get("nx") and "XSPREAD" in df:
        df["NXMAX"] = cur["nx"]
    return real(src, name, df, *a)


def setv(v):
    env, src, nx, st = VARS[v]
    os.environ[fast.SPREAD_ENV] = env
    os.environ["TQ_DIAG_STAGES"] = st
    fast.source = lambda: src
    cur["nx"] = nx


if __name__ == "__main__":
    fast.jit.kernel = kernel
    ab.run(VARS, setv)
