"""Which key-side fix closes the k4v4 / k3v3 perplexity gap? A CPU simulation of TurboQuantCache with variants.

    PYTHONPATH=. python benchmarks/studies/key_fix_study.py                      # SmolLM2, 4096 tokens, seeds 0-2
    PYTHONPATH=. python benchmarks/studies/key_fix_study.py --model gemma3-270m --tokens 2048 --seeds 0 --variants plain,c_pre
    (--presets takes preset names and folders written by `tq-hf-cache allocate`)

Simulation: a TurboQuantCache whose quantized layers are switched to a subclass (`SimLayer`, defined here) that
keeps the cache's bookkeeping (residual window of 128 exact tokens, each token quantized once when it leaves the
window, sliding-window drops) but stores the reconstructed history in full precision, so that a variant can change
what is quantized: x = k - offset(pos) is quantized-dequantized with the layer's own rotation and codebook
(tq_hf_cache.reference), and k_hat = dequant(x) + offset(pos). Nothing under tq_hf_cache/ is modified.
`plain` reproduces TurboQuantCache (checked against the real cache first: row `real`).

Variants (mu per (batch, KV head), estimated once from the first block the layer quantizes, then frozen):
  plain        TurboQuant as shipped
  c_post       offset = mu, the channel mean of the keys as the cache sees them (after RoPE)
  c_post_orc   same, mu = mean over all tokens of an fp run (oracle)
  c_pre        offset = RoPE(pos) mu_pre, mu_pre = mean of the first block's keys un-rotated to pre-RoPE
  c_pre_orc    same, mu_pre from all tokens of an fp run (oracle)
  c_pre_v      c_pre, plus values centered by their first-block mean
  sinks        the first 4 tokens of the sequence are never quantized (kept exact)
  sinks_c_pre  sinks + c_pre (mu_pre estimated without the sink tokens)
  sinks_c_pre_orc  sinks + c_pre_orc (diagnostic: is the oracle's loss on the first tokens?)
  fsinks, fsinks_c_pre  sinks / sinks_c_pre with exact sinks in full-attention layers only, as the cache keeps them
  c_pre_nc     c_pre + norm correction (store ||x|| / ||c[idx]||, the dequantized vector keeps the exact norm)
  c_post_blk   c_post, but mu re-estimated for every flushed block (each block subtracts its own mean; costs a
               stored mu per block) -- RoPE-free alternative to c_pre
"""
import argparse
import json
import os
import time

import torch
from transformers import DynamicCache

from tq_hf_cache import TurboQuantCache, TurboQuantConfig
from tq_hf_cache import reference
from tq_hf_cache.layer import TurboQuantLayer, TurboQuantSlidingLayer
from tq_hf_cache.texts import package_text, HELD_OUT_START
from tq_hf_cache.eval.tasks import perplexity

torch.set_num_threads(2)
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "results")
SINKS = 4

VARIANTS = {
    "plain": {},
    "c_post": {"center": "post"},
    "c_post_orc": {"center": "post", "oracle": True},
    "c_pre": {"center": "pre"},
    "c_pre_orc": {"center": "pre", "oracle": True},
    "c_pre_v": {"center": "pre", "center_v": True},
    "sinks": {"sinks": SINKS},
    "sinks_c_pre": {"center": "pre", "sinks": SINKS},
    "c_pre_nc": {"center": "pre", "normcorr": True},
    "sinks_c_pre_orc": {"center": "pre", "oracle": True, "sinks": SINKS},
    "fsinks": {"sinks": SINKS, "full_only": True},
    "fsinks_c_pre": {"center": "pre", "sinks": SINKS, "full_only": True},
    "c_post_blk": {"center": "post_block"},
}


def rotate_half(x):
    d = x.shape[-1] // 2
    return torch.cat([-x[..., d:], x[..., :d]], dim=-1)


class Rope:
    """cos/sin of the model's rotary embedding per layer (HF rotate_half convention), by absolute position."""

    def __init__(self, model):
        self.rot = model.model.rotary_emb
        self.layer_types = getattr(model.config, "layer_types", None)
        self._cache = {}

    def cos_sin(self, layer_idx: int, pos: torch.Tensor):
        lt = self.layer_types[layer_idx] if self.layer_types is not None else None
        key = (lt, int(pos[0]), int(pos[-1]), pos.numel())
        if key not in self._cache:
            dummy = torch.zeros(1, dtype=torch.float32)
            args = (dummy, pos[None].long()) + ((lt,) if hasattr(self.rot, f"{lt}_inv_freq") else ())
            cos, sin = self.rot(*args)
            self._cache[key] = (cos[0].double(), sin[0].double())  # (T, D)
        return self._cache[key]

    def apply(self, layer_idx, x, pos):  # x (B, H, T, D) pre-RoPE -> post-RoPE
        cos, sin = self.cos_sin(layer_idx, pos)
        return x * cos + rotate_half(x) * sin

    def invert(self, layer_idx, x, pos):  # post-RoPE -> pre-RoPE (exact for any attention scaling)
        cos, sin = self.cos_sin(layer_idx, pos)
        return (x * cos - rotate_half(x) * sin) / (cos * cos + sin * sin)


def qdq(x, rotation, codebook, norm_dtype, normcorr=False):
    """Quantize-dequantize x (B, H, T, D) exactly as reference.quantize / reference.dequantize (CPU cache path)."""
    if not normcorr:
        packed, norms = reference.quantize(x, rotation, codebook, norm_dtype)
        return reference.dequantize(packed, norms, rotation, codebook, torch.float32)
    xf = x.float()
    norm = xf.norm(dim=-1)
    unit = xf / norm.clamp_min(1e-30).unsqueeze(-1)
    idx = reference.bucketize(rotation.forward(unit), codebook)
    c = reference.centroid_lookup(idx, codebook)
    stored = reference.store_norm(norm / c.norm(dim=-1).clamp_min(1e-30), norm_dtype).float()
    return rotation.inverse(c) * stored.unsqueeze(-1)


class SimMixin:
    """Overrides of TurboQuantLayer: the quantized history is kept as reconstructed fp tensors."""

    opts: dict = {}
    rope: Rope = None
    oracle: dict = None

    def _key_offset(self, k, pos):
        """The offset subtracted before quantizing (and added back) for these keys; None = no centering."""
        c = self.opts.get("center")
        if c is None:
            return None
        li = self.layer_idx
        if c == "post_block":
            return k.double().mean(2, keepdim=True)
        if self._mu_k is None:
            if self.opts.get("oracle"):
                self._mu_k = self.oracle[c][li].to(k.device).double()
            else:
                s = self.opts.get("sinks", 0)
                keep = pos >= s
                src = k.double()[:, :, keep] if keep.any() else k.double()
                psrc = pos[keep] if keep.any() else pos
                if c == "pre":
                    src = self.rope.invert(li, src, psrc)
                self._mu_k = src.mean(2, keepdim=True)
        if c == "post":
            return self._mu_k
        return self.rope.apply(li, self._mu_k.expand(-1, -1, pos.numel(), -1), pos)

    def _quantize_append(self, k, v, pos0=None):
        n = k.shape[2]
        # bookkeeping of the real layer (lengths, sliding drops); the packed bytes themselves are not used
        self.k_buf.append_slots(n)
        self.v_buf.append_slots(n)
        # called from _push, after the residual window was refilled to residual_length: positions of k
        p0 = self.cumulative_length - self.residual_length - n
        pos = torch.arange(p0, p0 + n)
        off = self._key_offset(k, pos)
        nc = self.opts.get("normcorr", False)
        if self.opts.get("key_qdq") is not None:  # another key format (outlier_channel_study.py)
            x = k if off is None else (k.double() - off).float()
            kh = self.opts["key_qdq"](self, x).double()
            kh = kh if off is None else kh + off
        elif off is None:
            kh = qdq(k, self.rotation, self.k_codebook, self.norm_dtype, nc)
        else:
            kh = qdq((k.double() - off).float(), self.rotation, self.k_codebook, self.norm_dtype, nc).double() + off
        if self.opts.get("center_v"):
            if self._mu_v is None:
                self._mu_v = v.double().mean(2, keepdim=True)
            vh = qdq((v.double() - self._mu_v).float(), self.rotation, self.v_codebook, self.norm_dtype).double() + self._mu_v
        elif self.opts.get("value_qdq") is not None:
            vh = self.opts["value_qdq"](self, v)
        else:
            vh = qdq(v, self.rotation, self.v_codebook, self.norm_dtype)
        s = 0 if self.opts.get("full_only") and self.is_sliding else self.opts.get("sinks", 0)
        if s and p0 < s:
            m = min(s - p0, n)
            kh[:, :, :m] = k[:, :, :m].to(kh.dtype)
            vh[:, :, :m] = v[:, :, :m].to(vh.dtype)
        kh, vh = kh.to(self.dtype), vh.to(self.dtype)
        self._hk = kh if self._hk is None else torch.cat([self._hk, kh], 2)
        self._hv = vh if self._hv is None else torch.cat([self._hv, vh], 2)
        lq = self.k_buf.length
        self._hk, self._hv = self._hk[:, :, -lq:], self._hv[:, :, -lq:]

    def _assemble(self, key_states, value_states):
        lq = self.k_buf.length
        if lq == 0:
            return TurboQuantLayer._assemble(self, key_states, value_states)
        hk, hv = self._hk[:, :, -lq:], self._hv[:, :, -lq:]
        return torch.cat([hk, self.res_k, key_states], 2), torch.cat([hv, self.res_v, value_states], 2)

    def _lazy_ok(self, key_states, value_states):
        return False  # every step through _assemble, which reads the simulated history

    def _materialize(self, kind):
        self._settle()
        if not self.is_initialized:
            return None
        lq = self.k_buf.length
        h, res = (self._hk, self.res_k) if kind == "key" else (self._hv, self.res_v)
        return res.clone() if lq == 0 else torch.cat([h[:, :, -lq:], res], 2)


# direct subclasses (a mixin base would change the instance layout and forbid the __class__ switch below)
_SIM = {k: v for k, v in vars(SimMixin).items() if not k.startswith("__")}
SimLayer = type("SimLayer", (TurboQuantLayer,), dict(_SIM))
SimSlidingLayer = type("SimSlidingLayer", (TurboQuantSlidingLayer,), dict(_SIM))


def sim_cache(model, preset, seed, opts, rope, oracle):
    """preset: a preset name, or a folder `tq-hf-cache allocate` wrote (its per-layer widths)."""
    tq = TurboQuantConfig.from_pretrained(preset) if os.path.isdir(preset) else preset
    cache = TurboQuantCache(tq, config=model.config, seed=seed)
    n = 0
    for layer in cache.layers:
        if type(layer) is TurboQuantLayer:
            layer.__class__ = SimLayer
        elif type(layer) is TurboQuantSlidingLayer:
            layer.__class__ = SimSlidingLayer
        else:
            continue
        layer.opts, layer.rope, layer.oracle = opts, rope, oracle
        layer._hk = layer._hv = None
        layer._mu_k = layer._mu_v = None
        n += 1
    assert n, "no quantized layers"
    return cache


def key_stats(cache, rope, first=128):
    """Per layer: mean ||k - offset||^2 / mean ||k||^2 over tokens after the first block, for the offsets above."""
    rows, oracle = [], {"post": {}, "pre": {}}
    for li, layer in enumerate(cache.layers):
        k = getattr(layer, "keys", None)
        if k is None or k.shape[2] <= first:
            continue
        k = k.double()
        t = k.shape[2]
        off = 0
        if getattr(layer, "is_sliding", False):  # a sliding fp layer holds only its window: positions unknown
            continue
        pos = torch.arange(off, off + t)
        kp = rope.invert(li, k, pos)
        mu_post_all, mu_pre_all = k.mean(2, keepdim=True), kp.mean(2, keepdim=True)
        oracle["post"][li], oracle["pre"][li] = mu_post_all.float(), mu_pre_all
        x = k[:, :, first:]
        den = x.pow(2).sum(-1).mean(-1)

        def r(o):
            return ((x - o).pow(2).sum(-1).mean(-1) / den).mean().item()

        p2 = pos[first:]
        mu_pre_first = kp[:, :, :first].mean(2, keepdim=True)
        row = {
            "layer": li,
            "post_first": r(k[:, :, :first].mean(2, keepdim=True)),
            "post_oracle": r(mu_post_all),
            "pre_first": r(rope.apply(li, mu_pre_first.expand(-1, -1, t - first, -1), p2)),
            "pre_oracle": r(rope.apply(li, mu_pre_all.expand(-1, -1, t - first, -1), p2)),
        }
        v = layer.values.double()
        xv = v[:, :, first:]
        row["v_first"] = ((xv - v[:, :, :first].mean(2, keepdim=True)).pow(2).sum(-1).mean(-1) / xv.pow(2).sum(-1).mean(-1)).mean().item()
        rows.append(row)
    return rows, oracle


def load(name):
    if name == "smollm2":
        from tq_hf_cache.models import load_smollm2

        return load_smollm2()
    from tq_hf_cache.eval.models import load_model

    model, tok, _ = load_model(name)
    return model, tok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--presets", default="k4v4,k3v3")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--no-check", action="store_true", help="skip the real-cache check row")
    ap.add_argument("--out", default=None)
    ap.add_argument("--append", action="store_true", help="keep the rows already in the output file")
    a = ap.parse_args()
    out_path = a.out or os.path.join(RESULTS, f"key_fix_study_{a.model.replace('gemma3-270m', 'gemma3')}.json")
    model, tok = load(a.model)
    ids = tok(package_text(40000, start=HELD_OUT_START), return_tensors="pt")["input_ids"][:, : a.tokens]
    rope = Rope(model)
    t0 = time.time()
    fp_res, _, fp_cache = perplexity(model, ids, lambda: DynamicCache(config=model.config))
    fp = fp_res["ppl"]
    print(f"fp ppl {fp:.4f} ({time.time() - t0:.0f}s)", flush=True)
    stats, oracle = key_stats(fp_cache, rope)
    del fp_cache
    for s in stats:
        print("ratio L{layer:02d} post_first {post_first:.3f} post_oracle {post_oracle:.3f} pre_first {pre_first:.3f} "
              "pre_oracle {pre_oracle:.3f} v_first {v_first:.3f}".format(**s), flush=True)
    summ = {k: sum(s[k] for s in stats) / max(len(stats), 1) for k in ("post_first", "post_oracle", "pre_first", "pre_oracle", "v_first")}
    print("ratio mean over layers", {k: round(v, 3) for k, v in summ.items()}, flush=True)
    out = {"model": a.model, "fp": fp, "tokens": a.tokens, "chunk": 256, "residual_length": 128, "sinks": SINKS,
           "key_ratio_per_layer": stats, "key_ratio_mean": summ, "rows": []}
    if a.append and os.path.exists(out_path):
        out["rows"] = json.load(open(out_path))["rows"]

    def record(preset, variant, seed, ppl, secs):
        d = 100 * (ppl / fp - 1)
        name = os.path.basename(os.path.normpath(preset)) if os.path.isdir(preset) else preset
        out["rows"].append({"preset": name, "variant": variant, "seed": seed, "ppl": ppl, "delta_pct": d})
        print(f"{preset} {variant:12s} seed {seed} ppl {ppl:.4f} delta {d:+.3f}% ({secs:.0f}s)", flush=True)
        json.dump(out, open(out_path, "w"), indent=1)

    seeds = [int(s) for s in a.seeds.split(",")]
    variants = a.variants.split(",")
    if not a.no_check:  # the simulation must reproduce the real cache
        t0 = time.time()
        r = perplexity(model, ids, lambda: TurboQuantCache("k4v4", config=model.config, seed=seeds[0]))[0]["ppl"]
        record("k4v4", "real", seeds[0], r, time.time() - t0)
    for seed in seeds:
        for preset in a.presets.split(","):
            for v in variants:
                if VARIANTS[v].get("oracle") and not oracle["post"]:
                    continue
                t0 = time.time()
                r = perplexity(model, ids, lambda: sim_cache(model, preset, seed, VARIANTS[v], rope, oracle))[0]["ppl"]
                record(preset, v, seed, r, time.time() - t0)


if __name__ == "__main__":
    main()
