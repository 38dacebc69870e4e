"""What every layer state shares: its quantizers (made by one factory for both caches), the one naming of its
tensors (prefix files and store pages use it), and the all-or-nothing check of a `load_state`.

A layer's state holds, per batch row and KV head, for positions [0, length):
- the codes and norms of every position past the sinks (`{part}_packed`, `{part}_norms`, one row per position on
  axis 2; part "k" is the keys, or part 0 of split keys, "k1", "k2", ... the further parts, "v" the values);
- exact copies of the first positions, the attention sinks (`sink_k`, `sink_v`);
- exact copies of the newest positions, the window (`window_k`, `window_v`): what the config's
  `residual_length` keeps exact;
- a centred layer's pre-RoPE key mean (`key_mean`, (B, H, 1, D) float32);
- the lengths (`lengths()`): positions held, the first one the window holds, sinks kept.
Two allocation policies hold them: `GrowableState` (buffers that grow, lengths on the host: `TurboQuantCache`) and
`FixedState` (one buffer of fixed capacity, lengths on the device, CUDA-graph safe: `TurboQuantStaticCache`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..quant.codebook import Codebook, theoretical_codebook
from ..quant.key_split import KeySplit, make_split
from ..quant.rotation import Rotation


@dataclass(eq=False)
class Quantizers:
    """A layer's rotation and codebooks (on its device), and its key split when the keys are split in parts."""

    rotation: Rotation
    k_codebook: Codebook
    v_codebook: Codebook
    key_split: KeySplit | None = None


def make_quantizers(layer_idx: int, heads: int, dim: int, key_bits: int, value_bits: int, rotation_for,
                    codebook_for, split_spec: dict | None, device) -> Quantizers:
    """One layer's quantizers. rotation_for: dim -> Rotation; codebook_for: (kind, bits, dim) -> Codebook; a split
    key's parts are vectors of their own dims and take the theoretical codebooks of those dims."""
    split = None
    if split_spec is not None:
        split = make_split(split_spec, layer_idx, heads, dim, rotation_for, theoretical_codebook).to(device)
    k_codebook, v_codebook = codebook_for("key", key_bits, dim), codebook_for("value", value_bits, dim)
    for name, cb in (("key", k_codebook), ("value", v_codebook)):
        if cb.per_head and cb.centroids.shape[0] != heads:
            raise ValueError(
                f"layer {layer_idx}: the {name} codebook has {cb.centroids.shape[0]} heads but the model has {heads} "
                "KV heads"
            )
    q = Quantizers(rotation_for(dim).to(device), k_codebook.to(device), v_codebook.to(device), split)
    if split is not None:
        q.k_codebook = split.parts[0][1]
    return q


def part_names(key_parts: int) -> list[str]:
    """The code parts' names: "k" (keys, or part 0 of split keys), "k1", "k2", ..., then "v"."""
    return ["k", *(f"k{j}" for j in range(1, key_parts)), "v"]


def is_paged(name: str) -> bool:
    """Whether a state tensor has one row per position on axis 2 (the codes and norms)."""
    return name.endswith(("_packed", "_norms"))


def check_tensors(where: str, got: dict[str, torch.Tensor], expect: dict[str, tuple[tuple, torch.dtype]]) -> None:
    """Refuse, before anything is written, tensors whose names, shapes or dtypes are not `expect`'s."""
    missing, extra = sorted(set(expect) - set(got)), sorted(set(got) - set(expect))
    if missing or extra:
        raise ValueError(f"{where}: the state lacks {missing} and has unexpected {extra}" if missing else
                         f"{where}: the state has unexpected tensors {extra}")
    for name, (shape, dtype) in expect.items():
        t = got[name]
        if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            raise ValueError(f"{where}: tensor {name!r} is {tuple(t.shape)} {t.dtype}, expected {tuple(shape)} {dtype}")


class LayerState:
    """The parts both policies share (see the module docstring). Subclasses: `GrowableState`, `FixedState`.

    Public state API: `state()` (tensors by the one naming), `lengths()`, `load_state(tensors, lengths)`, `view()`
    (a `PackedKV` of what attention reads), `nbytes()`."""

    def __init__(self, quantizers: Quantizers, *, batch: int, heads: int, head_dim: int, dtype: torch.dtype,
                 device, sink_tokens: int, norm_dtype: torch.dtype, rope=None, layer_idx: int | None = None):
        q = quantizers
        self.quantizers = q
        self.rotation, self.k_codebook, self.v_codebook, self.key_split = (q.rotation, q.k_codebook, q.v_codebook,
                                                                          q.key_split)
        self.batch, self.heads, self.head_dim = batch, heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.sink_tokens, self.norm_dtype, self.rope, self.layer_idx = sink_tokens, norm_dtype, rope, layer_idx

    @property
    def key_parts(self) -> int:
        return 1 if self.key_split is None else len(self.key_split.parts)

    def part_dims(self) -> list[tuple[str, int, int]]:
        """(name, dim, bits) of each code part."""
        if self.key_split is None:
            keys = [(self.head_dim, self.k_codebook.bits)]
        else:
            keys = [(rot.dim, cb.bits) for rot, cb in self.key_split.parts]
        return [(n, d, b) for n, (d, b) in zip(part_names(self.key_parts), [*keys, (self.head_dim,
                                                                                      self.v_codebook.bits)])]
