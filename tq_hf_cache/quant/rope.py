"""The model's rotary position embedding, as the cache needs it for pre-RoPE key centring.

Keys reach the cache after RoPE: k_t = R(t) k'_t. Their pre-RoPE mean mu is large in many models, so the cache
quantizes k_t - R(t) mu (`TurboQuantConfig.key_centering`) and adds R(t) mu back on every read. Any R works for
correctness, as long as quantize and read use the same one; the closer it is to the model's own rotation, the
better the centring. `rope_angles(config)` takes it from the model's rotary-embedding class: its cos / sin at
positions 0 and 1 give the attention scaling and every frequency.

HF convention (rotate_half): R(t) x = x * cos_t + rotate_half(x) * sin_t, cos_t = scale * cos(t * theta) over both
halves of the head dim.
"""

from __future__ import annotations

import copy
import importlib
import inspect
from dataclasses import dataclass, field

import torch

from .derived import Derived


@dataclass(frozen=True, eq=False)
class RopeAngles:
    """Args:
        theta: (D/2,) float64 frequencies (radians per position).
        scale: the attention scaling the model multiplies cos and sin by.
    """

    theta: torch.Tensor
    scale: float
    derived: Derived = field(default_factory=Derived, init=False, repr=False)  # `scores`' tables, per device

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each (T, D) float32 on the positions' device, for absolute positions (T,)."""
        ang = positions.to(torch.float64)[:, None] * self.theta.to(positions.device)[None, :]
        ang = torch.cat([ang, ang], dim=-1)
        return (ang.cos() * self.scale).float(), (ang.sin() * self.scale).float()

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """R(t) x for x (..., T, D) pre-RoPE, float32."""
        cos, sin = self.cos_sin(positions)
        return x.float() * cos + rotate_half(x.float()) * sin

    def invert(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """R(t)^-1 x for x (..., T, D) post-RoPE, float32 (exact for any scale)."""
        cos, sin = self.cos_sin(positions)
        return (x.float() * cos - rotate_half(x.float()) * sin) / (self.scale * self.scale)


    def scores(self, q: torch.Tensor, mu: torch.Tensor, start: int, length: int, block: int = 256) -> torch.Tensor:
        """q . R(t) mu for t in [start, start + length): q (..., D), mu broadcastable to it -> (..., length) float32.

        No (length, D) table: with t = start + a * block + b, cos / sin of t come from those of start, of a * block
        and of b (angle addition); the last two are cached per device. Per call the work is a few small ops on q
        and one (..., blocks, D) @ (D, block) product."""
        h = self.theta.numel()
        q, mu = q.float(), mu.float()
        q1, q2, m1, m2 = q[..., :h], q[..., h:], mu[..., :h], mu[..., h:]
        u, v = q1 * m1 + q2 * m2, q2 * m1 - q1 * m2  # q . R(t) mu = sum_i u_i cos(t theta_i) + v_i sin(t theta_i)
        ang0 = self.theta.to(q.device) * float(start)
        c0, s0 = ang0.cos().float(), ang0.sin().float()
        u, v = (u * c0 + v * s0).unsqueeze(-2), (v * c0 - u * s0).unsqueeze(-2)  # start folded in
        n_blocks = -(-length // block)
        ca, sa, table = self._tables(n_blocks, block, q.device)
        pq = torch.cat([u * ca + v * sa, v * ca - u * sa], dim=-1)  # (..., n_blocks, D)
        return (pq @ table).flatten(-2)[..., :length]

    def _tables(self, n_blocks: int, block: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """cos / sin of a * block * theta for a < n_blocks (float32 (n_blocks, D/2)), and the (D, block) table of
        scale * [cos(b theta); sin(b theta)], built once per device and grown by doubling; held by this object."""
        key = ("rope.tables", torch.device(device), block)
        got = self.derived.find(key)
        if got is None or got[0].shape[0] < n_blocks:
            n = max(n_blocks, 2 * got[0].shape[0] if got is not None else 64)
            theta = self.theta.to(device)
            a = (block * torch.arange(n, device=device, dtype=torch.float64))[:, None] * theta
            b = torch.arange(block, device=device, dtype=torch.float64)[:, None] * theta
            table = (torch.cat([b.cos(), b.sin()], dim=-1) * self.scale).float().T.contiguous()
            got = self.derived.put(key, (a.cos().float(), a.sin().float(), table))
        return got[0][:n_blocks], got[1][:n_blocks], got[2]

OUTLIER_NORM_RATIO = 4.0  # a key whose pre-RoPE norm passes this multiple of its block's median is left out of mu


def key_mean(rope: RopeAngles, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A centred layer's mu from keys (B, H, T, D) after RoPE at `positions` (T,): (B, H, 1, D) float32, the mean of
    their pre-RoPE vectors over those whose norm is at most OUTLIER_NORM_RATIO times the (B, H) row's median norm.

    A plain mean lets one huge key (a massive activation past the sinks) move mu by its norm / T; every later key's
    code is then of k - R(t) mu, whose norm carries that offset. Half the keys at least are kept; a row with none
    kept (all non-finite) gets mu = 0. One pass over the keys and a median over T of their norms, no host read.
    The oracle: `reference.key_mean`."""
    x = rope.invert(keys, positions)
    norms = torch.linalg.vector_norm(x, dim=-1)
    cut = norms.nanmedian(dim=-1, keepdim=True).values * OUTLIER_NORM_RATIO
    keep = (norms <= cut).unsqueeze(-1)
    total = torch.where(keep, x, 0.0).sum(dim=2, keepdim=True)
    return total / keep.sum(dim=2, keepdim=True).clamp_min(1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def _rotary_class(text_config):
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    name = model_type_to_module_name(text_config.model_type)
    try:
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    except ImportError as e:
        raise ValueError(f"key_centering: no transformers modeling module for model type {text_config.model_type!r}") from e
    found = [c for n, c in vars(module).items() if n.endswith("RotaryEmbedding") and inspect.isclass(c)
             and c.__module__ == module.__name__]
    if len(found) != 1:
        raise ValueError(f"key_centering: expected one rotary embedding class in {module.__name__}, found "
                         f"{[c.__name__ for c in found]}")
    return found[0]


def _angles(rotary, layer_type: str | None, dim: int) -> RopeAngles:
    params = inspect.signature(rotary.forward).parameters
    x = torch.zeros(1, dtype=torch.float32)
    pos = torch.tensor([[0, 1]])
    cos, sin = rotary(x, pos, layer_type) if "layer_type" in params else rotary(x, pos)
    cos, sin = cos.reshape(2, -1).double(), sin.reshape(2, -1).double()
    if cos.shape[1] != dim:
        raise ValueError(f"key_centering: the rotary embedding covers {cos.shape[1]} of the head's {dim} dims "
                         "(partial RoPE is not supported)")
    scale = float(cos[0, 0])
    theta = torch.atan2(sin[1, : dim // 2], cos[1, : dim // 2])
    return RopeAngles(theta.contiguous(), scale)


def rope_angles(model_config, layer_types: list[str]) -> dict[str, RopeAngles]:
    """{layer type: RopeAngles} for the given layer types of a model, from its rotary-embedding class.

    Raises a ValueError naming the model type when the angles cannot be had (no RoPE, partial RoPE)."""
    text = model_config.get_text_config()
    dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    cls = _rotary_class(text)
    rotary = cls(config=text)
    per_type = "layer_type" in inspect.signature(rotary.forward).parameters
    out = {}
    for lt in sorted(set(layer_types)):
        if per_type:
            out[lt] = _angles(rotary, lt, dim)
        elif lt == "sliding_attention" and getattr(text, "rope_local_base_freq", None) is not None:
            # transformers 4.x Gemma 3: its local layers use a second rotary embedding built from this copy
            local = copy.deepcopy(text)
            local.rope_theta = text.rope_local_base_freq
            local.rope_scaling = {"rope_type": "default"}
            out[lt] = _angles(cls(config=local), None, dim)
        else:
            out[lt] = _angles(rotary, None, dim)
    return out


@dataclass(frozen=True, eq=False)
class KeyOffset:
    """What a centred layer subtracted from its keys before quantizing them: R(t) mu at absolute position t.

    Args:
        mu: (B, H, 1, D) float32, the pre-RoPE key mean per (batch row, KV head).
        rope: the layer's rotation by position.
        pos0: the absolute position of packed slot 0.
    """

    mu: torch.Tensor
    rope: RopeAngles
    pos0: int

    def keys(self, start: int, stop: int) -> torch.Tensor:
        """R(t) mu for the slots [start, stop): (B, H, stop - start, D) float32."""
        pos = torch.arange(self.pos0 + start, self.pos0 + stop, device=self.mu.device)
        return self.rope.apply(self.mu, pos)

    def add_to(self, out: torch.Tensor, start: int, chunk: int = 4096) -> torch.Tensor:
        """out[:, :, j] += R(pos0 + start + j) mu for out (B, H, T, D) of dequantized keys, in place, `chunk`
        positions at a time (a whole (B, H, T, D) float32 offset would double the dense history's memory)."""
        for j in range(0, out.shape[2], chunk):
            part = out[:, :, j : j + chunk]
            part.add_(self.keys(start + j, start + j + part.shape[2]).to(out.dtype))
        return out

    def scores(self, query: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """q . R(t) mu for query (B, Hq, n, D) and the slots [start, stop): (B, Hq, n, stop - start) float32."""
        b, hq, n, d = query.shape
        hkv = self.mu.shape[1]
        q = query.reshape(b, hkv, (hq // hkv) * n, d)
        return self.rope.scores(q, self.mu, self.pos0 + start, stop - start).reshape(b, hq, n, stop - start)

    def rows(self, start: int, stop: int) -> "KeyOffset":
        return KeyOffset(self.mu[start:stop], self.rope, self.pos0)
