"""The static layer's fused attention (Triton kernel, under the interpreter without CUDA) and the custom ops, against
the torch oracle `reference.static_attention`; `torch.library.opcheck` of every tq_hf_cache:: op."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from tq_hf_cache import ops, reference  # noqa: E402
from tq_hf_cache.codebook import Codebook, theoretical_codebook  # noqa: E402
from tq_hf_cache.packed_kv import PackedKV, ring_positions  # noqa: E402
from tq_hf_cache.rotation import make_rotation  # noqa: E402

try:
    from tq_hf_cache.kernels.decode_attention import decode_attention
except ImportError:  # no Triton at all
    decode_attention = None

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(decode_attention is None, reason="triton is not installed")


def fresh_seed() -> int:
    return torch.seed() % 2**31


def codebook(bits, d, hkv=None, g=None):
    cb = Codebook.from_centroids(torch.linspace(-4, 4, 256) * d**-0.5, 8) if bits == 8 else theoretical_codebook(bits, d)
    if hkv is not None:
        cb = Codebook.from_centroids(cb.centroids * (1 + 0.2 * torch.rand(hkv, 1, generator=g)), bits)
    return cb


def make_kv(b, hkv, cap, ring, sinks, length, exact_from, d, kbits, vbits, dtype, seed, per_head=False):
    """A static layer's buffers after `length` positions, with the ring live from `exact_from`; slots past `length`
    and dead ring slots hold random garbage (poison) that attention must never read."""
    g = torch.Generator().manual_seed(seed)
    rot = make_rotation(d, seed % 1000)
    kcb = codebook(kbits, d, hkv if per_head else None, g)
    vcb = codebook(vbits, d, hkv if per_head else None, g)
    k = (torch.randn(b, hkv, cap, d, generator=g) * (0.5 + 3 * torch.rand(b, hkv, cap, 1, generator=g))).to(dtype)
    v = (torch.randn(b, hkv, cap, d, generator=g) * (0.5 + 2 * torch.rand(b, hkv, cap, 1, generator=g))).to(dtype)
    kp, kn = reference.quantize(k, rot, kcb)
    vp, vn = reference.quantize(v, rot, vcb)
    for t in (kp, vp):
        t[:, :, length:] = torch.randint(0, 256, t[:, :, length:].shape, dtype=torch.uint8, generator=g)
    for t in (kn, vn):
        t[:, :, length:] = 1e4
    ring_k = torch.randn(b, hkv, ring, d, generator=g).to(dtype) * 100
    ring_v = torch.randn(b, hkv, ring, d, generator=g).to(dtype) * 100
    pos, live = ring_positions(torch.tensor(length), torch.tensor(exact_from), ring)
    for j in range(ring):
        if live[j]:
            ring_k[:, :, j], ring_v[:, :, j] = k[:, :, pos[j]], v[:, :, pos[j]]
    sink_k = torch.randn(b, hkv, sinks + 1, d, generator=g).to(dtype) * 100
    sink_v = torch.randn(b, hkv, sinks + 1, d, generator=g).to(dtype) * 100
    sink_k[:, :, : min(sinks, length)] = k[:, :, : min(sinks, length)]
    sink_v[:, :, : min(sinks, length)] = v[:, :, : min(sinks, length)]
    dev = DEVICE
    rot, kcb, vcb = rot.to(dev), kcb.to(dev), vcb.to(dev)
    ring_k, ring_v = ring_k.to(dev), ring_v.to(dev)
    kv = PackedKV(
        kp.to(dev), kn.to(dev), vp.to(dev), vn.to(dev), sink_k.to(dev), sink_v.to(dev), ring_k, ring_v,
        torch.tensor(length, device=dev), torch.tensor(exact_from, device=dev), rot, kcb, vcb, sinks,
        ops.quantizer_id(rot, kcb), ops.quantizer_id(rot, vcb),
        torch.empty(1 << 20, device=dev), torch.zeros(64, dtype=torch.int32, device=dev),
    )
    return kv, ring_k, ring_v, k, v


def oracle_by_hand(query, k, v, kv, length, exact_from, sinks, mask, scale):
    """The same attention from the original tokens: exact where the layer keeps them exact, else dequantized."""
    cap = k.shape[2]
    kd = reference.dequantize(kv.k_packed.cpu(), kv.k_norms.cpu(), kv.rotation, kv.k_codebook)
    vd = reference.dequantize(kv.v_packed.cpu(), kv.v_norms.cpu(), kv.rotation, kv.v_codebook)
    exact = [(p < sinks or p >= exact_from) and p < length for p in range(cap)]
    for p in range(cap):
        if exact[p]:
            kd[:, :, p], vd[:, :, p] = k[:, :, p].float(), v[:, :, p].float()
    kd, vd = kd[:, :, :length], vd[:, :, :length]
    m = None if mask is None else mask[..., :length].cpu()
    return reference.attention(query.cpu(), kd, vd, m, scale).transpose(1, 2)


CASES = [
    # b, hkv, group, n, d, cap, ring, sinks, length, exact_from, kbits, vbits, mask, per_head
    (1, 2, 4, 1, 64, 300, 20, 4, 300, 280, 5, 3, None, False),
    (2, 1, 3, 2, 64, 257, 18, 0, 200, 182, 4, 2, "bool", False),
    (1, 2, 2, 3, 128, 140, 19, 2, 10, 0, 3, 3, None, True),
    (1, 2, 1, 16, 64, 333, 40, 4, 333, 293, 8, 1, "add", False),
    (2, 2, 2, 1, 64, 400, 20, 3, 150, 140, 2, 4, "bool", False),  # after a crop from 160: a ring window of 10
    (1, 1, 8, 4, 128, 96, 96, 1, 50, 0, 5, 3, None, False),  # the ring covers the capacity
]


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
def test_static_kernel_matches_the_reference(case):
    b, hkv, group, n, d, cap, ring, sinks, length, exact_from, kbits, vbits, mask_kind, per_head = case
    seed = fresh_seed()
    kv, ring_k, ring_v, k, v = make_kv(b, hkv, cap, ring, sinks, length, exact_from, d, kbits, vbits, torch.float16,
                                       seed, per_head)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(b, hkv * group, n, d, generator=g).to(torch.float16).to(DEVICE)
    mask = None
    if mask_kind is not None:
        allowed = torch.rand(b, 1, n, cap, generator=g) > 0.3
        allowed[..., 0] = True
        allowed[..., length:] = True  # the kernel must still ignore positions past length
        mask = allowed if mask_kind == "bool" else torch.where(allowed, 0.0, float("-inf")) + torch.randn(b, 1, n, cap, generator=g)
        mask = mask.to(DEVICE)
    scale = d**-0.5 * 1.3
    want = reference.static_attention(q, kv, mask, scale)
    by_hand = oracle_by_hand(q, k, v, kv, length, exact_from, sinks, mask, scale)
    torch.testing.assert_close(want.float().cpu(), by_hand.float(), atol=2e-2, rtol=2e-2,
                               msg=lambda m: f"reference vs by hand (seed {seed}): {m}")
    poison = torch.full((b, n, hkv * group, d), float("nan"), dtype=q.dtype, device=DEVICE)  # all must be written
    out = decode_attention(q, kv, mask, scale, out=poison)
    assert torch.isfinite(out).all(), f"seed {seed}"
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2,
                               msg=lambda m: f"decode_attention output (seed {seed}): {m}")
    assert int(kv.counters.abs().sum()) == 0, "the arrival counters must be back at zero"


def test_opcheck_every_custom_op():
    seed = fresh_seed()
    kv, ring_k, ring_v, _, _ = make_kv(1, 2, 80, 20, 2, 60, 40, 64, 5, 3, torch.float16, seed)
    q = torch.randn(1, 4, 1, 64).to(torch.float16).to(DEVICE)
    x = torch.randn(1, 2, 5, 64).to(torch.float16).to(DEVICE)
    bufs = [t.clone() for t in (kv.k_packed, kv.k_norms, kv.v_packed, kv.v_norms, ring_k, ring_v, kv.sink_k, kv.sink_v,
                                kv.length, kv.exact_from)]
    torch.library.opcheck(torch.ops.tq_hf_cache.static_append.default,
                          (x, x.clone(), *bufs, kv.sinks, kv.k_quantizer, kv.v_quantizer))
    torch.library.opcheck(torch.ops.tq_hf_cache.dequantize.default, (kv.k_packed, kv.k_norms, kv.k_quantizer, "bfloat16"))
    args = (q, ring_k, ring_v, kv.k_packed, kv.k_norms, kv.v_packed, kv.v_norms, kv.sink_k, kv.sink_v, kv.length,
            kv.exact_from, None, kv.sinks, kv.k_quantizer, kv.v_quantizer, 0.125, kv.scratch, kv.counters)
    torch.library.opcheck(torch.ops.tq_hf_cache.static_attention.default, args)
    mask = torch.ones(1, 1, 1, 80, dtype=torch.bool, device=DEVICE)
    torch.library.opcheck(torch.ops.tq_hf_cache.static_attention.default, args[:11] + (mask,) + args[12:])


def test_quantizer_ids_are_stable_and_checked():
    rot = make_rotation(64, 3)
    cb = theoretical_codebook(4, 64)
    a = ops.quantizer_id(rot, cb)
    assert ops.quantizer_id(rot, cb) == a
    assert ops.quantizer_id(make_rotation(64, 4), cb) != a
    with pytest.raises(ValueError, match="unknown quantizer id -1"):
        ops.quantizer(-1)
