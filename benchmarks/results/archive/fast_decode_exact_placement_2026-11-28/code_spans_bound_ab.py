"""Timing-only bound (the variants read the wrong code bits): the 5-bit key span of head dim 64 (10 bytes at l4 x 10)
read as one aligned LDS.64 and one LDS.U16 ("kfast"), and also the 3-bit value span (3 bytes at g x 3) as one
LDS.U16 and one LDS.U8 ("kvfast"), the loads a row-level reorder of the packed layout would need.
argv: out cases reps (run 10; `ab_common.py` factored out of it after the run)"""
import ab_common as ab

SRC = ab.fast.source()
HEAD = "  constexpr int NW = Span<SPAN, ROWB>::NW;\n  if constexpr (VEC >= 16 && SPAN % 16 == 0 && ROWB % 16 == 0) {"
assert SRC.count(HEAD) == 1
K = """  constexpr int NW = Span<SPAN, ROWB>::NW;
  if constexpr (SPAN == 10 && ROWB == 40) {
    const uint2 v = *reinterpret_cast<const uint2*>(row + (start / 10) * 8);
    w[0] = v.x; w[1] = v.y; w[2] = *reinterpret_cast<const u16*>(row + 32 + 2 * (start / 10));
  } else """
V = """  if constexpr (SPAN == 3 && ROWB == 24) {
    w[0] = *reinterpret_cast<const u16*>(row + 2 * (start / 3)) | (static_cast<u32>(row[16 + start / 3]) << 16);
  } else """
TAIL = "if constexpr (VEC >= 16 && SPAN % 16 == 0 && ROWB % 16 == 0) {"
VARS = {"base": SRC, "kfast": SRC.replace(HEAD, K + TAIL), "kvfast": SRC.replace(HEAD, K + V + TAIL)}


def setv(v):
    ab.fast.source = lambda: VARS[v]


if __name__ == "__main__":
    ab.run(VARS, setv)
