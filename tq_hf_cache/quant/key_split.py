"""Split keys: the paper's outlier channels, as two TurboQuant vectors per key.

Why: in the cached (post-RoPE) basis the weight of a key error in channel c on the score q.k is E[q_c^2] E[k_c^2],
and a few RoPE channel pairs hold most of it (SmolLM2: the top 16 of 64 channels hold 79-100 %). One rotation over
all D channels spreads the error evenly, so most key bits go to channels the scores barely see
(eval_findings.md, "Outlier channels: simulated, then built", in benchmarks/results/archive/ at commit a573dec).

Format: per layer and KV head, the channels are ordered by calibrated weight (whole RoPE pairs) and cut into parts
of given sizes; each part is its own TurboQuant vector at its own width, with its own norm, rotation and
(theoretical Lloyd-Max) codebook. A key costs sum(size_p * bits_p) bits of codes and one norm per part. The score
error of part p is about mse(bits_p) * Q_p * K_p / size_p (Q_p, K_p: the part's share of E||q||^2 and E||k||^2), so
a few heavy channels at many bits and the rest at fewer beat one width everywhere. Only keys are split: the same
split of values did not pay.

    spec = calibrate_key_split(model, input_ids, sizes=[64, 64, 128], deltas=[2, 0, -1], tq_config=k4v2)
    config = TurboQuantConfig.from_preset("k4v2", key_split=spec, key_centering=True)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .codebook import Codebook
from ..config import MIN_PART, SPEC_KEYS, TurboQuantConfig, check_spec  # noqa: F401  (the spec is config)
from .packing import packed_bytes
from .rotation import Rotation



@dataclass(eq=False)
class KeySplit:
    """One layer's key split and its quantizers.

    Args:
        order: (H, D) int64; per KV head a permutation of the channels, part 0's first, then part 1's, ...
        inverse: (H, D) int64; the position of channel c in `order`.
        parts: per part, (rotation, codebook) of its dim (the part's channel count).
    """

    order: torch.Tensor
    inverse: torch.Tensor
    parts: tuple[tuple[Rotation, Codebook], ...]

    @property
    def sizes(self) -> list[int]:
        return [rot.dim for rot, _ in self.parts]

    @property
    def bits(self) -> list[int]:
        return [cb.bits for _, cb in self.parts]

    @property
    def part_bytes(self) -> list[int]:
        """Packed bytes of one key's codes, per part."""
        return [packed_bytes(rot.dim, cb.bits) for rot, cb in self.parts]

    @property
    def dim(self) -> int:
        return self.order.shape[1]

    def to(self, device) -> "KeySplit":
        device = torch.device(device)
        if self.order.device == device:
            return self
        return KeySplit(self.order.to(device), self.inverse.to(device),
                        tuple((rot.to(device), cb.to(device)) for rot, cb in self.parts))

    def split(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x (B, H, T, D) -> each part's channels (B, H, T, size), contiguous."""
        idx = self.order.to(x.device)[None, :, None, :].expand(x.shape[0], -1, x.shape[2], -1)
        return [p.contiguous() for p in x.gather(-1, idx).split(self.sizes, dim=-1)]

    def join(self, parts: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """Write each part's channels back into their places in out (B, H, T, D)."""
        both = torch.cat(parts, dim=-1)
        idx = self.inverse.to(out.device)[None, :, None, :].expand(out.shape[0], -1, out.shape[2], -1)
        return out.copy_(both.gather(-1, idx))


def make_split(spec: dict, layer: int, heads: int, dim: int, rotation_for, codebook_for) -> KeySplit:
    """The KeySplit of a checked spec for keys of `heads` KV heads of dim `dim`; rotation_for(dim) -> Rotation,
    codebook_for(bits, dim) -> Codebook."""
    if len(spec["order"]) != heads:
        raise ValueError(f"key_split[{layer}] gives channel orders for {len(spec['order'])} KV heads, the layer has {heads}")
    if sum(spec["sizes"]) != dim:
        raise ValueError(f"key_split[{layer}] parts of sizes {spec['sizes']} hold {sum(spec['sizes'])} channels, the "
                         f"layer's head dim is {dim}")
    order = torch.tensor(spec["order"], dtype=torch.int64)
    parts = tuple((rotation_for(n), codebook_for(b, n)) for n, b in zip(spec["sizes"], spec["bits"]))
    return KeySplit(order, torch.argsort(order, dim=1), parts)


def split_bits(spec: dict) -> int:
    """Code bits of one split key (norms not included)."""
    return sum(n * b for n, b in zip(spec["sizes"], spec["bits"]))


# ---- calibration: which channels ----------------------------------------------------------------------------------

def capture_qk(model, input_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per attention layer, (queries, keys) after RoPE, (1, H, T, D) each, from one forward pass. Works for models
    whose attention calls their module's `apply_rotary_pos_emb` (Llama, Qwen, Mistral, Gemma, ...)."""
    import sys

    layers = model.model.layers if hasattr(model, "model") else model.layers
    attn = layers[0].self_attn
    mod = sys.modules[type(attn).__module__]
    if not hasattr(mod, "apply_rotary_pos_emb"):
        raise ValueError(f"{mod.__name__} has no apply_rotary_pos_emb: key split calibration needs a RoPE model")
    orig = mod.apply_rotary_pos_emb
    caught = []

    def rope(q, k, *args, **kwargs):
        qe, ke = orig(q, k, *args, **kwargs)
        caught.append((qe.detach().float(), ke.detach().float()))
        return qe, ke

    mod.apply_rotary_pos_emb = rope
    try:
        with torch.no_grad():
            model(input_ids[:, :].to(model.device), use_cache=False)
    finally:
        mod.apply_rotary_pos_emb = orig
    if len(caught) != len(layers):
        raise ValueError(f"caught RoPE for {len(caught)} of {len(layers)} layers; this model is not supported")
    return caught


def channel_weights(q: torch.Tensor, k: torch.Tensor, skip: int = 4) -> torch.Tensor:
    """(Hkv, D/2): per KV head and RoPE pair (c, c + D/2), the summed E[q_c^2] E[k_c^2] over the pair's two channels,
    q's mean taken over the query heads of the GQA group; the first `skip` tokens (attention sinks) left out."""
    hq, hk, d = q.shape[1], k.shape[1], k.shape[-1]
    qe = q[0, :, skip:].pow(2).mean(1).view(hk, hq // hk, d).mean(1)
    w = qe * k[0, :, skip:].pow(2).mean(1)
    return w[:, : d // 2] + w[:, d // 2:]


def pair_order(pair_weights: torch.Tensor) -> torch.Tensor:
    """(Hkv, D): per KV head the channels by RoPE pair, heaviest pair first; within a part they are sorted later."""
    half = pair_weights.shape[-1]
    idx = pair_weights.argsort(dim=-1, descending=True)
    return torch.stack([idx, idx + half], dim=-1).reshape(idx.shape[0], 2 * half)


def calibrate_key_split(model, input_ids: torch.Tensor, sizes: list[int], deltas: list[int],
                        tq_config=None) -> dict[int, dict]:
    """A `key_split` for every layer `tq_config` quantizes: part p takes the next sizes[p] channels, heaviest RoPE
    pairs first, at the layer's key bits + deltas[p].

    Args:
        model: a transformers causal LM with RoPE attention.
        input_ids: (1, T) calibration tokens (the first 4 are left out of the weights: attention sinks).
        sizes: channels per part, even (whole RoPE pairs), >= 4 each, summing to the head dim.
        deltas: bits added to the layer's key bits for each part (the results must lie in 1..8).
        tq_config: the config whose per-layer key bits are the base (default: the default preset).

    Example: `calibrate_key_split(model, ids, [64, 64, 128], [2, 0, -1], TurboQuantConfig.from_preset("k4v2"))`
    gives Gemma 3's k4v2 keys 64 channels at 6 bits, 64 at 4 and 128 at 3: 1024 bits, as 256 at 4.
    """
    from .._compat import layer_types_and_kwargs

    cfg = tq_config if tq_config is not None else TurboQuantConfig()
    sizes, deltas = list(sizes), list(deltas)
    if len(sizes) < 2 or len(sizes) != len(deltas):
        raise ValueError(f"sizes and deltas need one entry per part, at least 2 parts; got sizes={sizes}, deltas={deltas}")
    for n in sizes:
        if isinstance(n, bool) or not isinstance(n, int) or n < MIN_PART or n % 2:
            raise ValueError(f"every part needs an even number of channels >= {MIN_PART + 1} (whole RoPE pairs, and a "
                             f"part's codebook needs {MIN_PART} or more dimensions), got sizes={sizes}")
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] < 16:
        raise ValueError(f"input_ids must be (1, T) with T >= 16 calibration tokens, got {tuple(input_ids.shape)}")
    types, _ = layer_types_and_kwargs(model.config)
    caught = capture_qk(model, input_ids)
    d = caught[0][1].shape[-1]
    if sum(sizes) != d:
        raise ValueError(f"sizes {sizes} sum to {sum(sizes)}; they must sum to the head dim {d}")
    out = {}
    for i, (q, k) in enumerate(caught):
        bits = cfg.bits_for_layer(i, len(types), types[i])
        if bits is None:
            continue
        part_bits = [bits[0] + dl for dl in deltas]
        for p, b in enumerate(part_bits):
            if not 1 <= b <= 8:
                raise ValueError(f"layer {i}: key bits {bits[0]} + deltas[{p}] ({deltas[p]}) gives {b}; the bits must "
                                 "lie in 1..8")
        ranked = pair_order(channel_weights(q, k))
        order = [sum((sorted(row[a: a + n].tolist()) for a, n in zip(_starts(sizes), sizes)), []) for row in ranked]
        out[i] = {"bits": part_bits, "sizes": sizes, "order": order}
    return out


def _starts(sizes: list[int]) -> list[int]:
    return [sum(sizes[:p]) for p in range(len(sizes))]
