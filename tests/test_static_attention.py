"""The static layer's fused attention (Triton kernel, under the interpreter without CUDA) and the custom ops, against
the torch oracle `reference.static_attention`; `torch.library.opcheck` of every tq_hf_cache:: op."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from tq_hf_cache import ops, reference  # noqa: E402
from tq_hf_cache.quant.codebook import Codebook, theoretical_codebook  # noqa: E402
from tq_hf_cache.quant.packed_kv import PackedKV, static_parts, static_views  # noqa: E402
from tq_hf_cache.quant.reference import window_positions  # noqa: E402
from tq_hf_cache.quant.rotation import make_rotation  # noqa: E402

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


def make_kv(b, hkv, cap, window, sinks, length, exact_from, d, kbits, vbits, dtype, seed, per_head=False, split=None):
    """A static layer's buffers after `length` positions, with the window live from `exact_from`; slots past `length`
    and dead window slots hold random garbage (poison) that attention must never read. `split`: (sizes, bits) of split
    keys (a random channel order per KV head), each part in its own buffers."""
    g = torch.Generator().manual_seed(seed)
    rot = make_rotation(d, seed % 1000)
    kcb = codebook(kbits, d, hkv if per_head else None, g)
    vcb = codebook(vbits, d, hkv if per_head else None, g)
    k = (torch.randn(b, hkv, cap, d, generator=g) * (0.5 + 3 * torch.rand(b, hkv, cap, 1, generator=g))).to(dtype)
    v = (torch.randn(b, hkv, cap, d, generator=g) * (0.5 + 2 * torch.rand(b, hkv, cap, 1, generator=g))).to(dtype)
    key_split = None
    if split is None:
        key_parts = [reference.quantize(k, rot, kcb)]
    else:
        from tq_hf_cache.quant.key_split import check_spec, make_split

        spec = check_spec({"sizes": list(split[0]), "bits": list(split[1]),
                           "order": [torch.randperm(d, generator=g).tolist() for _ in range(hkv)]}, 0)
        key_split = make_split(spec, 0, hkv, d, lambda m: make_rotation(m, (seed + m) % 1000), theoretical_codebook)
        key_parts = reference.split_quantize(k, key_split)
        kcb = key_split.parts[0][1]
    vp, vn = reference.quantize(v, rot, vcb)
    for t in [p for p, _ in key_parts] + [vp]:
        t[:, :, length:] = torch.randint(0, 256, t[:, :, length:].shape, dtype=torch.uint8, generator=g)
    for t in [nm for _, nm in key_parts] + [vn]:
        t[:, :, length:] = 1e4
    key_parts = [(p.to(DEVICE), nm.to(DEVICE)) for p, nm in key_parts]
    (kp, kn) = key_parts[0]
    window_k = torch.randn(b, hkv, window, d, generator=g).to(dtype) * 100
    window_v = torch.randn(b, hkv, window, d, generator=g).to(dtype) * 100
    pos, live = window_positions(torch.tensor(length), torch.tensor(exact_from), window)
    for j in range(window):
        if live[j]:
            window_k[:, :, j], window_v[:, :, j] = k[:, :, pos[j]], v[:, :, pos[j]]
    sink_k = torch.randn(b, hkv, sinks + 1, d, generator=g).to(dtype) * 100
    sink_v = torch.randn(b, hkv, sinks + 1, d, generator=g).to(dtype) * 100
    sink_k[:, :, : min(sinks, length)] = k[:, :, : min(sinks, length)]
    sink_v[:, :, : min(sinks, length)] = v[:, :, : min(sinks, length)]
    dev = DEVICE
    rot, kcb, vcb = rot.to(dev), kcb.to(dev), vcb.to(dev)
    window_k, window_v = window_k.to(dev), window_v.to(dev)
    kv = PackedKV(
        kp.to(dev), kn.to(dev), vp.to(dev), vn.to(dev), sink_k.to(dev), sink_v.to(dev), window_k, window_v,
        torch.tensor(length, device=dev), torch.tensor(exact_from, device=dev), rot, kcb, vcb, sinks,
        ops.quantizer_id(rot, kcb), ops.quantizer_id(rot, vcb),
        torch.empty(1 << 20, device=dev), torch.zeros(64, dtype=torch.int32, device=dev),
        key_split=None if key_split is None else key_split.to(dev), key_parts=None if split is None else tuple(key_parts),
    )
    return kv, window_k, window_v, k, v


def oracle_by_hand(query, k, v, kv, length, exact_from, sinks, mask, scale):
    """The same attention from the original tokens: exact where the layer keeps them exact, else dequantized."""
    cap = k.shape[2]
    if kv.key_split is None:
        kd = reference.dequantize(kv.k_packed.cpu(), kv.k_norms.cpu(), kv.rotation, kv.k_codebook)
    else:
        kd = reference.split_dequantize([(p.cpu(), nm.cpu()) for p, nm in kv.key_parts], kv.key_split.to("cpu"))
    vd = reference.dequantize(kv.v_packed.cpu(), kv.v_norms.cpu(), kv.rotation, kv.v_codebook)
    exact = [(p < sinks or p >= exact_from) and p < length for p in range(cap)]
    for p in range(cap):
        if exact[p]:
            kd[:, :, p], vd[:, :, p] = k[:, :, p].float(), v[:, :, p].float()
    kd, vd = kd[:, :, :length], vd[:, :, :length]
    m = None if mask is None else mask[..., :length].cpu()
    return reference.attention(query.cpu(), kd, vd, m, scale).transpose(1, 2)


CASES = [
    # b, hkv, group, n, d, cap, window, sinks, length, exact_from, kbits, vbits, mask, per_head
    (1, 2, 4, 1, 64, 300, 20, 4, 300, 280, 5, 3, None, False),
    (2, 1, 3, 2, 64, 257, 18, 0, 200, 182, 4, 2, "bool", False),
    (1, 2, 2, 3, 128, 140, 19, 2, 10, 0, 3, 3, None, True),
    (1, 2, 1, 16, 64, 333, 40, 4, 333, 293, 8, 1, "add", False),
    (2, 2, 2, 1, 64, 400, 20, 3, 150, 140, 2, 4, "bool", False),  # after a crop from 160: a live window of 10
    (1, 1, 8, 4, 128, 96, 96, 1, 50, 0, 5, 3, None, False),  # the window covers the capacity
    (1, 2, 2, 1, 256, 180, 16, 4, 170, 154, 5, 3, "bool", False),  # head dim 256 (Gemma)
]


SPLIT_CASES = [  # the CASES above with split keys: (case, (sizes, bits))
    (CASES[0], ((32, 32), (6, 3))),
    (CASES[1], ((16, 16, 32), (6, 4, 2))),
    (CASES[5], ((32, 32, 64), (5, 4, 3))),
]


@needs_triton
@pytest.mark.parametrize("case,split", [(c, None) for c in CASES] + SPLIT_CASES,
                         ids=[str(i) for i in range(len(CASES))] + [f"split{i}" for i in range(len(SPLIT_CASES))])
def test_static_kernel_matches_the_reference(case, split):
    b, hkv, group, n, d, cap, window, sinks, length, exact_from, kbits, vbits, mask_kind, per_head = case
    seed = fresh_seed()
    kv, window_k, window_v, k, v = make_kv(b, hkv, cap, window, sinks, length, exact_from, d, kbits, vbits,
                                           torch.float16, seed, per_head, split)
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


def to_store(kv, window_k):
    """kv's packed state copied into one static-layer buffer (`packed_kv.static_parts`)."""
    _, hkv, cap, kbytes = kv.k_packed.shape
    parts, total = static_parts(window_k.shape[0], hkv, cap, window_k.shape[-1], kbytes, kv.v_packed.shape[-1],
                                kv.sinks, kv.k_norms.dtype, window_k.dtype)
    store = torch.randint(0, 256, (total,), dtype=torch.uint8).to(DEVICE)  # poison between the parts
    views = static_views(store, window_k, cap, kv.sinks, kv.k_norms.dtype, kbytes, kv.v_packed.shape[-1])
    for name in ("k_packed", "k_norms", "v_packed", "v_norms", "sink_k", "sink_v", "length", "exact_from"):
        views[name].copy_(getattr(kv, name))
    return store


def test_opcheck_every_custom_op_and_the_one_buffer_layout():
    seed = fresh_seed()
    kv, window_k, window_v, _, _ = make_kv(1, 2, 80, 20, 2, 60, 40, 64, 5, 3, torch.float16, seed)
    q = torch.randn(1, 4, 1, 64).to(torch.float16).to(DEVICE)
    x = torch.randn(1, 2, 5, 64).to(torch.float16).to(DEVICE)
    store = to_store(kv, window_k)
    norm = ops.dtype_name(kv.k_norms.dtype)
    static = (80, kv.sinks, norm, kv.k_quantizer, kv.v_quantizer)
    torch.library.opcheck(torch.ops.tq_hf_cache.static_append.default,
                          (x, x.clone(), store.clone(), window_k.clone(), window_v.clone(), *static))
    torch.library.opcheck(torch.ops.tq_hf_cache.dequantize.default, (kv.k_packed, kv.k_norms, kv.k_quantizer, "bfloat16"))
    args = (q, window_k, window_v, store, None, *static, 0.125, kv.scratch, kv.counters)
    torch.library.opcheck(torch.ops.tq_hf_cache.static_attention.default, args)
    mask = torch.ones(1, 1, 1, 80, dtype=torch.bool, device=DEVICE)
    torch.library.opcheck(torch.ops.tq_hf_cache.static_attention.default, args[:4] + (mask,) + args[5:])
    # the ops read and write the buffer's parts where the layout says: the same as the oracles on separate tensors
    torch.testing.assert_close(torch.ops.tq_hf_cache.static_attention(*args).float(),
                               reference.static_attention(q, kv, None, 0.125).float(), atol=2e-2, rtol=0,
                               msg=lambda m: f"static_attention through the buffer (seed {seed}): {m}")
    got_window_k, got_window_v = window_k.clone(), window_v.clone()
    torch.ops.tq_hf_cache.static_append(x, 2 * x, store, got_window_k, got_window_v, *static)
    want = {n: getattr(kv, n).clone() for n in ("k_packed", "k_norms", "v_packed", "v_norms", "sink_k", "sink_v",
                                                "length", "exact_from")}
    want_window_k, want_window_v = window_k.clone(), window_v.clone()
    reference.static_append(x, 2 * x, want["k_packed"], want["k_norms"], want["v_packed"], want["v_norms"],
                            want_window_k, want_window_v, want["sink_k"], want["sink_v"], want["length"],
                            want["exact_from"], kv.sinks, kv.rotation, kv.k_codebook, kv.v_codebook)
    got = static_views(store, window_k, 80, kv.sinks, kv.k_norms.dtype, kv.k_packed.shape[-1], kv.v_packed.shape[-1])
    for name, t in want.items():
        if t.dtype == torch.uint8:  # codes: a rounding tie may flip one index between kernel and reference
            assert (got[name] != t).float().mean() < 1e-3, f"static_append {name} (seed {seed})"
        else:
            torch.testing.assert_close(got[name], t, atol=1e-2, rtol=1e-3,
                                       msg=lambda m, name=name: f"static_append {name} (seed {seed}): {m}")
    assert torch.equal(got_window_k, want_window_k) and torch.equal(got_window_v, want_window_v), \
        f"windows (seed {seed})"


def test_quantizer_ids_are_stable_and_checked():
    rot = make_rotation(64, 3)
    cb = theoretical_codebook(4, 64)
    a = ops.quantizer_id(rot, cb)
    assert ops.quantizer_id(rot, cb) == a
    assert ops.quantizer_id(make_rotation(64, 4), cb) != a
    with pytest.raises(ValueError, match="unknown quantizer id -1"):
        ops.quantizer(-1)


def test_a_buffer_of_another_layout_is_refused():
    kv, window_k, window_v, _, _ = make_kv(1, 2, 80, 20, 2, 60, 40, 64, 5, 3, torch.float16, 0)
    store = to_store(kv, window_k)
    args = (80, kv.sinks, "float16", kv.k_quantizer, kv.v_quantizer)
    with pytest.raises(ValueError, match=f"must be uint8 of {store.numel()} bytes for this layout, got torch.uint8 "
                                         f"of shape \\({store.numel() - 16},\\)"):
        ops.static_packed_kv(store[:-16], window_k, window_v, *args)
    with pytest.raises(ValueError, match="must be uint8 of"):  # a capacity the buffer was not made for
        ops.static_packed_kv(store, window_k, window_v, 96, *args[1:])
    with pytest.raises(ValueError, match="norm_dtype must be one of \\['float16', 'float32'\\], got 'bfloat16'"):
        ops.static_packed_kv(store, window_k, window_v, 80, kv.sinks, "bfloat16", kv.k_quantizer, kv.v_quantizer)
