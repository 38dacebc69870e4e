"""Fused decode attention on packed K/V (kernel and torch path) against the torch oracle, and the
attn_implementation="turboquant" path end to end against SDPA on the same TurboQuantCache.

Without CUDA the Triton kernel runs in the interpreter (TRITON_INTERPRET=1, set before the kernel module is
imported); shapes stay small so that the file runs in about a minute on a small CPU.
"""

import os
from dataclasses import replace

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

import tq_hf_cache  # noqa: E402
from tq_hf_cache import TurboQuantCache, attention, ops, packed_kv, reference  # noqa: E402
from tq_hf_cache.quant.codebook import Codebook, theoretical_codebook  # noqa: E402
from tq_hf_cache.quant.packed_kv import PackedKV, packed_source  # noqa: E402
from tq_hf_cache.quant.rotation import make_rotation  # noqa: E402
from tq_hf_cache.kernels import select  # noqa: E402
from conftest import with_cache

try:
    from tq_hf_cache.kernels.decode_attention import decode_attention
except ImportError:  # no Triton at all
    decode_attention = None

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(decode_attention is None, reason="triton is not installed")


def fresh_seed() -> int:
    return torch.seed() % 2**31


def codebook(bits, d):
    """Lloyd-Max for the usual widths; for 8 bits (slow to fit) any sorted table tests the kernel equally well."""
    if bits == 8:
        return Codebook.from_centroids(torch.linspace(-4, 4, 256) * d**-0.5, 8)
    return theoretical_codebook(bits, d)


def pair_codebooks(kbits, vbits, d, hkv, per_head, g):
    """Pair codebooks (`pair_codebook`); per head: each head's points scaled by its own factor."""
    from tq_hf_cache.quant.pair_codebook import theoretical_pair_codebook

    out = []
    for bits in (kbits, vbits):
        cb = theoretical_pair_codebook(bits, d)
        if per_head:
            cb = Codebook.from_points(cb.centroids * (1 + 0.2 * torch.rand(hkv, 1, 1, generator=g)), bits)
        out.append(cb)
    return out


def make_state(b, hkv, lq, lr, n, d, kbits, vbits, dtype, seed, per_head=False, device=DEVICE, sinks=0,
               rotation="auto", codes="scalar"):
    """A random dynamic-layer `PackedKV` (packed [0, lq), then lr residual and n new tokens in the window) laid out as
    a TurboQuantLayer's views give it (slices of bigger buffers, poisoned past the live part), plus the oracle's
    K, V. With `sinks`, the first packed tokens also have exact copies (attention sinks), which the oracle uses;
    `rotation` is make_rotation's kind; `codes` "pair" takes pair codebooks."""
    g = torch.Generator().manual_seed(seed)
    rot = make_rotation(d, seed % 1000, rotation)
    kcb, vcb = codebook(kbits, d), codebook(vbits, d)
    if codes == "pair":
        kcb, vcb = pair_codebooks(kbits, vbits, d, hkv, per_head, g)
    elif per_head:  # calibrated-style per-KV-head codebooks: perturbed, still sorted
        kcb = Codebook.from_centroids(kcb.centroids * (1 + 0.2 * torch.rand(hkv, 1, generator=g)), kbits)
        vcb = Codebook.from_centroids(vcb.centroids * (1 + 0.2 * torch.rand(hkv, 1, generator=g)), vbits)
    t = lq + lr + n
    k = (torch.randn(b, hkv, t, d, generator=g) * (0.5 + 3 * torch.rand(b, hkv, t, 1, generator=g))).to(dtype)
    v = (torch.randn(b, hkv, t, d, generator=g) * (0.5 + 2 * torch.rand(b, hkv, t, 1, generator=g))).to(dtype)
    kp, kn = reference.quantize(k[:, :, :lq], rot, kcb)
    vp, vn = reference.quantize(v[:, :, :lq], rot, vcb)
    # live slices of larger buffers, as PackedBuffer.live() returns them
    cap = lq + 7
    bufs = []
    for p, nrm in ((kp, kn), (vp, vn)):
        pb = torch.randint(0, 256, (b, hkv, cap, p.shape[-1]), dtype=torch.uint8, generator=g)
        nb = torch.randn(b, hkv, cap, generator=g).to(nrm.dtype)
        pb[:, :, 3 : 3 + lq] = p
        nb[:, :, 3 : 3 + lq] = nrm
        bufs.append((pb[:, :, 3 : 3 + lq].to(device), nb[:, :, 3 : 3 + lq].to(device)))
    windows = []
    for x in (k, v):  # the residual window's first lr + n slots of a bigger buffer, poisoned past them
        rb = torch.full((b, hkv, lr + n + 5, d), 1e4).to(dtype)
        rb[:, :, : lr + n] = x[:, :, lq:]
        windows.append(rb[:, :, : lr + n].to(device))
    sk = sv = k[:, :, :0].to(device)
    kf = torch.cat([reference.dequantize(kp, kn, rot, kcb), k[:, :, lq:].float()], dim=2)
    vf = torch.cat([reference.dequantize(vp, vn, rot, vcb), v[:, :, lq:].float()], dim=2)
    if sinks:
        # exact copies in slices of bigger buffers, as the layer's sink buffers give them
        skb = torch.randn(b, hkv, sinks + 2, d, generator=g).to(dtype)
        svb = torch.randn(b, hkv, sinks + 2, d, generator=g).to(dtype)
        skb[:, :, :sinks], svb[:, :, :sinks] = k[:, :, :sinks], v[:, :, :sinks]
        sk, sv = skb.to(device), svb.to(device)
        kf[:, :, :sinks], vf[:, :, :sinks] = k[:, :, :sinks].float(), v[:, :, :sinks].float()
    state = PackedKV(bufs[0][0], bufs[0][1], bufs[1][0], bufs[1][1], sk, sv, windows[0], windows[1], t, lq,
                     rot.to(device), kcb.to(device), vcb.to(device), sinks, -1, -1)
    return state, kf, vf


def make_query(b, hq, n, d, dtype, seed):
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(b, n, hq, d, generator=g).to(dtype).to(DEVICE)
    return q.transpose(1, 2)  # (B, Hq, n, D) view of (B, n, Hq, D), as transformers hands it over


def padding_mask(b, hq_or_1, n, t, pads, kind, extra_hole=True):
    """(B, 1, n, T) causal + left padding; kind "bool" or "additive"."""
    pos_q = torch.arange(t - n, t).view(1, 1, n, 1)
    j = torch.arange(t).view(1, 1, 1, t)
    m = (j <= pos_q) & (j >= torch.tensor(pads).view(b, 1, 1, 1))
    if extra_hole:  # a masked-out stretch inside the history (packed region), to test masks there too
        m[:, :, :, 1:3] = False
    m = m.expand(b, hq_or_1, n, t)
    if kind == "bool":
        return m.to(DEVICE)
    return torch.zeros(m.shape).masked_fill(~m, float("-inf")).to(DEVICE)


def head_mask(b, hq, n, t, kind, seed):
    """(B, Hq, n, T) random mask whose rows differ by query head (each row sees its own token); "bool" or
    "additive"."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.rand(b, hq, n, t, generator=g) > 0.4
    allowed[..., -1] = True
    mask = allowed if kind == "bool" else torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    return mask.to(DEVICE)


def rel_err(out, ref):
    return ((out.float().cpu() - ref).norm() / ref.norm()).item()


TOL = {torch.float16: 4e-3, torch.bfloat16: 1.2e-2, torch.float32: 3e-3}

# (kbits, vbits, d, group, n, lq, lr, dtype, mask, splits, per_head)
CASES = [
    (4, 4, 128, 4, 1, 301, 17, torch.bfloat16, None, None, False),
    (8, 4, 128, 4, 1, 129, 0, torch.float16, None, 3, False),
    (3, 4, 64, 3, 3, 203, 5, torch.float16, None, 2, False),
    (3, 3, 64, 1, 5, 77, 1, torch.bfloat16, "bool", None, True),
    (2, 2, 64, 4, 2, 150, 9, torch.float16, "additive", 4, False),
    (4, 2, 128, 3, 1, 1, 33, torch.float16, "bool", 1, False),
    (2, 3, 64, 1, 1, 0, 6, torch.float16, None, None, False),
    (8, 2, 64, 4, 16, 70, 3, torch.float16, "bool", 2, False),
    (4, 3, 64, 3, 4, 97, 0, torch.bfloat16, "additive", 3, True),
    # the BITS-byte group widths (8 indices per group, int64 words above 3 bits)
    (5, 3, 128, 4, 1, 203, 7, torch.bfloat16, None, None, False),
    (5, 3, 64, 3, 2, 150, 5, torch.float16, "bool", 3, True),
    (6, 7, 64, 2, 1, 93, 4, torch.float16, "additive", 2, False),
    (7, 1, 128, 1, 3, 71, 2, torch.bfloat16, None, 1, False),
    (1, 5, 64, 4, 1, 66, 0, torch.float16, None, 2, True),
    # one query: the mask's row is loaded once per key for every head of the group (MASK_KIND 3 and 4)
    (5, 3, 128, 4, 1, 203, 7, torch.bfloat16, "bool", 3, False),
    (4, 4, 64, 2, 1, 150, 5, torch.float16, "additive", 2, False),
    # head dim 256 (Gemma), group widths only: planes twice as wide, the merge in smaller chunks
    (5, 3, 256, 2, 1, 203, 7, torch.bfloat16, None, 3, False),
    (3, 5, 256, 4, 1, 150, 5, torch.float16, "bool", 2, True),
    (7, 6, 256, 1, 3, 97, 2, torch.bfloat16, "additive", None, False),
    (1, 3, 256, 2, 2, 66, 0, torch.float16, None, 2, False),
]


def _case_id(c):
    return f"k{c[0]}v{c[1]}-d{c[2]}-g{c[3]}-n{c[4]}-lq{c[5]}-lr{c[6]}-{str(c[7])[6:]}-{c[8]}-s{c[9]}{'-ph' if c[10] else ''}"


def _oracle(q, kf, vf, mask, scale):
    m = None if mask is None else mask.cpu()
    return reference.attention(q.cpu(), kf, vf, mask=m, scale=scale).transpose(1, 2)


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_kernel_matches_reference(case):
    kbits, vbits, d, group, n, lq, lr, dtype, mask_kind, splits, per_head = case
    seed = fresh_seed()
    b, hkv = 2, 2
    hq = hkv * group
    state, kf, vf = make_state(b, hkv, lq, lr, n, d, kbits, vbits, dtype, seed, per_head)
    q = make_query(b, hq, n, d, dtype, seed)
    t = lq + lr + n
    mask = None if mask_kind is None else padding_mask(b, 1, n, t, [min(4, lq), 0], mask_kind)
    scale = 0.7 * d**-0.5
    out = torch.full((b, n, hq, d), float("nan"), dtype=dtype, device=DEVICE)  # poisoned
    res = decode_attention(q, state, mask, scale, num_splits=splits, out=out)
    assert res is out
    assert torch.isfinite(out).all(), f"seed {seed}: unwritten or non-finite outputs"
    ref = _oracle(q, kf, vf, mask, scale)
    err = rel_err(out, ref)
    assert err < TOL[dtype], f"seed {seed}: relative error {err:.2e}"


# pair codes (`pair_codebook`): the kernel reads them through the same tables, made by `Codebook.coordinate_values`
PAIR_CASES = [  # (kbits, vbits, d, group, n, lq, lr, dtype, mask, splits, per_head)
    (4, 2, 64, 3, 1, 203, 17, torch.float16, None, 2, False),
    (4, 2, 128, 4, 2, 150, 5, torch.bfloat16, "bool", None, True),
    (3, 3, 64, 1, 3, 97, 0, torch.float16, "additive", 3, False),
    (1, 4, 64, 2, 1, 66, 4, torch.float16, None, 1, False),
    (2, 3, 256, 2, 1, 120, 5, torch.bfloat16, None, 2, False),
]


@needs_triton
@pytest.mark.parametrize("case", PAIR_CASES, ids=_case_id)
def test_kernel_and_torch_math_read_pair_codes(case):
    kbits, vbits, d, group, n, lq, lr, dtype, mask_kind, splits, per_head = case
    seed = fresh_seed()
    b, hkv = 2, 2
    hq = hkv * group
    state, kf, vf = make_state(b, hkv, lq, lr, n, d, kbits, vbits, dtype, seed, per_head, codes="pair")
    q = make_query(b, hq, n, d, dtype, seed)
    t = lq + lr + n
    mask = None if mask_kind is None else padding_mask(b, 1, n, t, [min(4, lq), 0], mask_kind)
    scale = 0.7 * d**-0.5
    ref = _oracle(q, kf, vf, mask, scale)
    math = reference.packed_attention(q, state, mask, scale)
    assert rel_err(math, ref) < TOL[dtype], f"seed {seed}: the torch math's relative error"
    if not tq_hf_cache.kernels.decode_supports(d, kbits, vbits, n, group):
        return
    out = torch.full((b, n, hq, d), float("nan"), dtype=dtype, device=DEVICE)  # poisoned
    decode_attention(q, state, mask, scale, num_splits=splits, out=out)
    assert torch.isfinite(out).all(), f"seed {seed}: unwritten or non-finite outputs"
    err = rel_err(out, ref)
    assert err < TOL[dtype], f"seed {seed}: the kernel's relative error {err:.2e}"


SINK_CASES = [  # (kbits, vbits, d, group, n, lq, lr, dtype, mask, splits, sinks)
    (4, 4, 128, 4, 1, 301, 17, torch.bfloat16, None, None, 4),
    (3, 3, 64, 1, 5, 77, 1, torch.bfloat16, "bool", 3, 2),  # the mask's hole at 1:3 covers a sink
    (2, 2, 64, 4, 2, 150, 9, torch.float16, "additive", 4, 4),
    (4, 4, 64, 2, 1, 3, 0, torch.float16, None, 2, 3),  # every packed token is a sink
]


@needs_triton
@pytest.mark.parametrize("case", SINK_CASES, ids=lambda c: f"k{c[0]}v{c[1]}-d{c[2]}-lq{c[5]}-{c[8]}-sinks{c[10]}")
def test_kernel_and_torch_path_use_exact_sinks(case):
    """The first packed tokens' exact copies replace them, in the kernel and in the torch path alike."""
    kbits, vbits, d, group, n, lq, lr, dtype, mask_kind, splits, sinks = case
    seed = fresh_seed()
    b, hkv = 2, 2
    hq = hkv * group
    t = lq + lr + n
    state, kf, vf = make_state(b, hkv, lq, lr, n, d, kbits, vbits, dtype, seed, sinks=sinks)
    q = make_query(b, hq, n, d, dtype, seed)
    mask = None if mask_kind is None else padding_mask(b, 1, n, t, [1, 0], mask_kind)
    out = torch.full((b, n, hq, d), float("nan"), dtype=dtype, device=DEVICE)
    decode_attention(q, state, mask, None, num_splits=splits, out=out)
    ref = _oracle(q, kf, vf, mask, None)
    assert rel_err(out, ref) < TOL[dtype], f"seed {seed}: relative error {rel_err(out, ref):.2e}"
    state32, kf32, vf32 = make_state(b, hkv, lq, lr, n, d, kbits, vbits, torch.float32, seed, device="cpu", sinks=sinks)
    q32 = q.float().cpu()
    m32 = None if mask is None else mask.cpu()
    out32 = reference.packed_attention(q32, state32, m32, None)
    assert rel_err(out32, reference.attention(q32, kf32, vf32, mask=m32).transpose(1, 2)) < 1e-5, f"seed {seed}"
    # and the sinks matter: the quantized copies give a different answer
    no_sinks = replace(state, sinks=0)
    assert rel_err(decode_attention(q, no_sinks, mask, None, num_splits=splits), ref) > 0


@needs_triton
def test_kernel_split_count_does_not_change_the_result():
    seed = fresh_seed()
    state, kf, vf = make_state(1, 2, 333, 4, 1, 64, 4, 4, torch.float16, seed)
    q = make_query(1, 8, 1, 64, torch.float16, seed)
    ref = _oracle(q, kf, vf, None, None)
    outs = [decode_attention(q, state, None, None, num_splits=s) for s in (1, 2, 6)]
    for o in outs:
        assert rel_err(o, ref) < TOL[torch.float16], f"seed {seed}"
    assert (outs[0].float() - outs[2].float()).abs().max().item() < 1e-2


@needs_triton
@pytest.mark.parametrize("masked", [False, True])
def test_queries_by_chunks_match_one_call(masked):
    """`by_query_chunks` (how the explicit-layout kernel takes more query rows than it holds): chunks of 3 of 7
    queries, each with its rows of the mask or a causal mask of its own positions, give the one call's result."""
    from tq_hf_cache.kernels.decode_attention import by_query_chunks

    seed = fresh_seed()
    b, hkv, group, n, d, lq, lr = 2, 2, 2, 7, 64, 70, 5
    state, kf, vf = make_state(b, hkv, lq, lr, n, d, 4, 3, torch.float16, seed)
    q = make_query(b, hkv * group, n, d, torch.float16, seed)
    t = lq + lr + n
    mask = padding_mask(b, 1, n, t, [0, 4], "bool") if masked else None
    want = decode_attention(q, state, mask, None)
    out = torch.full_like(want, float("nan"))
    got = by_query_chunks(q, state, mask, None, 3, out=out)
    assert got is out
    assert (got.float() - want.float()).abs().max().item() < 2e-3, f"seed {seed}"
    assert rel_err(got, _oracle(q, kf, vf, mask, None)) < TOL[torch.float16], f"seed {seed}"


@needs_triton
def test_kernel_fully_masked_rows_give_zeros_and_mask_wider_than_keys():
    """A query row that may see nothing gets 0 (as the oracle's softmax_rows); a 4.x-style longer mask is cut."""
    seed = fresh_seed()
    b, hkv, group, n, d, lq, lr = 2, 1, 3, 2, 64, 90, 3
    state, kf, vf = make_state(b, hkv, lq, lr, n, d, 4, 4, torch.float16, seed)
    q = make_query(b, hkv * group, n, d, torch.float16, seed)
    t = lq + lr + n
    mask = padding_mask(b, 1, n, t, [0, 5], "bool", extra_hole=False)
    mask = mask.clone()
    mask[1, :, 0, :] = False  # batch 1, query 0 sees nothing
    wide = torch.cat([mask, torch.ones(b, 1, n, 9, dtype=torch.bool, device=DEVICE)], dim=-1)
    out = decode_attention(q, state, wide, None)
    ref = _oracle(q, kf, vf, mask, None)
    assert torch.isfinite(out).all()
    assert (out[1, 0] == 0).all()
    assert rel_err(out, ref) < TOL[torch.float16], f"seed {seed}"


@needs_triton
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_kernel_mask_that_differs_by_head(kind):
    """One query, a mask whose rows differ by query head: it is read per tile row, not as the one shared row that a
    (B, 1, 1, T) mask is read as."""
    seed = fresh_seed()
    b, hkv, group, n, d, lq, lr = 2, 2, 3, 1, 64, 120, 5
    state, kf, vf = make_state(b, hkv, lq, lr, n, d, 4, 3, torch.float16, seed)
    q = make_query(b, hkv * group, n, d, torch.float16, seed)
    t = lq + lr + n
    mask = head_mask(b, hkv * group, n, t, kind, seed)
    out = decode_attention(q, state, mask, None, num_splits=3)
    ref = _oracle(q, kf, vf, mask, None)
    assert rel_err(out, ref) < TOL[torch.float16], f"seed {seed}"
    shared = decode_attention(q, state, mask[:, :1].expand_as(mask), None, num_splits=3)
    assert rel_err(shared, ref) > 10 * TOL[torch.float16], f"seed {seed}: the heads' masks must matter"


@needs_triton
@pytest.mark.parametrize("kbits", [5, 3])
def test_kernel_copies_packed_rows_off_a_word(kbits):
    """3/5/6-bit rows are read as int32 words: a packed buffer that starts off a 4-byte boundary is copied first,
    and the result is the same."""
    seed = fresh_seed()
    b, hkv, group, n, d, lq, lr = 1, 2, 2, 1, 64, 70, 3
    state, kf, vf = make_state(b, hkv, lq, lr, n, d, kbits, 4, torch.float16, seed)
    q = make_query(b, hkv * group, n, d, torch.float16, seed)
    kp = state.k_packed
    raw = torch.empty(kp.numel() + 1, dtype=torch.uint8, device=kp.device)
    odd = raw[1:].view(kp.shape)
    odd.copy_(kp)
    assert odd.data_ptr() % 4 != 0
    out_odd = decode_attention(q, replace(state, k_packed=odd), None, None)
    out = decode_attention(q, state, None, None)
    assert torch.equal(out_odd, out), f"seed {seed}"
    assert rel_err(out, _oracle(q, kf, vf, None, None)) < TOL[torch.float16], f"seed {seed}"


@pytest.mark.parametrize("case", CASES[:5] + [c for c in CASES if c[2] == 256], ids=_case_id)
def test_torch_fused_math_matches_reference(case):
    """The CPU (non-CUDA) fused path: rotated-domain math in torch."""
    kbits, vbits, d, group, n, lq, lr, dtype, mask_kind, _, per_head = case
    seed = fresh_seed()
    b, hkv = 2, 2
    state, kf, vf = make_state(b, hkv, lq, lr, n, d, kbits, vbits, torch.float32, seed, per_head, device="cpu")
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(b, hkv * group, n, d, generator=g)
    t = lq + lr + n
    mask = None if mask_kind is None else padding_mask(b, 1, n, t, [min(4, lq), 0], mask_kind).cpu()
    out = reference.packed_attention(q, state, mask, None)
    ref = reference.attention(q, kf, vf, mask=mask).transpose(1, 2)
    assert rel_err(out, ref) < 1e-5, f"seed {seed}"


# ------------------------------------------------------------------------------------------------------------
# end to end through transformers


def _llama(head_dim=64, layers=2, heads=8, kv_heads=2, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=128, hidden_size=heads * head_dim, intermediate_size=256, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=512,
        initializer_range=0.05, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


def _generate(model, impl, ids, mask, new_tokens=10, preset="k4v4", residual=6):
    """`generate` under `impl`; under "sdpa" on the dequantized keys and values (the workspace path) to compare with."""
    model.set_attn_implementation(impl)
    cache = TurboQuantCache(preset, config=model.config, residual_length=residual, fused_sdpa=impl != "sdpa")
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, **with_cache(cache), max_new_tokens=new_tokens, do_sample=False,
            output_scores=True, return_dict_in_generate=True, pad_token_id=0,
        )
    return out, cache


def _left_padded_batch(seed, lengths=(37, 29, 41)):
    g = torch.Generator().manual_seed(seed)
    t = max(lengths)
    ids = torch.randint(3, 128, (len(lengths), t), generator=g)
    mask = torch.ones_like(ids)
    for i, n in enumerate(lengths):
        ids[i, : t - n] = 0
        mask[i, : t - n] = 0
    return ids, mask


@pytest.mark.parametrize("preset,head_dim", [("k4v4", 64), ("k3v3", 64), ("k5v3", 256)])
def test_turboquant_generate_matches_sdpa_on_the_same_cache(preset, head_dim, count_paths, monkeypatch):
    """One layer: its keys and values come from the tokens alone, so both caches hold the same bits. (A second
    layer's come from the first one's outputs, which differ by float rounding between the two attentions; a code
    near a quantizer boundary then flips now and then, a legitimate difference of about 1e-3 in the scores.)"""
    monkeypatch.setattr(tq_hf_cache.kernels.support, "WIDE_MIN_KEY_ROWS", 0)  # head dim 256: the kernel at any length
    model = _llama(head_dim=head_dim, layers=1)
    seed = fresh_seed()
    ids, mask = _left_padded_batch(seed)
    a, ca = _generate(model, "sdpa", ids, mask, preset=preset)
    b, cb = _generate(model, attention.NAME, ids, mask, preset=preset)
    steps = b.sequences.shape[1] - ids.shape[1]  # 10, or fewer when every row hits end-of-sequence early
    assert count_paths["fused"] == steps - 1  # the decode steps after the prefill
    assert count_paths["filled"] == 2 * (steps - 1)  # sdpa read keys and values of the same steps densely
    assert torch.equal(a.sequences, b.sequences), f"seed {seed}"
    for x, y in zip(ca.layers, cb.layers):
        px, py = x.kv.view(), y.kv.view()
        for name in ("k_packed", "k_norms", "v_packed", "v_norms", "window_k", "window_v"):
            assert torch.equal(getattr(px, name), getattr(py, name)), f"seed {seed}: the caches' {name} differ"
    diffs = [(x - y).abs().max().item() for x, y in zip(a.scores, b.scores)]
    lengths = [(x.quantized_length, y.quantized_length) for x, y in zip(ca.layers, cb.layers)]
    assert max(diffs) < 1e-4, f"seed {seed}: worst score difference by step {diffs}, quantized lengths {lengths}"
    assert all(x == y > 0 for x, y in lengths), f"seed {seed}: quantized lengths {lengths}"


@pytest.mark.parametrize("row_group_bytes", [None, 1])
def test_turboquant_chunked_prefill_fills_long_chunks_whole_or_by_row_groups(row_group_bytes, count_paths, monkeypatch):
    """Prefill in chunks: a long chunk over a packed history gets dense keys and values (SDPA), for the whole batch
    at once or (row_group_bytes=1: one row per group) a row group at a time; decode steps take the fused path."""
    if row_group_bytes is not None:
        monkeypatch.setattr(attention, "ROW_GROUP_BYTES", row_group_bytes)
    model = _llama()
    ids, mask = _left_padded_batch(fresh_seed(), lengths=(40, 33))
    logits, caches = {}, {}
    for impl in ("sdpa", attention.NAME):
        model.set_attn_implementation(impl)
        cache = TurboQuantCache("k4v4", config=model.config, residual_length=4, fused_sdpa=impl != "sdpa")
        with torch.no_grad():
            first = model(ids[:, :20], attention_mask=mask[:, :20], **with_cache(cache))
            second = model(ids[:, 20:], attention_mask=mask, **with_cache(cache))
            step = model(second.logits[:, -1:].argmax(-1), attention_mask=torch.cat([mask, mask[:, :1] * 0 + 1], 1),
                         **with_cache(cache))
        logits[impl], caches[impl] = (first.logits, second.logits, step.logits), cache
    assert count_paths["fused"] == 2  # the decode step, in each of the 2 layers
    # keys and values of 2 layers: the second chunk under sdpa, under turboquant (whole, or each of 2 rows), and the
    # decode step under sdpa
    assert count_paths["filled"] == 2 * 2 + (2 * 2 if row_group_bytes is None else 2 * 2 * 2) + 2 * 2
    for name, x, y in zip(("first chunk", "second chunk", "decode step"), logits["sdpa"], logits[attention.NAME]):
        assert (x - y).abs().max().item() < 1e-4, name
    assert caches[attention.NAME].get_seq_length() == caches["sdpa"].get_seq_length() == 41
    for la, lb in zip(caches["sdpa"].layers, caches[attention.NAME].layers):
        assert la.quantized_length == lb.quantized_length > 0
    first_a, first_b = caches["sdpa"].layers[0], caches[attention.NAME].layers[0]  # its inputs are the same tokens
    assert torch.equal(first_a.keys, first_b.keys) and torch.equal(first_a.values, first_b.values)
    # the workspace is sized by what was filled at once: both rows under sdpa, one row per group here
    held_s, held_t = caches["sdpa"].nbytes()["workspace"], caches[attention.NAME].nbytes()["workspace"]
    assert held_s > 0 and held_t == (held_s if row_group_bytes is None else held_s // 2), (held_s, held_t)


@pytest.mark.parametrize("first,second,pads", [(20, 30, False), (60, 20, False), (20, 30, True)])
def test_a_long_chunk_over_a_held_history_takes_is_causal_where_its_mask_is_plain(first, second, pads, monkeypatch):
    """A chunk over a packed history under a plain causal mask and a history at most twice its length: SDPA on a query
    padded in front to the keys' length, under is_causal (the padding's rows dropped); a longer history or a padded
    batch: the mask as given. Logits as under sdpa on the same cache either way."""
    model = _llama()
    g = torch.Generator().manual_seed(fresh_seed())
    ids = torch.randint(3, 128, (2, first + second), generator=g)
    mask = torch.ones_like(ids)
    if pads:
        ids[1, :3], mask[1, :3] = 0, 0
    seen = []
    sdpa = attention._sdpa
    monkeypatch.setattr(attention, "_sdpa", lambda m, q, k, *a, **kw: seen.append((q.shape[2], k.shape[2], a[1] is None))
                        or sdpa(m, q, k, *a, **kw))
    logits = {}
    for impl in ("sdpa", attention.NAME):
        model.set_attn_implementation(impl)
        cache = TurboQuantCache("k4v4", config=model.config, residual_length=4, fused_sdpa=impl != "sdpa")
        with torch.no_grad():
            model(ids[:, :first], attention_mask=mask[:, :first], **with_cache(cache))
            logits[impl] = model(ids[:, first:], attention_mask=mask, **with_cache(cache)).logits
    assert (logits["sdpa"] - logits[attention.NAME]).abs().max().item() < 1e-4
    t = first + second
    padded = not pads and first <= 2 * second
    chunk_calls = [c for c in seen if c[1] == t]  # the second chunk's layers (the first chunk has t = first)
    assert chunk_calls == 2 * [(t, t, True) if padded else (second, t, False)]


def test_a_plain_causal_mask_is_recognized_under_inference_mode_too():
    """Inference tensors count no versions: the verdict is kept by the mask's identity alone there."""
    with torch.inference_mode():
        t, n = 40, 20
        pos = torch.arange(t)
        mask = (pos <= pos[t - n:, None]).expand(2, 1, n, t)
        assert attention._plain_causal(mask, n, t) and attention._plain_causal(mask, n, t)
        holed = mask.clone()
        holed[1, 0, 3, 0] = False
        assert not attention._plain_causal(holed, n, t)
    assert attention._plain_causal((pos <= pos[t - n:, None])[None, None], n, t)


def test_head_dim_256_takes_the_kernel_at_group_widths_only():
    """At head dim 256 the byte widths (2, 4, 8 bits) spill registers and ran slower than the workspace path on the
    H100: the kernel refuses them (by name), the attention falls back to the workspace path for them."""
    from tq_hf_cache.kernels import decode_supports

    assert decode_supports(256, 5, 3, 1, 4) and decode_supports(256, 1, 7, 1, 4)
    assert not any(decode_supports(256, k, v, 1, 4) for k, v in ((4, 4), (4, 2), (8, 6), (5, 4), (2, 3)))
    assert decode_supports(128, 4, 4, 1, 4) and not decode_supports(256, 5, 3, 64, 4)  # rows still count
    if decode_attention is not None:
        state, _, _ = make_state(1, 1, 40, 2, 1, 256, 4, 4, torch.float16, 0)
        with pytest.raises(ValueError, match="head dim 256, bits k4v4"):
            decode_attention(make_query(1, 2, 1, 256, torch.float16, 0), state)


def test_head_dim_256_takes_the_fused_path_where_it_pays(count_paths, caplog):
    """decode_pays: on CUDA, at head dim 256, a short history (batch x KV heads x packed tokens < WIDE_MIN_KEY_ROWS)
    goes to the workspace path, silently (a speed choice, not a missing feature); elsewhere (the torch math, or the
    interpreter) the fused path serves at any length. Either way the tokens are SDPA's on the same cache."""
    from tq_hf_cache.kernels import WIDE_MIN_KEY_ROWS, decode_pays

    assert decode_pays(128, 1) and decode_pays(64, 0)
    assert not decode_pays(256, WIDE_MIN_KEY_ROWS - 1) and decode_pays(256, WIDE_MIN_KEY_ROWS)
    assert decode_pays(256, 1, "cpu")
    model = _llama(head_dim=256).to(DEVICE)
    ids, mask = _left_padded_batch(fresh_seed(), lengths=(21, 17))
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    a, _ = _generate(model, "sdpa", ids, mask, new_tokens=5, preset="k5v3")
    with caplog.at_level("WARNING", logger="tq_hf_cache.hf.attention"):
        attention._warned.clear()
        b, _ = _generate(model, attention.NAME, ids, mask, new_tokens=5, preset="k5v3")
    assert not caplog.records
    if DEVICE == "cuda":
        assert count_paths["fused"] == 0
    else:
        assert count_paths["fused"] == 2 * (b.sequences.shape[1] - ids.shape[1] - 1)
    assert torch.equal(a.sequences, b.sequences)


def test_unsupported_head_dim_falls_back_with_a_warning(count_paths, caplog):
    model = _llama(head_dim=32, heads=4)
    ids, mask = _left_padded_batch(fresh_seed(), lengths=(21, 17))
    a, _ = _generate(model, "sdpa", ids, mask, new_tokens=5)
    with caplog.at_level("WARNING", logger="tq_hf_cache.hf.attention"):
        attention._warned.clear()
        b, _ = _generate(model, attention.NAME, ids, mask, new_tokens=5)
    assert count_paths["fused"] == 0 and count_paths["filled"] == 2 * 2 * 2 * 4  # both runs: sdpa-filled K, V
    assert sum("head dim 32" in r.message for r in caplog.records) == 1
    assert torch.equal(a.sequences, b.sequences)


def test_without_a_turboquant_cache_the_function_is_sdpa():
    from transformers import DynamicCache

    model = _llama()
    ids, mask = _left_padded_batch(fresh_seed(), lengths=(25, 19))
    outs = {}
    for impl in ("sdpa", attention.NAME):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            outs[impl] = model.generate(ids, attention_mask=mask, **with_cache(DynamicCache()), max_new_tokens=4,
                                        do_sample=False, pad_token_id=0)
    assert torch.equal(outs["sdpa"], outs[attention.NAME])


def test_sliding_window_model_matches_sdpa(count_paths):
    """One layer, so that both caches hold the same bits (`test_turboquant_generate_matches_sdpa_on_the_same_cache`)."""
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(
        vocab_size=128, hidden_size=256, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=512, sliding_window=24, pad_token_id=0,
    )
    torch.manual_seed(0)
    model = MistralForCausalLM(cfg).eval()
    ids, mask = _left_padded_batch(fresh_seed(), lengths=(30, 22))
    a, _ = _generate(model, "sdpa", ids, mask, new_tokens=8, residual=4)
    b, cache = _generate(model, attention.NAME, ids, mask, new_tokens=8, residual=4)
    assert isinstance(cache.layers[0], tq_hf_cache.TurboQuantSlidingLayer)
    steps = b.sequences.shape[1] - ids.shape[1]  # fewer than 8 when both rows hit end-of-sequence early
    assert count_paths["fused"] == steps - 1
    assert torch.equal(a.sequences, b.sequences)
    assert max((x - y).abs().max().item() for x, y in zip(a.scores, b.scores)) < 1e-4


@needs_triton
def test_generate_through_the_triton_kernel(monkeypatch):
    """The kernel itself inside generate (interpreted on CPU): same tokens as SDPA on the same cache."""
    monkeypatch.setenv(select.ENV, "triton")
    model = _llama(layers=1).to(DEVICE)
    ids, mask = _left_padded_batch(fresh_seed(), lengths=(19, 12))
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    a, _ = _generate(model, "sdpa", ids, mask, new_tokens=4, residual=3)
    b, _ = _generate(model, attention.NAME, ids, mask, new_tokens=4, residual=3)
    assert torch.equal(a.sequences, b.sequences)
    worst = max((x - y).abs().max().item() for x, y in zip(a.scores, b.scores))
    assert worst < 2e-2, worst  # fp32 model; the kernel's packed-segment dot products use fp16 operands


# ------------------------------------------------------------------------------------------------------------
# the single-launch kernel's variants, and a layer's steps through it


@needs_triton
@pytest.mark.parametrize("prefetch", [0, 2])
def test_kernel_prefetch_variants_match_reference(prefetch):
    """The hand-pipelined loop variants (tile loads issued early / one tile ahead) compute the same function."""
    for kbits, vbits, d, group, n, lq, lr, splits in ((4, 4, 128, 4, 1, 301, 17, None), (3, 2, 64, 3, 2, 130, 5, 2)):
        seed = fresh_seed()
        state, kf, vf = make_state(2, 2, lq, lr, n, d, kbits, vbits, torch.float16, seed)
        q = make_query(2, 2 * group, n, d, torch.float16, seed)
        out = torch.full((2, n, 2 * group, d), float("nan"), dtype=torch.float16, device=DEVICE)
        decode_attention(q, state, None, None, num_splits=splits, out=out, prefetch=prefetch)
        assert torch.isfinite(out).all(), f"seed {seed}: unwritten outputs"
        assert rel_err(out, _oracle(q, kf, vf, None, None)) < TOL[torch.float16], f"seed {seed}"


@needs_triton
def test_single_split_single_launch_and_counters_reset():
    """num_splits == 1 (one packed program + the residual program merge in the same launch), repeated launches
    (the arrival counters must be back at zero after each), and an empty packed history."""
    from tq_hf_cache.kernels import decode_attention as da

    for lq, lr in ((40, 3), (0, 5), (200, 0)):
        seed = fresh_seed()
        state, kf, vf = make_state(3, 2, lq, lr, 1, 64, 4, 4, torch.bfloat16, seed)
        q = make_query(3, 8, 1, 64, torch.bfloat16, seed)
        ref = _oracle(q, kf, vf, None, None)
        for _ in range(2):
            out = torch.full((3, 1, 8, 64), float("nan"), dtype=torch.bfloat16, device=DEVICE)
            decode_attention(q, state, None, None, num_splits=1, out=out)
            assert torch.isfinite(out).all(), f"seed {seed}"
            assert rel_err(out, ref) < TOL[torch.bfloat16], f"seed {seed}"
        _, counters = da._scratch(out.device, 1, 6)  # this stream's pair, as the launches used it
        assert int(counters[:6].abs().sum()) == 0


@needs_triton
@pytest.mark.parametrize("preset,group,n", [pytest.param("k4v4", 4, 1, marks=pytest.mark.slow), ("k3v3", 2, 3)])
def test_layer_steps_through_the_kernel_across_settles_and_growth(preset, group, n):
    """A TurboQuantLayer's decode steps: the kernel on the PackedKV its update returns against the oracle on the
    dense keys and values the same LazyKVs fill, over steps that cross a residual settle (FLUSH_BLOCK) and a
    packed-buffer growth (GROW_TOKENS), and one step past both."""
    from tq_hf_cache.hf.layer import FLUSH_BLOCK, GROW_TOKENS

    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    b, hkv, d, res = 2, 2, 64, 6
    model = _llama(head_dim=d, layers=1, heads=hkv * group, kv_heads=hkv)
    cache = TurboQuantCache(preset, config=model.config, residual_length=res)
    dtype = torch.float16
    pre = GROW_TOKENS - 10  # the first settle after the prefill grows the packed buffers
    k0 = torch.randn(b, hkv, pre, d, generator=g).to(dtype).to(DEVICE)
    cache.update(k0, torch.randn(b, hkv, pre, d, generator=g).to(dtype).to(DEVICE), 0)
    layer = cache.layers[0]
    caps, lqs = set(), set()
    crossed = None
    for step in range((FLUSH_BLOCK + n) // n + 2):
        if crossed is not None and step > crossed + 1:
            break
        k = torch.randn(b, hkv, n, d, generator=g).to(dtype).to(DEVICE)
        v = torch.randn(b, hkv, n, d, generator=g).to(dtype).to(DEVICE)
        lk, lv = cache.update(k, v, 0)
        kv = packed_source(lk)
        assert kv is not None and kv.exact_from == layer.kv.k_buf.length and kv.sinks > 0
        q = make_query(b, hkv * group, n, d, dtype, seed + step)
        scale = 0.9 * d**-0.5
        out = torch.full((b, n, hkv * group, d), float("nan"), dtype=dtype, device=DEVICE)
        decode_attention(q, kv, None, scale, out=out)
        assert torch.isfinite(out).all(), f"seed {seed}, step {step}"
        kf, vf = lk.dense().float().cpu(), lv.dense().float().cpu()
        assert torch.equal(kf[:, :, -n:], k.float().cpu())  # the new tokens are the last positions, exact
        assert rel_err(out, _oracle(q, kf, vf, None, scale)) < TOL[dtype], f"seed {seed}, step {step}"
        caps.add(layer.kv.k_buf.capacity)
        lqs.add(layer.kv.k_buf.length)
        if crossed is None and len(caps) >= 2 and len(lqs) >= 2:
            crossed = step
    assert crossed is not None  # the run did cross a growth and a settle


@needs_triton
@pytest.mark.parametrize("where", ["packed_norm", "residual", "new"])
@pytest.mark.parametrize("splits", [1, 3])
def test_kernel_propagates_nan_keys_as_sdpa_does(where, splits):
    """A NaN key makes the output of every query of its KV head NaN (as SDPA and the oracle give), never 0 or a
    finite number; the other KV head stays finite."""
    seed = fresh_seed()
    b, hkv, group, n, d = 1, 2, 2, 1, 64
    state, kf, vf = make_state(b, hkv, 40, 5, n, d, 4, 4, torch.float16, seed)
    if where == "packed_norm":
        state.k_norms[0, 0, 7] = float("nan")
        kf[0, 0, 7] = float("nan")
    elif where == "residual":
        state.window_k[0, 0, 2, 5] = float("nan")
        kf[0, 0, 42, 5] = float("nan")
    else:  # the step's new token: the last window slot
        state.window_k[0, 0, 5, 5] = float("nan")
        kf[0, 0, 45, 5] = float("nan")
    q = make_query(b, hkv * group, n, d, torch.float16, seed)
    out = decode_attention(q, state, None, None, num_splits=splits)
    ref = _oracle(q, kf, vf, None, None)
    assert torch.isnan(ref[0, 0, :group]).all() and torch.isfinite(ref[0, 0, group:]).all()
    assert torch.isnan(out[0, 0, :group].float()).all(), f"seed {seed}: a NaN key did not give NaN"
    assert torch.isfinite(out[0, 0, group:].float()).all(), f"seed {seed}: the other head is not finite"


@needs_triton
@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("per_head", [False, True])
def test_lookup_table_entries_hold_the_fp16_centroids_side_by_side(bits, per_head):
    from tq_hf_cache.kernels.decode_attention import lookup_table

    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    heads = 3
    c = torch.randn((heads, 2**bits) if per_head else (2**bits,), generator=g)
    cb = Codebook.from_centroids(c, bits)
    table, stride = lookup_table(cb, heads, torch.device("cpu"))
    per, key_bits = (8 // bits, 8) if bits in (2, 4, 8) else (2, 2 * bits)
    assert table.shape[-1] == 2**key_bits and table.element_size() == 2 * per, f"seed {seed}"
    assert stride == (2**key_bits if per_head else 0)
    want = cb.centroids.to(torch.float16).reshape(-1, 2**bits)
    key = torch.arange(2**key_bits)
    for j in range(per):  # centroid j of entry `key` is that of index (key >> bits * j) & mask
        half = ((table.to(torch.int64) >> (16 * j)) & 0xFFFF).to(torch.int32).to(torch.int16).view(torch.float16)
        torch.testing.assert_close(half, want[:, (key >> (bits * j)) & (2**bits - 1)], rtol=0, atol=0,
                                   msg=lambda m: f"seed {seed}, centroid {j} of each entry: {m}")


@needs_triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="a long batched history: GPU only")
@pytest.mark.parametrize("kbits,vbits", [(5, 3), (4, 4)])
def test_kernel_at_batch_8_long_context_is_deterministic_and_matches_the_torch_math(kbits, vbits):
    """Batch 8 x 8 KV heads x 32k packed tokens: two launches give the same bits, also after launches with other
    split counts in between (the arrival counters must come back to zero), and equal reference.packed_attention."""
    from tq_hf_cache.quant.packing import packed_bytes

    seed = fresh_seed()
    g = torch.Generator("cuda").manual_seed(seed)
    b, hkv, group, d, lq, lr = 8, 8, 4, 128, 32640, 128
    kcb, vcb = codebook(kbits, d).to("cuda"), codebook(vbits, d).to("cuda")
    kp = torch.randint(0, 256, (b, hkv, lq, packed_bytes(d, kbits)), dtype=torch.uint8, device="cuda", generator=g)
    vp = torch.randint(0, 256, (b, hkv, lq, packed_bytes(d, vbits)), dtype=torch.uint8, device="cuda", generator=g)
    kn = (torch.rand(b, hkv, lq, device="cuda", generator=g) + 1).half()
    vn = (torch.rand(b, hkv, lq, device="cuda", generator=g) + 1).half()
    rk = torch.randn(b, hkv, lr, d, device="cuda", generator=g).bfloat16()
    rv = torch.randn(b, hkv, lr, d, device="cuda", generator=g).bfloat16()
    kv = PackedKV(kp, kn, vp, vn, rk[:, :, :0], rv[:, :, :0], rk, rv, lq + lr, lq, make_rotation(d, seed % 1000).to("cuda"),
                  kcb, vcb, 0, -1, -1)
    q = torch.randn(b, hkv * group, 1, d, device="cuda", generator=g).bfloat16()
    first = decode_attention(q, kv)
    for splits in (3, 17, 1):
        decode_attention(q, kv, num_splits=splits)
    again = decode_attention(q, kv)
    torch.cuda.synchronize()
    assert torch.equal(first, again), f"seed {seed}: max diff {(first.float() - again.float()).abs().max():.3g}"
    ref = reference.packed_attention(q, kv, None, None)
    err = ((first.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < TOL[torch.bfloat16], f"seed {seed}: relative error {err:.2e}"


@needs_triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="concurrent streams: GPU only")
def test_kernel_launches_on_two_streams_at_once_do_not_share_scratch():
    """Two launches that may overlap (the default stream and a side stream that does not wait for it) each give
    the result of a launch alone: each stream has its own split-K scratch and arrival counters."""
    seed = fresh_seed()
    states = [make_state(8, 8, 8000, 16, 1, 128, 5, 3, torch.bfloat16, seed + i)[0] for i in range(2)]
    qs = [make_query(8, 32, 1, 128, torch.bfloat16, seed + i) for i in range(2)]
    alone = [decode_attention(q, s) for q, s in zip(qs, states)]
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    for _ in range(5):
        a = decode_attention(qs[0], states[0])
        with torch.cuda.stream(side):
            b = decode_attention(qs[1], states[1])
        torch.cuda.synchronize()
        assert torch.equal(a, alone[0]) and torch.equal(b, alone[1]), f"seed {seed}"


# ------------------------------------------------------------------------------------------------------------
# split keys (`key_split`): each part its own packed codes, norms, rotation and codebook


def make_split_state(b, hkv, lq, lr, n, d, sizes, bits, vbits, dtype, seed, sinks=0, device=DEVICE):
    """`make_state` with its keys split (a random channel order per KV head): each part's packed codes and norms
    are live slices of bigger buffers poisoned around them; the oracle's keys are the split's dequantized ones."""
    from tq_hf_cache.quant.key_split import check_spec, make_split

    state, kf, vf = make_state(b, hkv, lq, lr, n, d, bits[0], vbits, dtype, seed, device=device, sinks=sinks)
    g = torch.Generator().manual_seed(seed + 2)
    order = [torch.randperm(d, generator=g).tolist() for _ in range(hkv)]
    spec = check_spec({"bits": list(bits), "sizes": list(sizes), "order": order}, 0)
    split = make_split(spec, 0, hkv, d, lambda m: make_rotation(m, (seed + m) % 1000), theoretical_codebook)
    t = lq + lr + n
    k = (torch.randn(b, hkv, t, d, generator=g) * (0.5 + 3 * torch.rand(b, hkv, t, 1, generator=g))).to(dtype)
    parts = []
    for packed, norms in reference.split_quantize(k[:, :, :lq], split):
        pb = torch.randint(0, 256, (b, hkv, lq + 9, packed.shape[-1]), dtype=torch.uint8, generator=g)
        nb = torch.randn(b, hkv, lq + 9, generator=g).to(norms.dtype)
        pb[:, :, 5 : 5 + lq], nb[:, :, 5 : 5 + lq] = packed, norms
        parts.append((pb[:, :, 5 : 5 + lq].to(device), nb[:, :, 5 : 5 + lq].to(device)))
    kf = torch.cat([reference.split_dequantize([(p.cpu(), nm.cpu()) for p, nm in parts], split),
                    k[:, :, lq:].float()], dim=2)
    window = torch.full((b, hkv, lr + n + 5, d), 1e4).to(dtype)
    window[:, :, : lr + n] = k[:, :, lq:]
    sink_k = state.sink_k
    if sinks:
        sink_k = state.sink_k.clone()
        sink_k[:, :, :sinks] = k[:, :, :sinks].to(device)
        kf[:, :, :sinks] = k[:, :, :sinks].float()
    state = replace(state, k_packed=parts[0][0], k_norms=parts[0][1], window_k=window[:, :, : lr + n].to(device),
                    sink_k=sink_k, k_codebook=split.parts[0][1].to(device), key_split=split.to(device),
                    key_parts=tuple(parts))
    return state, kf, vf


# (sizes, bits, vbits, d, group, n, lq, lr, dtype, mask, splits, sinks)
SPLIT_CASES = [
    ((32, 32), (5, 3), 2, 64, 4, 1, 203, 7, torch.bfloat16, None, None, 0),
    ((32, 32, 64), (6, 4, 3), 2, 128, 4, 1, 301, 17, torch.bfloat16, "bool", 3, 4),
    ((96, 32), (3, 5), 3, 128, 2, 3, 150, 5, torch.float16, "additive", 2, 0),  # 12 columns a plane, padded to 16
    ((16, 16, 32), (8, 2, 4), 4, 64, 3, 2, 97, 0, torch.float16, None, 2, 2),  # 2-bit part: 4 bytes a row, masked
    ((32, 32), (1, 7), 4, 64, 1, 1, 66, 0, torch.float16, None, 1, 0),
    ((48, 16), (4, 2), 3, 64, 4, 1, 130, 3, torch.bfloat16, "bool", None, 0),
]


@needs_triton
@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: f"{c[0]}x{c[1]}-v{c[2]}-d{c[3]}-g{c[4]}-n{c[5]}-{c[9]}-sinks{c[11]}")
def test_kernel_and_torch_math_on_split_keys_match_the_oracle(case):
    """Split keys: the score of a packed key is the sum over its parts, each scored in its own rotated domain."""
    sizes, bits, vbits, d, group, n, lq, lr, dtype, mask_kind, splits, sinks = case
    seed = fresh_seed()
    b, hkv = 2, 2
    hq, t = hkv * group, lq + lr + n
    state, kf, vf = make_split_state(b, hkv, lq, lr, n, d, sizes, bits, vbits, dtype, seed, sinks=sinks)
    q = make_query(b, hq, n, d, dtype, seed)
    mask = None if mask_kind is None else padding_mask(b, 1, n, t, [min(4, lq), 0], mask_kind)
    scale = 0.8 * d**-0.5
    ref = _oracle(q, kf, vf, mask, scale)
    for prefetch in (2, 0):  # the loop with the next tile's values loaded ahead, and without
        out = torch.full((b, n, hq, d), float("nan"), dtype=dtype, device=DEVICE)  # poisoned
        decode_attention(q, state, mask, scale, num_splits=splits, out=out, prefetch=prefetch)
        assert torch.isfinite(out).all(), f"seed {seed}: unwritten or non-finite outputs (prefetch {prefetch})"
        err = rel_err(out, ref)
        assert err < TOL[dtype], f"seed {seed}: kernel (prefetch {prefetch}), relative error {err:.2e}"
    cpu = replace(state, **{f: getattr(state, f).cpu().float() for f in ("window_k", "window_v", "sink_k", "sink_v")},
                  key_parts=tuple((p.cpu(), nm.cpu()) for p, nm in state.key_parts), key_split=state.key_split.to("cpu"),
                  k_packed=state.k_packed.cpu(), k_norms=state.k_norms.cpu(), v_packed=state.v_packed.cpu(),
                  v_norms=state.v_norms.cpu(), rotation=state.rotation.to("cpu"),
                  k_codebook=state.k_codebook.to("cpu"), v_codebook=state.v_codebook.to("cpu"))
    m = None if mask is None else mask.cpu()
    torch_math = reference.packed_attention(q.float().cpu(), cpu, m, scale)
    want = reference.attention(q.float().cpu(), kf, vf, mask=m, scale=scale).transpose(1, 2)
    assert rel_err(torch_math, want) < 1e-5, f"seed {seed}: torch math, relative error {rel_err(torch_math, want):.2e}"


@needs_triton
def test_kernel_refuses_a_split_it_cannot_read_and_the_attention_falls_back(caplog):
    state, _, _ = make_split_state(1, 2, 40, 2, 1, 64, (24, 40), (3, 3), 4, torch.float16, fresh_seed())
    q = make_query(1, 4, 1, 64, torch.float16, 0)
    with pytest.raises(ValueError, match=r"split in parts of \[24, 40\] channels at \[3, 3\] bits"):
        decode_attention(q, state, None, None)
    assert not select.kernel_serves(q, state)
    with caplog.at_level("WARNING"):
        assert ops.fused_decode(q, state, None, None) is None
    assert "no fused decode attention for keys split in parts of [24, 40] channels" in caplog.text
