"""Issue 69: a calibration-free cache at k4v2's bytes within +0.5 % perplexity of fp? An ablation by simulation.

Every candidate is simulated (fake-quantized) at the point where the package quantizes: a token is quantized once,
when it leaves the 128-token exact window (`LayerStore._quantize_append`), its first `sink_tokens` stay exact in
full-attention layers, sliding layers drop what leaves their window, key centring subtracts R(t) mu (mu from the
first quantized block, as `rope.key_mean`). The simulated cache is transformers' `DynamicCache` whose layers replace,
in place, the stored tokens that left the window by their dequantized values; the package is not changed. The
baseline (scalar Lloyd-Max codes, float16 norms, the package's rotation per layer seed + i) is checked against the
package's own `TurboQuantCache` on the same text.

Perplexity: chunked prefill in chunks of 256 (`tq_hf_cache.eval.tasks.perplexity`), scored from chunk 1 on. Texts:
"pkg" is the text of the quality tables (`texts.package_text(start=HELD_OUT_START)`, CPython's pydoc topics);
"gpl3" is held out (never used to choose anything): the GNU GPL v3 text shipped by Debian's `base-files` package
(/usr/share/common-licenses/GPL-3). SmolLM2 is scored over 4096 tokens, Gemma 3 270M over 2048 (the quality
tables' lengths).

    nice -n 19 python benchmarks/studies/low_bit_study.py --model smollm2 --seeds 0,1,2,3 \
        --candidates k4v2,k3v3,... --out benchmarks/results/low_bit_study.json

Bits are counted as stored: code bits per coordinate (any VQ codebook of 2^(bits*dim) points), plus one float16
norm per key and per value vector as today; side information (per-layer statistics) and extra exact tokens are
counted on top, exact tokens amortized over a 4096-token context.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import time

import torch

SCRATCH = os.environ.get("TQ_STUDY_SCRATCH", "/work/scratch/q3")
GPL3 = "/usr/share/common-licenses/GPL-3"
CONTEXT = 4096  # where exact tokens and per-layer side information are amortized
GRID = 2048  # 2-D codebooks: cells per axis of the nearest-codeword table
PPL_TOKENS = {"smollm2": 4096, "gemma3-270m": 2048}


# ---------------------------------------------------------------------------------------------------------------
# codecs: a rotated unit vector's coordinates (..., D) -> their reconstruction, with `bits` per coordinate

class Scalar:
    """The package's Lloyd-Max codebook for one coordinate (`theoretical_codebook`)."""

    def __init__(self, bits: int, dim: int):
        from tq_hf_cache.codebook import theoretical_codebook

        cb = theoretical_codebook(bits, dim)
        self.c, self.b, self.bits = cb.centroids, cb.boundaries, float(bits)

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        return self.c[torch.bucketize(y, self.b)]


def _sphere_blocks(n: int, k: int, dim: int, gen: torch.Generator) -> torch.Tensor:
    """n samples of k consecutive coordinates of a uniform random unit vector in R^dim: direction uniform on
    S^(k-1), squared radius Beta(k/2, (dim-k)/2), drawn as a ratio of chi-square variables."""
    g = torch.randn(n, k, generator=gen, dtype=torch.float64)
    a = g.pow(2).sum(1)
    # chi-square with dim - k degrees of freedom, as a sum of (dim - k) squares, in blocks to bound memory
    b = torch.zeros(n, dtype=torch.float64)
    left = dim - k
    while left > 0:
        m = min(left, 64)
        b += torch.randn(n, m, generator=gen, dtype=torch.float64).pow(2).sum(1)
        left -= m
    r = (a / (a + b)).sqrt()
    return (g / a.sqrt().unsqueeze(1) * r.unsqueeze(1)).float()


def _nearest(x: torch.Tensor, c: torch.Tensor, block: int = 1 << 16) -> torch.Tensor:
    """Index of the nearest row of c (K, k) for every row of x (N, k)."""
    out = torch.empty(x.shape[0], dtype=torch.long)
    cn = c.pow(2).sum(1)
    for s in range(0, x.shape[0], block):
        xs = x[s : s + block]
        out[s : s + block] = (cn - 2 * xs @ c.T).argmin(1)
    return out


def lloyd_vq(k: int, points: int, dim: int, samples: int = 400_000, iters: int = 80, seed: int = 0) -> torch.Tensor:
    """A `points`-point codebook for blocks of k rotated coordinates (head dim `dim`), fitted by Lloyd (k-means) on
    samples of their exact law: no data, the same for every model of that head dim. Cached under SCRATCH."""
    path = os.path.join(SCRATCH, f"vq{k}_{points}_{dim}_{samples}_{iters}_{seed}.pt")
    if os.path.exists(path):
        return torch.load(path)
    gen = torch.Generator().manual_seed(seed)
    x = _sphere_blocks(samples, k, dim, gen)
    c = x[torch.randperm(samples, generator=gen)[:points]].clone()
    for _ in range(iters):
        idx = _nearest(x, c)
        sums = torch.zeros_like(c).index_add_(0, idx, x)
        cnt = torch.bincount(idx, minlength=points).float()
        empty = cnt == 0
        c = torch.where(empty.unsqueeze(1), x[torch.randint(samples, (points,), generator=gen)], sums / cnt.clamp_min(1).unsqueeze(1))
    os.makedirs(SCRATCH, exist_ok=True)
    torch.save(c, path)
    return c


class VQ:
    """A Lloyd codebook on blocks of k consecutive rotated coordinates: 2^(k * bits) points (bits may be a multiple
    of 1/k: 2-D codebooks give half bits)."""

    def __init__(self, bits: float, dim: int, k: int = 2):
        points = round(2 ** (k * bits))
        if abs(math.log2(points) / k - bits) > 1e-9:
            raise ValueError(f"{bits} bits on blocks of {k} is not a whole number of index bits")
        self.c, self.k, self.bits = lloyd_vq(k, points, dim), k, float(bits)

        self.table = None
        if k == 2:  # nearest codeword by a lookup on a fine grid (exact but for points within a cell of a tie)
            self.lim = min(1.0, 10.0 / math.sqrt(dim))
            g = (torch.arange(GRID) + 0.5) / GRID * 2 * self.lim - self.lim
            pts = torch.stack(torch.meshgrid(g, g, indexing="ij"), -1).reshape(-1, 2)
            self.table = _nearest(pts, self.c)

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        shape = y.shape
        x = y.reshape(-1, self.k)
        if self.table is None:
            return self.c[_nearest(x, self.c)].reshape(shape)
        i = ((x + self.lim) * (GRID / (2 * self.lim))).long().clamp_(0, GRID - 1)
        return self.c[self.table[i[:, 0] * GRID + i[:, 1]]].reshape(shape)


def viterbi(y: torch.Tensor, table: torch.Tensor, cbits: int, sbits: int) -> torch.Tensor:
    """Trellis (bitshift) encoding of y (N, P, 2), pair by pair: pair j's code is `cbits` new bits, its point is
    table[(state << cbits) | code], state = the last `sbits` bits of the code stream before it (0 at the start).
    Returns the index into `table` of every pair (N, P), minimizing the total squared error."""
    n, npairs, _ = y.shape
    ns, nc = 1 << sbits, 1 << cbits
    hi_n = 1 << cbits if sbits >= cbits else 1
    lo_n = ns // hi_n
    cost = torch.full((n, ns), float("inf"))
    cost[:, 0] = 0
    tn = table.pow(2).sum(1)  # (2^L,)
    back = []
    for j in range(npairs):
        d = tn - 2 * y[:, j] @ table.T  # (N, 2^L): squared distance up to |y_j|^2
        tot = (cost.unsqueeze(2) + d.view(n, ns, nc)).view(n, hi_n, lo_n, nc)
        cost, arg = tot.min(1)  # new state (lo << cbits) | code
        cost = cost.reshape(n, ns)
        back.append(arg.reshape(n, ns).to(torch.uint8))
    state = cost.argmin(1)
    idx = torch.empty(n, npairs, dtype=torch.long)
    for j in range(npairs - 1, -1, -1):
        code, lo = state & (nc - 1), state >> cbits
        hi = back[j].gather(1, state.unsqueeze(1)).squeeze(1).long()
        old = (hi * lo_n + lo) if sbits >= cbits else lo
        idx[:, j] = (old << cbits) | code
        state = old
    return idx


def trellis_table(bits: float, dim: int, sbits: int, vectors: int = 20_000, iters: int = 25,
                  seed: int = 0) -> torch.Tensor:
    """A trellis table of 2^(sbits + 2 bits) 2-D points for rotated unit vectors of head dim `dim`, fitted by
    Lloyd iterations (Viterbi encode, then every point the mean of its pairs) on uniform random unit vectors: no
    data, the same for every model of that head dim. Cached under SCRATCH."""
    cbits = round(2 * bits)
    path = os.path.join(SCRATCH, f"tcq_{cbits}_{sbits}_{dim}_{vectors}_{iters}_{seed}.pt")
    if os.path.exists(path):
        return torch.load(path)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(vectors, dim, generator=gen)
    x = (x / x.norm(dim=1, keepdim=True)).view(vectors, dim // 2, 2)
    size = 1 << (sbits + cbits)
    table = torch.randn(size, 2, generator=gen) / math.sqrt(dim)
    for _ in range(iters):
        idx = viterbi(x, table, cbits, sbits).reshape(-1)
        pts = x.reshape(-1, 2)
        sums = torch.zeros_like(table).index_add_(0, idx, pts)
        cnt = torch.bincount(idx, minlength=size).float()
        table = torch.where((cnt == 0).unsqueeze(1), table, sums / cnt.clamp_min(1).unsqueeze(1))
    os.makedirs(SCRATCH, exist_ok=True)
    torch.save(table, path)
    return table


class Trellis:
    """Trellis-coded pairs (see `viterbi`): `bits` per coordinate, a 2^(sbits + 2 bits)-point table read by the
    sliding window of the last sbits + 2 bits code bits; the decoder is a table read per pair, as for VQ pairs."""

    def __init__(self, bits: float, dim: int, sbits: int):
        self.cbits, self.sbits, self.bits = round(2 * bits), sbits, float(bits)
        big = sbits + self.cbits > 8  # 4096-point tables: fewer samples and sweeps (the fit's cost grows with it)
        self.table = trellis_table(bits, dim, sbits, *((8_000, 12) if big else ()))

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        shape = y.shape
        x = y.reshape(-1, shape[-1] // 2, 2).float()
        return self.table[viterbi(x, self.table, self.cbits, self.sbits)].reshape(shape)


@functools.lru_cache(maxsize=None)
def make_codec(name: str, dim: int):
    """'s4' scalar 4 bits; 'p2.5' pairs (2-D) at 2.5 bits a coordinate; 'q2' quadruples (4-D) at 2 bits; 't2'
    trellis-coded pairs at 2 bits whose table index also holds the previous pair's code (2 b state bits), 'T2'
    the previous two pairs' (4 b state bits)."""
    kind, bits = name[0], float(name[1:])
    if kind == "s":
        return Scalar(int(bits), dim)
    if kind in "tT":
        return Trellis(bits, dim, round(2 * bits) * (1 if kind == "t" else 2))
    return VQ(bits, dim, {"p": 2, "q": 4}[kind])


# ---------------------------------------------------------------------------------------------------------------
# one vector's quantize-dequantize, as the package does it, with the candidate's options

def _gain(y: torch.Tensor, yh: torch.Tensor, norm_fix: str) -> torch.Tensor:
    """The factor the stored norm carries for a unit vector y coded as yh (see `fake_quant`)."""
    if norm_fix == "norm":
        return 1 / yh.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    if norm_fix == "ls":
        return (y * yh).sum(-1, keepdim=True) / yh.pow(2).sum(-1, keepdim=True).clamp_min(1e-30)
    return torch.ones_like(y[..., :1])


def fake_quant(x: torch.Tensor, rot, codec, norm_fix: str = "", scale: torch.Tensor | None = None,
               search: int = 0) -> torch.Tensor:
    """x (B, H, T, D) -> its reconstruction: norm (float16) times Pi^T codec(Pi x / |x|).
    norm_fix: '' as the package; 'norm' stores |x| / |codec(y)| so the decoded vector's length is exact; 'ls'
    stores |x| <y, yhat> / |yhat|^2, the least-squares gain. scale: per-channel (B, H, 1, D) factors applied
    before the rotation and divided out after. search: an encoder-only gain search over `search` input scales s
    (geometric, 0.8 .. 1.25): the codes are codec(s y), the stored gain follows norm_fix, and per vector the s with
    the smallest reconstruction error |y - gain * yhat|^2 is kept (with 'norm', the largest cosine); the decoder
    is unchanged."""
    xf = x.float()
    if scale is not None:
        xf = xf * scale
    norm = xf.norm(dim=-1, keepdim=True)
    y = rot.forward(xf / norm.clamp_min(1e-30))
    if search > 1:
        best = best_err = None
        for s in torch.logspace(math.log10(0.8), math.log10(1.25), search).tolist():
            cand = codec(y * s)
            g = _gain(y, cand, norm_fix)
            err = (y - g * cand).pow(2).sum(-1, keepdim=True)
            if best is None:
                best, best_err, gain = cand, err, g
            else:
                better = err < best_err
                best = torch.where(better, cand, best)
                gain = torch.where(better, g, gain)
                best_err = torch.minimum(err, best_err)
        yh = best
    else:
        yh = codec(y)
        gain = _gain(y, yh, norm_fix)
    norm = norm * gain
    out = rot.inverse(yh) * norm.half().float()
    if scale is not None:
        out = out / scale
    return out.to(x.dtype)


# ---------------------------------------------------------------------------------------------------------------
# the simulated cache

from transformers import DynamicCache  # noqa: E402
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer  # noqa: E402


class _Sim:
    """Mixin over transformers' dynamic layers: after each update, the stored tokens that left the exact window
    are replaced by their quantize-dequantize, once."""

    def setup(self, idx: int, spec: dict, rope, seed: int):
        from tq_hf_cache.rotation import make_rotation

        self.idx, self.spec, self.rope = idx, spec, rope
        self.window = spec.get("window", 128)
        self.sinks = 0 if self.is_sliding else spec.get("sinks", 4)
        self.seed = seed + idx
        self.rot = None
        self.make_rotation = make_rotation
        self.qend, self.seen, self.mu, self.kscale, self.vmu = 0, 0, None, None, None

    def update(self, key_states, value_states, *args, **kwargs):
        out = super().update(key_states, value_states, *args, **kwargs)
        self.seen += key_states.shape[2]
        first = self.seen - self.keys.shape[2]  # absolute position of stored token 0
        new_qend = self.seen - self.window
        a = max(self.qend, first)
        if new_qend > a:
            keys, values = self.keys.clone(), self.values.clone()  # the returned states may alias them
            i0, i1 = a - first, new_qend - first
            kq, vq = self.quantize(keys[:, :, i0:i1], values[:, :, i0:i1], a)
            keys[:, :, i0:i1], values[:, :, i0:i1] = kq, vq
            self.keys, self.values = keys, values
        self.qend = max(self.qend, new_qend)
        return out

    def quantize(self, k: torch.Tensor, v: torch.Tensor, pos0: int):
        sp, n, d = self.spec, k.shape[2], k.shape[3]
        if self.rot is None:
            self.rot = self.vrot = self.make_rotation(d, self.seed, sp.get("rot", "auto"))
            self.kc = make_codec(sp["k"], d) if sp["k"] != "fp" else None
            self.vc = make_codec(sp["v"], d) if sp["v"] != "fp" else None
            self.rsel = sp.get("rsel", 0)
        pos = torch.arange(pos0, pos0 + n)
        f = max(self.sinks - pos0, 0)  # the block's first token that is not a sink (none left: all of them)
        f = f if f < n else 0
        kq, off = k.float(), None
        if sp.get("centre") and self.rope is not None:
            if sp["centre"] == "run":
                # mu re-estimated over every block quantized so far (this one included): sums of the pre-RoPE
                # keys that pass each block's outlier cut (as `key_mean`), the offset of this block's keys
                from tq_hf_cache.rope import OUTLIER_NORM_RATIO

                x = self.rope.invert(k[:, :, f:], pos[f:])
                norms = torch.linalg.vector_norm(x, dim=-1)
                keep = (norms <= norms.nanmedian(dim=-1, keepdim=True).values * OUTLIER_NORM_RATIO).unsqueeze(-1)
                tot = torch.where(keep, x, 0.0).sum(dim=2, keepdim=True)
                cnt = keep.sum(dim=2, keepdim=True).float()
                if self.mu is None:
                    self.mu_sum, self.mu_cnt = tot, cnt
                else:
                    self.mu_sum, self.mu_cnt = self.mu_sum + tot, self.mu_cnt + cnt
                self.mu = self.mu_sum / self.mu_cnt.clamp_min(1)
            elif self.mu is None:
                from tq_hf_cache.rope import key_mean

                self.mu = key_mean(self.rope, k[:, :, f:], pos[f:])
            off = self.rope.apply(self.mu, pos)
            kq = kq - off
        if sp.get("kscale") and self.kscale is None:
            # per-channel scale before the rotation from the prompt's own first block: E[k_c^2]^-alpha
            ms = kq[:, :, f:].pow(2).mean(2, keepdim=True)
            s = (ms / ms.mean(-1, keepdim=True)).clamp_min(1e-4).pow(-sp["kscale"])
            self.kscale = s.half().float()
        vq, voff = v.float(), None
        if sp.get("vcentre"):
            # value centring: the first quantized block's mean value per head (float16 side information),
            # subtracted before coding, added back after (the decoder adds mu times the quantized tokens' weight)
            if self.vmu is None:
                self.vmu = v[:, :, f:].float().mean(2, keepdim=True).half().float()
            voff = self.vmu
            vq = vq - voff
        ss = sp.get("search", 0)
        knc, vnc, vss = sp.get("knc", sp.get("nc", "")), sp.get("vnc", sp.get("nc", "")), sp.get("vsearch", ss)
        if self.rsel:
            # rotation chosen per layer from the first quantized block (sinks left out): of `rsel` seeded
            # rotations, the one whose codes reconstruct the block best, for keys and for values separately
            self.rsel = 0
            cands = [self.rot] + [self.make_rotation(d, self.seed + 1000 * r, sp.get("rot", "auto"))
                                  for r in range(1, sp["rsel"])]
            if self.kc is not None:
                x = kq[:, :, f:]
                self.rot = min(cands, key=lambda r: (fake_quant(x, r, self.kc, knc, self.kscale, ss).float() - x)
                               .pow(2).sum().item())
            if self.vc is not None:
                x = vq[:, :, f:]
                self.vrot = min(cands, key=lambda r: (fake_quant(x, r, self.vc, vnc, None, vss).float() - x)
                                .pow(2).sum().item())
        kh = k if self.kc is None else fake_quant(kq, self.rot, self.kc, knc, self.kscale, ss)
        if self.kc is not None and off is not None:
            kh = (kh.float() + off).to(k.dtype)
        vh = v if self.vc is None else fake_quant(vq, self.vrot, self.vc, vnc, None, vss)
        if self.vc is not None and voff is not None:
            vh = (vh.float() + voff).to(v.dtype)
        s = max(min(self.sinks - pos0, n), 0)
        if s:
            kh[:, :, :s], vh[:, :, :s] = k[:, :, :s], v[:, :, :s]
        return kh, vh


class SimLayer(_Sim, DynamicLayer):
    pass


class SimSlidingLayer(_Sim, DynamicSlidingWindowLayer):
    pass


def sim_cache(model_config, layer_specs: list[dict], seed: int):
    """A DynamicCache whose layers are simulated TurboQuant layers (layer_specs[i] for layer i)."""
    from tq_hf_cache._compat import layer_types_and_kwargs
    from tq_hf_cache.rope import rope_angles

    types, kws = layer_types_and_kwargs(model_config)
    cache = DynamicCache(config=model_config)
    ropes = rope_angles(model_config, sorted(set(types))) if any(s.get("centre") for s in layer_specs) else {}
    for i, (t, kw) in enumerate(zip(types, kws)):
        sp = layer_specs[i]
        if sp["k"] == "fp" and sp["v"] == "fp":
            continue
        if t == "full_attention":
            layer = SimLayer()
        elif t == "sliding_attention":
            if int(kw["sliding_window"]) - 1 <= sp.get("window", 128):  # as the package: never quantized
                continue
            layer = SimSlidingLayer(sliding_window=int(kw["sliding_window"]))
        else:
            raise ValueError(t)
        layer.setup(i, sp, ropes.get(t), seed)
        cache.layers[i] = layer
    return cache


# ---------------------------------------------------------------------------------------------------------------
# candidates: name -> per-layer specs (and a description)

def _uniform(n, **spec):
    return [dict(spec) for _ in range(n)]


def candidate(name: str, info: dict) -> list[dict]:
    """Per-layer specs of a candidate, for a model of `info` (eval.models.model_shape + layer types list).
    Names: 'k{K}v{V}' with K, V codec names ('s4', 'p2', 'q2', ...) or integers for scalar; options after '+':
    nc (norm fix 'norm' on keys and values), ls (least-squares gain), knc (keys only), c (key centring),
    sinks{N}, ks{alpha} (per-channel key scale), edge (first and last layer k8v4 ... see `_edge`);
    kls / vls (least-squares gain on keys / values only, over nc), cr (key centring, mu re-estimated over every
    block quantized so far), vc (value centring, the first quantized block's mean), rot=dense (a dense random
    orthogonal rotation instead of 'auto', Hadamard with random signs here), ss{N} (encoder gain search over N
    input scales, keys and values; vss{N} values only, vss0 none: see `fake_quant`), rsel{N} (per layer, of N
    seeded rotations the one that codes the first quantized block best, keys and values chosen separately)."""
    base, *opts = name.split("+")
    kk, vv = base[1:].split("v")
    kk = kk if kk[0].isalpha() else "s" + kk
    vv = vv if vv[0].isalpha() else "s" + vv
    n = info["num_layers"]
    spec = {"k": kk, "v": vv}
    specs = _uniform(n, **spec)
    for o in opts:
        for sp in specs:
            if o == "nc":
                sp["nc"] = "norm"
            elif o == "ls":
                sp["nc"] = "ls"
            elif o == "knc":
                sp["nc"], sp["vnc"] = "norm", ""
            elif o == "kls":
                sp["knc"] = "ls"
            elif o == "vls":
                sp["vnc"] = "ls"
            elif o == "c":
                sp["centre"] = True
            elif o == "cr":
                sp["centre"] = "run"
            elif o == "vc":
                sp["vcentre"] = True
            elif o.startswith("rot="):
                sp["rot"] = {"dense": "orthogonal"}.get(o[4:], o[4:])
            elif o.startswith("rsel"):
                sp["rsel"] = int(o[4:])
            elif o.startswith("vss"):
                sp["vsearch"] = int(o[3:])
            elif o.startswith("ss"):
                sp["search"] = int(o[2:])
            elif o.startswith("sinks"):
                sp["sinks"] = int(o[5:])
            elif o.startswith("win"):
                sp["window"] = int(o[3:])
            elif o.startswith("ks"):
                sp["kscale"] = float(o[2:])
        if o.startswith("L0"):  # layer 0 at another width: L0=k8v4
            k0, v0 = o.split("=")[1][1:].split("v")
            specs[0]["k"] = k0 if k0[0].isalpha() else "s" + k0
            specs[0]["v"] = v0 if v0[0].isalpha() else "s" + v0
    return specs


def _bits(codec: str) -> float:
    return 16.0 if codec == "fp" else float(codec[1:])


def cost(specs: list[dict], info: dict) -> dict:
    """Code bits per coordinate (keys and values, weighted by the tokens each layer holds at CONTEXT), and bytes per
    token per layer at CONTEXT: codes + float16 norms, plus exact tokens beyond today's (4 sinks, 128 window)
    amortized over CONTEXT, plus per-layer side information (a float16 scale per channel) amortized too."""
    h, d = info["num_key_value_heads"], info["head_dim"]
    held = [CONTEXT if t == "full_attention" else min(CONTEXT, info["sliding_window"] - 1) for t in info["types"]]
    tot_w = code = byts = 0.0
    for sp, w, t in zip(specs, held, info["types"]):
        kb, vb = _bits(sp["k"]), _bits(sp["v"])
        per = h * ((d * kb / 8 + (2 if kb < 16 else 0)) + (d * vb / 8 + (2 if vb < 16 else 0)))
        fp_tok = 2 * h * d * 2
        extra = (max(sp.get("sinks", 4), 0) - 4 if t == "full_attention" else 0) + (sp.get("window", 128) - 128)
        side = (h * d * 2 * (bool(sp.get("kscale")) + bool(sp.get("vcentre")))) / w
        byts += w * (per + extra * (fp_tok - per) / w + side)
        code += w * (kb + vb) / 2
        tot_w += w
    per_layer = byts / tot_w
    return {"code_bits_per_coord": code / tot_w, "bytes_per_token_layer": per_layer,
            "bits_per_coord_all": per_layer * 8 / (2 * h * d)}


# ---------------------------------------------------------------------------------------------------------------

def load_text(name: str, tokenizer, n: int) -> tuple[torch.Tensor, str]:
    from tq_hf_cache import texts

    if name == "pkg":
        src = f"{texts.TEXT_SOURCE}, from paragraph {texts.HELD_OUT_START} (the quality tables' text)"
        chars = n * 6
        while True:
            ids = tokenizer(texts.package_text(chars, start=texts.HELD_OUT_START), return_tensors="pt").input_ids
            if ids.shape[1] >= n:
                return ids[:, :n], src
            chars *= 2
    if name == "gpl3":
        with open(GPL3, encoding="utf-8") as f:
            text = f.read()
        ids = tokenizer(text, return_tensors="pt").input_ids
        if ids.shape[1] < n:
            raise ValueError(f"{GPL3} has {ids.shape[1]} tokens, fewer than {n}")
        return ids[:, :n], "GNU GPL v3 text, /usr/share/common-licenses/GPL-3 (Debian package base-files)"
    raise ValueError(name)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2")
    p.add_argument("--texts", default="pkg,gpl3")
    p.add_argument("--seeds", default="0,1,2,3")
    p.add_argument("--candidates", default="k4v2,k3v3")
    p.add_argument("--ppl-tokens", type=int, default=0)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--package-check", action="store_true", help="also run the package's k4v2 at seed 0")
    p.add_argument("--needle", default="", help="candidates to run the needle task on (seed 0)")
    p.add_argument("--out", default="benchmarks/results/low_bit_study.json")
    p.add_argument("--plot", default="", help="only draw this PNG from --out")
    a = p.parse_args()
    if a.plot:
        return plot(a.out, a.plot)
    torch.set_num_threads(1)
    from tq_hf_cache._compat import layer_types_and_kwargs
    from tq_hf_cache.eval import tasks
    from tq_hf_cache.eval.models import load_model

    model, tok, info = load_model(a.model)
    info["types"] = layer_types_and_kwargs(model.config)[0]
    n_tok = a.ppl_tokens or PPL_TOKENS.get(a.model, 2048)
    seeds = [int(s) for s in a.seeds.split(",")]
    res = json.load(open(a.out)) if os.path.exists(a.out) else {"rows": [], "fp": {}, "texts": {}, "runs": []}
    res["runs"].append({"model": a.model, "argv": vars(a), "torch": torch.__version__,
                        "transformers": __import__("transformers").__version__, "threads": 1})

    def save():
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out + ".tmp", "w") as f:
            json.dump(res, f, indent=1)
        os.replace(a.out + ".tmp", a.out)

    for text in a.texts.split(","):
        ids, src = load_text(text, tok, n_tok)
        res["texts"][text] = src
        key = f"{a.model}/{text}/{n_tok}"
        if key not in res["fp"]:
            t = time.time()
            out, argmax, _ = tasks.perplexity(model, ids, lambda: DynamicCache(config=model.config), a.chunk)
            res["fp"][key] = {"ppl": out["ppl"], "seconds": round(time.time() - t, 1)}
            save()
        fp = res["fp"][key]["ppl"]
        print(f"[{key}] fp ppl {fp:.4f}", flush=True)
        if a.package_check and text == "pkg":
            from tq_hf_cache import TurboQuantCache

            out, _, _ = tasks.perplexity(model, ids, lambda: TurboQuantCache("k4v2", config=model.config), a.chunk)
            res.setdefault("package_check", {})[key] = {"k4v2_seed0_delta_pct": 100 * (out["ppl"] / fp - 1)}
            print(f"[{key}] package k4v2 seed 0: {100 * (out['ppl'] / fp - 1):+.3f}%", flush=True)
            save()
        for cand in a.candidates.split(","):
            specs = candidate(cand, info)
            c = cost(specs, info)
            row = next((r for r in res["rows"] if r["model"] == a.model and r["text"] == text
                        and r["candidate"] == cand and r["tokens"] == n_tok), None)
            if row is None:
                row = {"model": a.model, "text": text, "candidate": cand, "tokens": n_tok, **c, "per_seed": {}}
                res["rows"].append(row)
            for s in seeds:
                if str(s) in row["per_seed"]:
                    continue
                t = time.time()
                out, _, _ = tasks.perplexity(model, ids, lambda: sim_cache(model.config, specs, s), a.chunk)
                row["per_seed"][str(s)] = 100 * (out["ppl"] / fp - 1)
                vals = list(row["per_seed"].values())
                row.update(mean=sum(vals) / len(vals), min=min(vals), max=max(vals), seeds=len(vals))
                print(f"[{key}] {cand} seed {s}: {row['per_seed'][str(s)]:+.3f}% ({time.time() - t:.0f} s; "
                      f"{c['code_bits_per_coord']:.3f} code bits, {c['bytes_per_token_layer']:.1f} B/tok/layer)",
                      flush=True)
                save()
    if a.needle:
        needle_run(a, model, tok, info, res, save)


def needle_run(a, model, tok, info, res, save):
    """Needles (package paragraphs, the quality tables' protocol) for fp and the named candidates, seed 0."""
    from tq_hf_cache import texts
    from tq_hf_cache.eval import tasks

    lengths = [1024, 4096] if a.model == "smollm2" else [2048]
    depths = [0.1, 0.5, 0.9]
    paras = list(texts.paragraphs()[texts.HELD_OUT_START:])
    out = res.setdefault("needle", {}).setdefault(a.model, {})
    for cand in ["fp", *a.needle.split(",")]:
        if cand in out:
            continue
        make = (lambda: DynamicCache(config=model.config)) if cand == "fp" else \
            (lambda specs=candidate(cand, info): sim_cache(model.config, specs, 0))
        rows = tasks.needle(model, tok, paras, make, lengths, depths, a.chunk, 8, 0)
        out[cand] = [{"length": r["length"], "depth": r["depth"], "found": r["found"], "answer": r["answer"]}
                     for r in rows]
        print(f"[needle {a.model}] {cand}: " + " ".join("Y" if r["found"] else "n" for r in rows), flush=True)
        save()


def plot(path: str, png: str) -> None:
    """Δppl mean over seeds (bars) with the seeds' range, per candidate, one panel per model and text."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = json.load(open(path))
    rows = [r for r in res["rows"] if r.get("seeds")]
    order = {"smollm2": 0, "gemma3-270m": 1, "pkg": 0, "gpl3": 1}
    panels = sorted({(r["model"], r["text"]) for r in rows}, key=lambda mt: (order.get(mt[0], 9), order.get(mt[1], 9)))
    cands = []
    for r in rows:
        if r["candidate"] not in cands:
            cands.append(r["candidate"])
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 0.32 * len(cands) + 1.8), sharey=True,
                             squeeze=False)
    for ax, (m, t) in zip(axes[0], panels):
        for y, c in enumerate(cands):
            r = next((r for r in rows if (r["model"], r["text"], r["candidate"]) == (m, t, c)), None)
            if r is None:
                continue
            top = 3.0  # the axis ends here: longer bars are cut, their label says the value
            ax.barh(y, min(r["mean"], top), color="tab:blue" if r["seeds"] >= 4 else "tab:gray")
            ax.plot([r["min"], min(r["max"], top)], [y, y], color="black", lw=1)
            ax.text(min(max(r["max"], 0) + 0.05, top - 0.6), y, f"{r['mean']:+.2f} ({r['seeds']})", va="center",
                    fontsize=7)
        ax.set_xlim(-0.1, 3.0)
        ax.axvline(0.5, color="tab:red", ls="--", lw=1)
        ax.set_title(f"{m} / {t}", fontsize=9)
        ax.set_xlabel("Δppl vs fp, % (mean over seeds; line: range)", fontsize=8)
    axes[0][0].set_yticks(range(len(cands)), cands, fontsize=7)
    axes[0][0].invert_yaxis()
    fig.suptitle("Issue 69: candidates at 3.0 code bits a coordinate (grey: fewer than 4 seeds)", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    main()
