"""Offline: predicted summed KL (allocation study's measured per-layer sensitivities) of allocations chosen by
prompt proxies, against uniform k4v2 and the allocation from the sensitivities themselves. Integer widths,
keys 2-6, values 1-4, budget 3.0 code bits (all layers hold the same tokens: SmolLM2)."""
import json, sys, math
sys.path.insert(0, ".")
from tq_hf_cache.codebook import theoretical_codebook, expected_mse
rows = json.load(open(sys.argv[1])); sens = json.load(open(sys.argv[2]))["sensitivity"]
D = int(sys.argv[3]); n = len(rows)
m = {b: expected_mse(theoretical_codebook(b, D), D) for b in range(1, 7)}
KB, VB = range(2, 7), range(1, 5)
def true_cost(bk, bv):
    return sum(sens[str(l)]["key"][str(bk[l])] + sens[str(l)]["value"][str(bv[l])] for l in range(n))
def greedy(costk, costv, budget=6.0 * n):
    bk, bv = [2] * n, [1] * n
    while sum(bk) + sum(bv) < budget:
        best, arg = -1, None
        for l in range(n):
            if bk[l] < 6:
                g = costk(l, bk[l]) - costk(l, bk[l] + 1)
                if g > best: best, arg = g, (l, "k")
            if bv[l] < 4:
                g = costv(l, bv[l]) - costv(l, bv[l] + 1)
                if g > best: best, arg = g, (l, "v")
        l, kind = arg
        if kind == "k": bk[l] += 1
        else: bv[l] += 1
    return bk, bv
print("uniform k4v2", f"{true_cost([4]*n, [2]*n):.3e}")
bk, bv = greedy(lambda l, b: sens[str(l)]["key"][str(b)], lambda l, b: sens[str(l)]["value"][str(b)])
print("oracle (measured sensitivities)", f"{true_cost(bk, bv):.3e}", bk, bv)
proxies = {
    "kcn|vcn/hmed": (lambda r: r["kcn"], lambda r: r["vcn"] / r["hmed"]),
    "voq/hmed": (lambda r: r["voq"] / r["hmed"], lambda r: r["voq"] / r["hmed"]),
    "kcn|vn": (lambda r: r["kcn"], lambda r: r["vn"]),
    "koq|voq": (lambda r: r["koq"], lambda r: r["voq"]),
    "koq/hmed|voq/hmed": (lambda r: r["koq"] / r["hmed"], lambda r: r["voq"] / r["hmed"]),
    "mass*kcn|mass*vcn": (lambda r: r["mass"] * r["kcn"], lambda r: r["mass"] * r["vcn"]),
}
for name, (fk, fv) in proxies.items():
    best = None
    for la in range(-4, 9):
        alpha = 2.0 ** la  # keys' weight relative to values
        wk = [alpha * fk(r) for r in rows]; wv = [fv(r) for r in rows]
        bk, bv = greedy(lambda l, b: wk[l] * m[b], lambda l, b: wv[l] * m[b])
        c = true_cost(bk, bv)
        print(f"{name:22s} alpha 2^{la:+d}: {c:.3e}  keys {sum(bk)/n:.2f} values {sum(bv)/n:.2f}")
