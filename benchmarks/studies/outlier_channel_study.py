"""Do outlier channels pay (the paper's fractional widths)? A CPU simulation on top of key_fix_study.py.

    PYTHONPATH=. python benchmarks/studies/outlier_channel_study.py --presets benchmarks/results/allocations/smollm2-2 \
        --variants fsinks,split16_2_-1

Why: in the cached (post-RoPE) basis a few RoPE channel pairs hold almost all of E[q_c^2] E[k_c^2], the weight of a
key error in channel c on the score q.k (SmolLM2: the top 16 of 64 channels hold 79-100 %, per layer and KV head).
One random rotation over all D channels spreads the error evenly, so most of the key bits go to channels the scores
barely see.

Format simulated (keys): per layer and KV head, the n channels with the largest calibration weight (whole RoPE pairs
c, c + D/2) are quantized as their own TurboQuant vector (own norm, own rotation, Lloyd-Max codebook of dim n) at
b + da bits, the other D - n channels as a second one at b + db bits, b being the layer's key width. Two float16
norms. Stored bits per token and KV head: n (b + da) + (D - n)(b + db) + 32, against D b + 16 for the plain format;
each row records its mean over the quantized layers.

Calibration: queries and keys after RoPE over the first 1024 tokens of the calibration text (the package text before
the held-out slice), the exact sinks (first 4 tokens) left out.

Variant names: `fsinks` (the cache as shipped: exact sinks in full-attention layers), `fsinks_c` (plus pre-RoPE key
centring), `split<n>_<da>_<db>` (fsinks plus the format above), `...v<n>_<da>_<db>` (the values split the same way,
channels ranked by E[v_c^2] times the squared o_proj column norm), `..._c` (plus centring). Results and the single-seed
probes: docs/eval_findings.md#outlier-channels-simulated-not-built.
"""

import argparse
import json
import os
import re
import sys
import time

import torch
from transformers import DynamicCache

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import key_fix_study as K  # noqa: E402

from tq_hf_cache import reference  # noqa: E402
from tq_hf_cache.codebook import theoretical_codebook  # noqa: E402
from tq_hf_cache.rotation import make_rotation  # noqa: E402
from tq_hf_cache.texts import package_text, HELD_OUT_START  # noqa: E402
from tq_hf_cache.eval.tasks import perplexity  # noqa: E402


def capture(model, ids):
    """Per layer: (q, k, v) after RoPE for one forward pass, (1, H, T, D) each."""
    attn = model.model.layers[0].self_attn
    mod = sys.modules[type(attn).__module__]
    orig = mod.apply_rotary_pos_emb
    qk, vs = [], []

    def rope(q, k, cos, sin, *a, **kw):
        qe, ke = orig(q, k, cos, sin, *a, **kw)
        qk.append((qe.detach(), ke.detach()))
        return qe, ke

    hooks = [layer.self_attn.v_proj.register_forward_hook(lambda m, i, o: vs.append(o.detach()))
             for layer in model.model.layers]
    mod.apply_rotary_pos_emb = rope
    try:
        with torch.no_grad():
            model(ids)
    finally:
        mod.apply_rotary_pos_emb = orig
        for h in hooks:
            h.remove()
    hd = qk[0][1].shape[-1]
    return [(q, k, v.view(1, v.shape[1], -1, hd).transpose(1, 2)) for (q, k), v in zip(qk, vs)]


def channel_weights(model, caught, sinks=4):
    """Per layer: key weights (Hkv, D) = E[q_c^2] (mean over the GQA group) E[k_c^2], summed over RoPE pairs; value
    weights (Hkv, D) = E[v_c^2] ||o_proj column of (head, c)||^2 summed over the group's query heads."""
    out = []
    for li, (q, k, v) in enumerate(caught):
        hq, hk, d = q.shape[1], k.shape[1], k.shape[-1]
        g = hq // hk
        qe = q[0, :, sinks:].pow(2).mean(1).view(hk, g, d).mean(1)
        ke = k[0, :, sinks:].pow(2).mean(1)
        if WEIGHT == "qvar":
            ke = k[0, :, sinks:].var(1)
        w = {"qk": qe * ke, "qvar": qe * ke, "k": ke, "random": torch.rand(ke.shape, generator=_G)}[WEIGHT]
        w = torch.cat([w[:, : d // 2] + w[:, d // 2:]] * 2, -1)  # a pair's weight on both of its channels
        wo = model.model.layers[li].self_attn.o_proj.weight.detach().float()  # (hidden, Hq * D)
        col = wo.pow(2).sum(0).view(hk, g, d).sum(1)
        wv = v[0, :, sinks:].pow(2).mean(1) * col
        out.append((w, wv))
    return out


def top_channels(w, n, pairs=True):
    """(Hkv, n) channel indices with the largest weight, whole RoPE pairs when `pairs`."""
    d = w.shape[-1]
    if pairs:
        idx = w[:, : d // 2].topk(n // 2, -1).indices
        idx = torch.cat([idx, idx + d // 2], -1)
    else:
        idx = w.topk(n, -1).indices
    return idx.sort(-1).values


_ROT, _CB = {}, {}
ROTATION = "auto"
WEIGHT = "qk"
_G = torch.Generator().manual_seed(0)


def tq_qdq(x, bits, seed, norm_dtype):
    d = x.shape[-1]
    rot = _ROT.setdefault((d, seed), make_rotation(d, seed, ROTATION))
    cb = _CB.setdefault((bits, d), theoretical_codebook(bits, d))
    packed, norms = reference.quantize(x, rot, cb, norm_dtype)
    return reference.dequantize(packed, norms, rot, cb, torch.float32)


def split_qdq(x, chans, bits_a, bits_b, seed, norm_dtype):
    """x (B, H, T, D); chans (H, n): those channels at bits_a, the rest at bits_b, two TurboQuant vectors."""
    b, h, t, d = x.shape
    out = torch.empty(x.shape, dtype=torch.float32)
    for hi in range(h):
        a = chans[hi]
        rest = torch.ones(d, dtype=torch.bool)
        rest[a] = False
        r = rest.nonzero().squeeze(-1)
        xa, xb = x[:, hi, :, a].float(), x[:, hi, :, r].float()
        out[:, hi, :, a] = tq_qdq(xa, bits_a, seed, norm_dtype)
        out[:, hi, :, r] = tq_qdq(xb, bits_b, seed + 1, norm_dtype) if bits_b > 0 else 0.0
    return out


def parse(variant):
    """split<n>_<da>_<db> (keys), optionally v<n>_<da>_<db> (values the same way), optionally _c (centring);
    vsplit<n>_<da>_<db> = the same numbers for both."""
    m = re.fullmatch(r"(v?)split(\d+)_(-?\d+)_(-?\d+)(?:v(\d+)_(-?\d+)_(-?\d+))?(_c)?", variant)
    if m is None:
        return None
    k = tuple(int(m.group(i)) for i in (2, 3, 4))
    v = tuple(int(m.group(i)) for i in (5, 6, 7)) if m.group(5) else (k if m.group(1) else None)
    return {"key": k, "value": v, "center": m.group(8) is not None}


def make_opts(variant, weights, seed):
    base = {"sinks": K.SINKS, "full_only": True}
    if variant in ("fsinks", "fsinks_c"):
        if variant == "fsinks_c":
            base["center"] = "pre"
        return base, None
    p = parse(variant)
    if p is None:
        raise SystemExit(f"unknown variant {variant!r}")
    if p["center"]:
        base["center"] = "pre"

    def fmt(kind):
        n, da, db = p["key"] if kind == 0 else p["value"]

        def f(layer, x):
            bits = layer.key_bits if kind == 0 else layer.value_bits
            chans = top_channels(weights[layer.layer_idx][kind], n, pairs=kind == 0)
            return split_qdq(x, chans, bits + da, bits + db, seed, layer.norm_dtype)
        return f

    base["key_qdq"] = fmt(0)
    if p["value"] is not None:
        base["value_qdq"] = fmt(1)
    return base, p


def split_bits(d, b, spec):
    n, da, db = spec
    return n * (b + da) + (d - n) * (b + db) + (32 if b + db > 0 else 16)


def stored_bits(model_cfg, cache, p):
    """Stored bits per coordinate of the quantized history (norms included), mean over the quantized layers."""
    tot = n = 0
    for layer in cache.layers:
        if not hasattr(layer, "key_bits"):
            continue
        d = getattr(model_cfg, "head_dim", None) or model_cfg.hidden_size // model_cfg.num_attention_heads
        kb, vb = layer.key_bits, layer.value_bits
        plain_k, plain_v = d * kb + 16, d * vb + 16
        k = plain_k if p is None else split_bits(d, kb, p["key"])
        v = plain_v if p is None or p["value"] is None else split_bits(d, vb, p["value"])
        tot += (k + v) / (2 * d)
        n += 1
    return tot / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--calib-tokens", type=int, default=1024)
    ap.add_argument("--seeds", default="0,1,2,3")
    ap.add_argument("--presets", required=True)
    ap.add_argument("--variants", default="fsinks,split16_2_-1")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rotation", default="auto", help="the subsets' rotation kind: auto, hadamard or orthogonal")
    ap.add_argument("--weight", default="qk", help="key channel ranking: qk (E[q^2] E[k^2]), qvar (E[q^2] Var[k]), "
                    "k (E[k^2]) or random (a control)")
    a = ap.parse_args()
    global ROTATION, WEIGHT
    ROTATION, WEIGHT = a.rotation, a.weight
    model, tok = K.load(a.model)
    text = package_text(40000, start=HELD_OUT_START)
    ids = tok(text, return_tensors="pt")["input_ids"][:, : a.tokens]
    cal = tok(package_text(20000, start=0), return_tensors="pt")["input_ids"][:, : a.calib_tokens]
    weights = channel_weights(model, capture(model, cal))
    rope = K.Rope(model)
    t0 = time.time()
    fp = perplexity(model, ids, lambda: DynamicCache(config=model.config))[0]["ppl"]
    print(f"fp ppl {fp:.4f} ({time.time() - t0:.0f}s)", flush=True)
    out = {"model": a.model, "fp": fp, "tokens": a.tokens, "calib_tokens": a.calib_tokens, "rows": [],
           "command": " ".join(sys.argv)}
    if os.path.exists(a.out):
        out["rows"] = json.load(open(a.out))["rows"]
    for seed in map(int, a.seeds.split(",")):
        for preset in a.presets.split(","):
            for v in a.variants.split(","):
                opts, p = make_opts(v, weights, seed)
                t0 = time.time()
                holder = {}

                def make():
                    holder["c"] = K.sim_cache(model, preset, seed, opts, rope, None)
                    return holder["c"]

                ppl = perplexity(model, ids, make)[0]["ppl"]
                bits = stored_bits(model.config, holder["c"], p)
                d = 100 * (ppl / fp - 1)
                name = os.path.basename(os.path.normpath(preset))
                out["rows"].append({"preset": name, "variant": v, "seed": seed, "ppl": ppl, "delta_pct": d,
                                    "bits_per_coord_quantized": bits})
                print(f"{name} {v:16s} seed {seed} bits {bits:.3f} delta {d:+.3f}% ({time.time() - t0:.0f}s)", flush=True)
                json.dump(out, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
