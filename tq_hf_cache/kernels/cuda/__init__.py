"""The CUDA decode kernel (`decode_mma.cu`, CUDA C++ compiled at first use by NVRTC: `jit`) and its launcher.

One launch: `tq_decode` computes the packed history's split-K partials on tensor cores, each CTA rotating the query
itself and loading the codes straight into the MMA operand registers (see the source's header), and the exact
copies' (sinks, the window) in a CTA of their own or, where `plan` folds them, in the last split's; the last CTA of a
(batch, KV head) to finish merges the partials, rotates the values back once and writes the output. The Triton kernel
(`..decode_attention`) computes the same function and is its oracle; it is a sibling, not a fallback inside this
launcher: `..select` says which serves a step (no CUDA, a GPU older than sm_80, no NVRTC, a shape this kernel does not
take: the Triton kernel), and `ops` calls the one it names, or the other where this launcher declines.
"""

from __future__ import annotations

import ctypes
import functools
from importlib import resources

import torch

from .. import _common as C
from .. import decode_args as A
from . import jit

NAME = "tq_decode"
HEAD_DIMS = (64, 128, 256)
BITS = (2, 3, 4, 5)  # pair tables up to 4^5 entries
MAX_ROWS = 16  # query heads per KV head x queries: two query n-tiles
MIN_TOKENS_PER_SPLIT = {16: 256, 8: 512}  # by warps a CTA (`plan`)
EXACT_TOKENS = 2048  # packed tokens the exact copies count as where the last split's CTA takes them (`plan`)
SHORT_TOKENS = 8192  # the longest history `choose` takes its short-history plans for (more, shorter splits)

_SOURCE: str | None = None


def source() -> str:
    global _SOURCE
    if _SOURCE is None:
        _SOURCE = resources.files(__package__).joinpath("decode_mma.cu").read_text()
    return _SOURCE


class Params(ctypes.Structure):
    """The kernel's one by-value argument: the layout of `struct Params` in decode_mma.cu."""

    _fields_ = [
        ("kp", ctypes.c_void_p), ("skpb", ctypes.c_int64), ("skph", ctypes.c_int64),
        ("kn", ctypes.c_void_p), ("sknb", ctypes.c_int64), ("sknh", ctypes.c_int64),
        ("vp", ctypes.c_void_p), ("svpb", ctypes.c_int64), ("svph", ctypes.c_int64),
        ("vn", ctypes.c_void_p), ("svnb", ctypes.c_int64), ("svnh", ctypes.c_int64),
        ("ktab", ctypes.c_void_p), ("ktab_sh", ctypes.c_int64),
        ("vtab", ctypes.c_void_p), ("vtab_sh", ctypes.c_int64),
        ("mask", ctypes.c_void_p), ("smb", ctypes.c_int64), ("smh", ctypes.c_int64), ("smi", ctypes.c_int64),
        ("smt", ctypes.c_int64),
        ("acc", ctypes.c_void_p), ("ml", ctypes.c_void_p),
        ("len_ptr", ctypes.c_void_p), ("from_ptr", ctypes.c_void_p),
        ("hkv", ctypes.c_int32), ("group", ctypes.c_int32), ("nq", ctypes.c_int32),
        ("lq", ctypes.c_int32), ("sinks", ctypes.c_int32),
        ("num_splits", ctypes.c_int32), ("mask_elt", ctypes.c_int32), ("slots", ctypes.c_int32),
        ("fold", ctypes.c_int32),
        ("qx", ctypes.c_void_p), ("sqb", ctypes.c_int64), ("sqh", ctypes.c_int64), ("sqn", ctypes.c_int64),
        ("pi", ctypes.c_void_p),
        ("sk", ctypes.c_void_p), ("sskb", ctypes.c_int64), ("sskh", ctypes.c_int64),
        ("sv", ctypes.c_void_p), ("ssvb", ctypes.c_int64), ("ssvh", ctypes.c_int64),
        ("rk", ctypes.c_void_p), ("srkb", ctypes.c_int64), ("srkh", ctypes.c_int64),
        ("rv", ctypes.c_void_p), ("srvb", ctypes.c_int64), ("srvh", ctypes.c_int64),
        ("out", ctypes.c_void_p), ("sob", ctypes.c_int64), ("son", ctypes.c_int64), ("soh", ctypes.c_int64),
        ("counters", ctypes.c_void_p),
        ("lr", ctypes.c_int32), ("window", ctypes.c_int32), ("scale_log2", ctypes.c_float),
        ("pif", ctypes.c_void_p), ("pih", ctypes.c_void_p), ("sgn", ctypes.c_void_p), ("nx", ctypes.c_int32),
    ]


def shape_ok(head_dim: int, key_bits: int, value_bits: int, rows: int, split_keys: bool, slots: int) -> bool:
    """Whether the kernel takes this shape: head dims 64 / 128 / 256, keys and values at 2-5 bits, at most 16 query
    rows per KV head (8 at head dim 256: the warps' partials share 48 KB of shared memory), whole keys, and at least
    16 packed slots (a tile's rows stay inside the buffer)."""
    return (head_dim in HEAD_DIMS and key_bits in BITS and value_bits in BITS and rows <= max_rows(head_dim) and not split_keys
            and slots >= 16)


def max_rows(head_dim: int) -> int:
    """Query rows per KV head the kernel takes at this head dim (`shape_ok`)."""
    return MAX_ROWS if head_dim <= 128 else 8


def query_tiles(rows: int) -> int:
    """The query n-tiles of 8 rows a CTA holds for `rows` query rows per KV head (the source's NQ)."""
    return 1 if rows <= 8 else 2


def min_tokens(warps: int, head_dim: int) -> int:
    """The fewest packed tokens a split takes: MIN_TOKENS_PER_SPLIT[warps] up to head dim 128, half that at 256 (a
    tile is twice the work; docs/kernels.md has the measurement)."""
    return MIN_TOKENS_PER_SPLIT[warps] * 128 // max(head_dim, 128)


def most_splits(packed_len: int, least: int) -> int:
    """The most splits of a packed history of `packed_len` tokens, each at least `least` tokens (one where empty)."""
    return max(1, -(-max(packed_len, 1) // least))


def plan(batch_heads: int, packed_len: int, device: torch.device, max_splits: int | None = None,
         warps: int = 8, head_dim: int = 128, nq: int = 1, least: int | None = None) -> tuple[int, int]:
    """(splits, fold): the packed history's splits, one CTA of `warps` warps each, as many as `ctas_per_sm` CTAs an SM
    hold in one wave (at head dim `head_dim`, `nq` query n-tiles), at least `least` (default `min_tokens`) tokens a
    split, at most max_splits (what a caller's scratch holds); and the packed tokens the exact copies count as where
    the last split's CTA takes them too (EXACT_TOKENS; 0: they have CTAs of their own). It folds them where one CTA
    fills an SM (16 warps) and the splits are long (3 x EXACT_TOKENS or more): an SM of their own would idle most of
    the call. Otherwise they have a CTA of their own, room for which is left in the wave at 8 or more splits, or where
    one split fewer costs less than those CTAs waiting for a second wave. Where the history limits the splits, no two
    CTAs share an SM, and two CTAs an SM are counted only where two fit (else a second wave). The kernel places the
    splits' boundaries from the packed length it reads (`split_range`). docs/kernels.md has the measurements."""
    from ..support import sm_count

    sms = sm_count(device)
    slots = ctas_per_sm(head_dim, nq, warps) * sms
    want = max(1, slots // batch_heads)  # one wave: a partial second one doubles the time
    most = most_splits(packed_len, least or min_tokens(warps, head_dim))
    fold = warps == 16 and want >= 2 and packed_len >= 3 * EXACT_TOKENS * want
    if not fold and (want >= 8 or packed_len < EXACT_TOKENS // 4 * want * (want - 1)):
        want = (slots - batch_heads) // batch_heads  # room for the exact copies' CTAs in the wave
    splits = min(want, most)
    if not fold and splits == most and batch_heads * (splits + 1) > sms:
        splits = max(1, min(splits, sms // batch_heads - 1))
    if max_splits is not None:
        splits = max(1, min(splits, max_splits))
    return splits, EXACT_TOKENS if fold else 0


def choose(batch_heads: int, packed_len: int, device: torch.device, max_splits: int | None, head_dim: int, nq: int,
           warps: int) -> tuple[int, int, int]:
    """(warps, splits, fold): `plan` for the layout's `warps`, or for one CTA of 16 warps an SM where the layout chose
    two of 8 and 16 fold the exact copies into long splits with at least 5 % more of the SMs on the history (the two
    CTAs of 8 leave slots to the exact copies' CTAs), neither cut by max_splits. Where the layout chose 16 at head dim
    64 (5-bit keys) and the SMs, not the history, cut the unfolded 16-warp splits: two CTAs of 8 an SM, where a split
    an SM would leave each head at least two of them or the history is short (at most SHORT_TOKENS); folding there
    was faster with the kernel's code warm but slower inside a model, whose other kernels evict that code from the
    instruction caches and L2. At head dim 128, 8-warp CTAs take at least the 16-warp ones' tokens a split over short
    histories, two of them an SM, where every split and one exact copies' CTA a head still have an SM each.
    docs/kernels.md has the measurements behind each rule."""
    from ..support import sm_count

    splits, fold = plan(batch_heads, packed_len, device, max_splits, warps, head_dim, nq)
    short = packed_len <= SHORT_TOKENS and ctas_per_sm(head_dim, nq, 8) == 2
    if warps == 16 and head_dim == 64:
        free = plan(batch_heads, packed_len, device, None, 16, head_dim, nq)  # (what the SMs cut, not a scratch)
        if not free[1] and free[0] < most_splits(packed_len, min_tokens(16, head_dim)):
            if ctas_per_sm(head_dim, nq, 8) == 2 and (sm_count(device) // batch_heads >= 2 or short):
                return (8, *plan(batch_heads, packed_len, device, max_splits, 8, head_dim, nq))
    if warps == 8 and head_dim == 128 and short:
        s, f = plan(batch_heads, packed_len, device, max_splits, 8, head_dim, nq, min_tokens(16, head_dim))
        if s > splits and batch_heads * (s + 1) <= sm_count(device):
            return 8, s, f
    if warps == 8 and ctas_per_sm(head_dim, nq, 8) == 2 and not fold and (max_splits is None or splits < max_splits):
        s16, f16 = plan(batch_heads, packed_len, device, max_splits, 16, head_dim, nq)
        if f16 and s16 >= 2 and 40 * s16 > 21 * splits:  # s16 / SMs against splits / (2 SMs), 5 % more
            return 16, s16, f16
    return warps, splits, fold


EXACT_PARTS = 4  # the most CTAs the exact copies are cut among (the source's NXMAX)
EXACT_PART_TOKENS = 48  # the fewest exact tokens a part takes (`exact_parts`)


def exact_parts(batch_heads: int, splits: int, fold: int, exact_tokens: int, device: torch.device, head_dim: int,
                nq: int, warps: int, most: int | None = None) -> int:
    """The CTAs the exact copies (sinks and window, at most `exact_tokens` a (batch, KV head)) are cut among, each a
    part of whole 16-token tiles: one where the last split's CTA takes them (`fold`) or where two CTAs share an SM;
    else as many as the SMs the splits and one exact CTA a head leave free allow, at most EXACT_PARTS, at least
    EXACT_PART_TOKENS tokens a part, and at most `most` (what a caller's scratch holds beside the splits). Where one
    exact CTA holds the call up (a small grid: its copy of the exact rows into one SM ends after the splits), the
    parts run side by side (docs/kernels.md)."""
    from ..support import sm_count

    if fold or ctas_per_sm(head_dim, nq, warps) > 1:
        return 1
    free = sm_count(device) - batch_heads * (splits + 1)
    n = 1 + max(0, min(EXACT_PARTS - 1, free // batch_heads, (exact_tokens - 1) // EXACT_PART_TOKENS))
    return max(1, min(n, most)) if most is not None else n


def split_range(split: int, splits: int, packed_len: int, fold: int) -> tuple[int, int]:
    """The packed tokens [start, end) of a split, as the kernel places them: the history (and, where the last split's
    CTA takes the exact copies, `fold` tokens more) cut in equal parts at the nearest multiples of 16 (whole tiles,
    dealt to the warps in turn: a split's warps differ by at most one tile, and so do the splits), the last ending at
    the history's end. Splits past the history are empty."""
    span, per = packed_len + (fold if splits > 1 else 0), 16
    cut = lambda s: (span * s // splits + per // 2) // per * per  # noqa: E731
    return min(cut(split), packed_len), (packed_len if split == splits - 1 else min(cut(split + 1), packed_len))


@C._per_codebook_and_device
def pair_table(codebook, heads: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """(H', 4^bits) int32: entry i is the fp16 pair of values of the two codes packed in i (`Codebook.
    coordinate_values`: (c[i & m], c[i >> bits]) for a scalar codebook, point i of a pair codebook; the even
    coordinate in the low half), and its head stride (0 when the codebook is shared by the heads)."""
    bits = codebook.bits
    vals = codebook.to("cpu").coordinate_values(torch.arange(4**bits), 2)
    c = vals.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF  # (H', 4^bits, 2)
    entry = c[..., 0] | (c[..., 1] << 16)
    table = entry.to(torch.int64).where(entry < 2**31, entry - 2**32).to(torch.int32).contiguous().to(device)
    return table, (table.stride(0) if codebook.per_head else 0)


def pi_fragments(pi: torch.Tensor) -> torch.Tensor:
    """Pi as fp16 pairs in the B fragment order of the kernel's query rotation (`QueryRot`): int32
    (D / 8, 32, D / 16, 2), entry [nt, lane, kk, j] = (Pi[x, c], Pi[x, c + 1]) for output channel
    x = (g // 2) D / 4 + 2 nt + g % 2 (the order that puts output n-tiles 2s, 2s + 1 in the score MMA's A registers
    of k-step s) and input channel c = l4 D / 4 + 4 kk + 2 j (lane l4's contiguous quarter of the query; g, l4 =
    lane // 4, lane % 4)."""
    d = pi.shape[0]
    lane = torch.arange(32, device=pi.device)
    g, l4 = lane // 4, lane % 4
    x = (g // 2) * (d // 4) + 2 * torch.arange(d // 8, device=pi.device)[:, None] + g % 2  # (NT, 32)
    c = ((d // 4) * l4[:, None, None, None] + 4 * torch.arange(d // 16, device=pi.device)[None, :, None, None]
         + 2 * torch.arange(2, device=pi.device)[None, None, :, None] + torch.arange(2, device=pi.device))  # (32, KS, 2, 2)
    f = pi.float()[x[:, :, None, None, None], c[None]].to(torch.float16)  # (NT, 32, KS, 2, 2)
    return f.contiguous().view(torch.int32).squeeze(-1).contiguous()


def hadamard(rotation) -> bool:
    """Whether the kernel rotates by butterflies (the source's HAD): Pi = H diag(s) / sqrt(D), no matrix read."""
    return rotation.kind == "hadamard" and rotation.signs is not None


def sign_words(signs: torch.Tensor) -> torch.Tensor:
    """A Hadamard rotation's signs as the kernel's `sgn`: int32 (D / 32,), bit b of word w set where s_(32 w + b) is
    -1."""
    neg = (signs.reshape(-1, 32) < 0).to(torch.int64) << torch.arange(32, device=signs.device)
    w = neg.sum(-1)
    return w.where(w < 2**31, w - 2**32).to(torch.int32).contiguous()


def _per_rotation(name: str, rotation, device: torch.device, make) -> torch.Tensor:
    """make(), made once per device and held by the rotation (`rotation.derived`; looked up first: a copy of the
    rotation to another device on every call would cost a transfer, and fail under CUDA-graph capture)."""
    return rotation.derived.get((name, device), make)


def _signs(rotation, device: torch.device) -> torch.Tensor:
    return _per_rotation("cuda.signs", rotation, device, lambda: sign_words(rotation.signs.to(device)))


def _fragments(rotation, device: torch.device) -> torch.Tensor:
    return _per_rotation("cuda.fragments", rotation, device, lambda: pi_fragments(rotation.matrix.to(device)))


def _halves(rotation, device: torch.device) -> torch.Tensor:
    """Pi as fp16 (the merge's rotation back: half the bytes of fp32 on the call's last CTA)."""
    return _per_rotation("cuda.halves", rotation, device,
                         lambda: rotation.matrix.to(device, torch.float16).contiguous())


def prepare(rotation, k_codebook, v_codebook, heads: int, device: torch.device) -> None:
    """Build now what the kernel reads of the codebooks and the rotation, held by them (outside any CUDA graph: made
    while torch.compile's cudagraph trees record, they would come from the graph's pool and outlive the recording)."""
    for cb in (k_codebook, v_codebook):
        if cb.bits in BITS:
            pair_table(cb, heads, device)
    if hadamard(rotation):
        _signs(rotation, device)
    else:
        _fragments(rotation, device)
        _halves(rotation, device)


_MASK_DT = {torch.uint8: 0, torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}


def stages(head_dim: int) -> tuple[int, ...]:
    """Ring depths (tiles each warp keeps in flight) worth trying at this head dim, deepest first."""
    return (3, 2) if head_dim <= 128 else (2,)


def ctas_per_sm(head_dim: int, nq: int, warps: int = 8) -> int:
    """CTAs an SM runs at once (as the source's MIN_CTAS: two of 8 warps where 128 registers a thread suffice)."""
    return 2 if warps == 8 and nq == 1 and head_dim <= 128 else 1


# Shared memory per SM (KB) by compute capability (CUDA programming guide); others: 100
_SMEM_KB = {(8, 0): 164, (8, 7): 164, (9, 0): 228, (10, 0): 228, (10, 3): 228}
# Expected shared-memory wavefronts of one warp-wide lookup of random entries in a table held in R interleaved copies
# (copy c of entry e at word e R + c: the 32 / R lanes of a copy share 32 / R banks; simulated)
_WAVEFRONTS = {1: 3.53, 2: 3.44, 4: 3.29, 8: 2.95, 16: 2.0, 32: 1.0}


def tile_bytes(d: int, kb: int, vb: int, kn_f32: bool, vn_f32: bool) -> int:
    return -(-16 * (d * kb // 8 + d * vb // 8 + (4 if kn_f32 else 2) + (4 if vn_f32 else 2)) // 16) * 16


def table_bytes(kb: int, vb: int, kr: int, vr: int) -> int:
    """Shared memory of the two pair tables (4^bits entries of 4 bytes, in KR / VR copies)."""
    return 4 * (4**kb * kr + 4**vb * vr)


@functools.cache  # (asked on every decode call)
def layout(d: int, kb: int, vb: int, kn_f32: bool, vn_f32: bool, nq: int,
           capability: tuple[int, int], warps: int = 8) -> tuple[int, int, int]:
    """(STAGES, KR, VR): the ring depth and the copies of each pair table that fit the shared memory of
    `ctas_per_sm` CTAs of `warps` warps with the fewest expected lookup wavefronts (bank conflicts), the deeper ring
    on a tie. Measured on the H100 against the former fixed layout: -1 to +4 % per layer (docs/performance.md)."""
    per_cta = _SMEM_KB.get(tuple(capability), 100) * 1024 // ctas_per_sm(d, nq, warps) - 1088  # (1 KB: statics)
    best = None
    for st in stages(d):
        room = per_cta - warps * st * tile_bytes(d, kb, vb, kn_f32, vn_f32) - query_bytes(d)
        for kr in _WAVEFRONTS:
            for vr in _WAVEFRONTS:
                if table_bytes(kb, vb, kr, vr) <= room:
                    key = (_WAVEFRONTS[kr] + _WAVEFRONTS[vr], -st)
                    if best is None or key < best[0]:
                        best = (key, (st, kr, vr))
    return best[1] if best is not None else (2, 1, 1)


@functools.cache
def warps(d: int, kb: int, vb: int, kn_f32: bool, vn_f32: bool, nq: int, capability: tuple[int, int]) -> int:
    """Warps a CTA: 16, in one CTA an SM, where two CTAs of 8 would hold fewer copies of the pair tables (more
    expected bank conflicts: the 5-bit key tables at head dims up to 128), else 8. Both give 128 registers a thread;
    where more are needed (head dim 256, 16 query rows) it is 8 warps in one CTA. On a tie 8: measured on the H100,
    16 warps are faster for k5v3 and slower for k4v4, whose copies are the same either way (docs/performance.md)."""
    if ctas_per_sm(d, nq) == 1:
        return 8
    wave = lambda w: sum(_WAVEFRONTS[r] for r in layout(d, kb, vb, kn_f32, vn_f32, nq, capability, w)[1:])  # noqa: E731
    return 16 if wave(16) < wave(8) else 8


QPAIR_TOKENS = 128  # the fewest packed tokens of a split a warp takes where `qpair` holds


def qpair(d: int, nq: int, span: int, splits: int, w: int) -> bool:
    """Whether the query's fragments ride in registers, two k-steps a register quad (the source's QPAIR): at head
    dim 128 and one query n-tile, where each of a split's `w` warps takes QPAIR_TOKENS or more of the `span` packed
    tokens. H200, Llama 3.1 8B's layer: 6 % less time at 1 x 128k (k5v3), 8 % (k4v4), 4 % at 8 x 32k; but 3 % more at
    1 x 4k (a tile or two a warp), and at head dim 64 (its fragments already in registers) level or slower."""
    return d == 128 and nq == 1 and span // max(1, splits * w) >= QPAIR_TOKENS


def query_bytes(d: int) -> int:
    """Shared memory of the rotated query's A fragments (D / 16 k-steps x 32 lanes x 16 bytes)."""
    return 32 * d


def packed_smem(df: dict[str, int]) -> int:
    """Dynamic shared memory of the packed kernel of these defines: the warps' tile rings, the two tables, the query's
    fragments; after the loop, the warps' partials (max, sum and accumulator of 8 NQ rows each, rows of D + 4:
    the source's PSTRIDE)."""
    tile = tile_bytes(df["D"], df["KB"], df["VB"], bool(df["KN_F32"]), bool(df["VN_F32"]))
    w = df["WARPS"]
    loop = w * df["STAGES"] * tile + table_bytes(df["KB"], df["VB"], df["KR"], df["VR"]) + query_bytes(df["D"])
    return max(loop, 4 * w * 8 * df["NQ"] * (df["D"] + 6))


def _aligned(v: int, *tensors: torch.Tensor) -> bool:
    """Whether every tensor's base address and every stride but the last dim's allow v-byte loads of its rows."""
    return all(t.data_ptr() % v == 0 and all((st * t.element_size()) % v == 0 for st in t.stride()[:-1])
               for t in tensors)


def _vec(*rows: torch.Tensor) -> int:
    """The widest load or copy (16, 8 or 4 bytes) the tensors' rows allow (0: none)."""
    return next((v for v in (16, 8, 4) if _aligned(v, *rows)), 0)


def _norms_vec(*norms: torch.Tensor) -> bool:
    """Whether the (B, H, slots) norms load two tokens at a time (the kernel's tiles start at even tokens)."""
    return all(t.stride(-1) == 1 and t.data_ptr() % (2 * t.element_size()) == 0
               and all(st % 2 == 0 for st in t.stride()[:-1]) for t in norms)


def defines(d: int, kb: int, vb: int, nq: int, mask_kind: int, mask_dt: int, kn_f32: bool, vn_f32: bool,
            static: bool, vec: int, nvec: bool, capability: tuple[int, int] = (9, 0),
            w: int | None = None) -> dict[str, int]:
    """The packed kernel's defines; `w` warps a CTA (default: `warps`, the layout's choice)."""
    w = w or warps(d, kb, vb, kn_f32, vn_f32, nq, capability)
    st, kr, vr = layout(d, kb, vb, kn_f32, vn_f32, nq, capability, w)
    return dict(D=d, KB=kb, VB=vb, NQ=nq, MASK_KIND=mask_kind, MASK_DT=mask_dt, KN_F32=int(kn_f32),
                VN_F32=int(vn_f32), KR=kr, VR=vr, STATIC=int(static), VEC=vec, NVEC=int(nvec), STAGES=st, WARPS=w)


_DT = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


def _exact_fixed(d: int, rows: int, xbytes: int, warps: int) -> tuple[int, int, int, int]:
    """(bytes before the batch, bytes a staged token, tokens a tile, partial rows a warp) of the exact copies' CTA: on
    tensor cores (fp16 / bf16 copies: the warps' maxima and sums of 8 or 16 rows, the query's fragments; key and value
    rows padded by 16 bytes) or, for fp32 copies, by warps (the query in fp32, the maxima and sums of `rows`)."""
    if xbytes == 2:
        rq = 8 * query_tiles(rows)
        return 8 * warps * rq + 32 * d, 2 * (2 * d + 16), 16, rq
    return 4 * (rows * d + 2 * warps * rows), 2 * d * xbytes, 8, rows


def exact_smem(d: int, rows: int, batch: int = 16, xbytes: int = 2, warps: int = 8) -> int:
    """Dynamic shared memory of the exact copies' CTA: the query, the warps' maxima and sums, then a batch of `batch`
    tokens' keys and values of `xbytes` bytes an element, later the warps' partials (the merge's: `merge_splits`)."""
    fixed, per, _, partial_rows = _exact_fixed(d, rows, xbytes, warps)
    return fixed + max(4 * warps * partial_rows * d, batch * per)


def merge_splits(d: int, rows: int, smem: int, warps: int = 8, had: bool = False) -> tuple[int, int]:
    """(MSPLITS, shared memory): the splits' partials the merge stages in shared memory at a time (what fits in `smem`
    after its own arrays: the merged partial, the channel groups' parts of its rotation (one where `had`: the
    butterflies), the max and sum; at least one, the shared memory grown to hold it where it does not fit), and the
    shared memory that takes."""
    groups = 1 if had else warps * 32 // (d // 4)
    fixed = 4 * (rows * d * (1 + groups) + ((2 * rows + 3) & ~3))
    per = 4 * rows * (d + 2)
    return max(1, (smem - fixed) // per), max(smem, fixed + per)


def merge_direct(d: int) -> bool:
    """Whether the merge reads each thread's splits straight from L2 into registers (the source's MDIRECT, 8 splits'
    loads in flight at a time) instead of staging every split's partial in shared memory first: at head dims up to
    128. H100, 1 x 4k, in one run (us): Llama 3.1 8B k5v3 9.80 -> 9.40 (SDPA 9.73), k4v4 9.21 -> 9.01, k4v2 8.79 ->
    8.58; SmolLM2-1.7B k5v3 11.33 -> 11.19, k4v4 10.47 -> 10.40; 1 x 32k k5v3 22.27 -> 21.80; slower where a thread
    has more than 8 splits (Llama k4v4 1 x 128k, 33 splits of 8 warps: 61.11 -> 61.65) and, in an earlier build, at
    head dim 256 (Gemma 3 4B k5v3 11.42 -> 11.68, 12B 12.05 -> 12.27). Either path alone is faster than both in one
    build with a branch between them (Llama k5v3 9.75)."""
    return d <= 128


def exact_batch(d: int, rows: int, xbytes: int, smem: int, warps: int = 8) -> int:
    """Tokens of the exact copies the exact CTA stages at a time (XB): what fits in `smem` beside the query and the
    warps' maxima and sums, whole tiles (16 tokens on tensor cores, else 8) up to 256."""
    fixed, per, tile, _ = _exact_fixed(d, rows, xbytes, warps)
    return max(tile, min(256, (smem - fixed) // per // tile * tile))


def _mask_row(mask_kind: int, m_arg: torch.Tensor, strides, slots: int) -> bool:
    """Whether the packed loop reads a bool mask as one row for all of a CTA's rows, two tokens a load: one row per
    batch row (kind 3), contiguous tokens, 2-byte aligned rows and an even slot count (tiles start at even tokens)."""
    return (mask_kind == 3 and strides[3] == 1 and m_arg.data_ptr() % 2 == 0 and strides[0] % 2 == 0
            and slots % 2 == 0)


def decode(query, kv, pi, scale_log2, kp, kn, vp, vn, rk, rv, sk, sv, mask_args, acc, ml, counters, lens, lengths,
           num_splits: int, fold: int, rows: int, out, w: int, parts: int = 1) -> bool:
    """The whole decode attention of `..decode_attention.decode_attention` (its prepared arguments) into `out`, in CTAs
    of `w` warps (`choose`'s), the exact copies cut among `parts` CTAs (`exact_parts`) or, where `fold` > 0, taken by
    the last split's CTA and counted as `fold` packed tokens in placing the splits (`split_range`).
    Returns False, having launched nothing, where the buffers' layout or dtypes are not the kernel's; raises
    jit.JitError where it cannot be built or loaded (the caller turns it off on this device: `select.cuda_failed`)."""
    if fold and parts != 1:
        raise ValueError(f"the exact copies folded into the last split's CTA are one part, not {parts}")
    b, hq, n, d = query.shape
    hkv = kp.shape[1]
    group = hq // hkv
    mask_kind, m_arg, ms = mask_args
    vec = _vec(kp, vp)
    had = hadamard(kv.rotation)
    if vec == 0 or query.dtype not in _DT or rk.dtype not in _DT or acc.data_ptr() % 16:  # (16-byte partial reads)
        return False
    kind = {0: 0, 1: 1, 2: 2, 3: 1, 4: 2}[mask_kind]
    mdt = _MASK_DT[m_arg.dtype] if mask_kind else 0
    kb, vb, kn32, vn32 = kv.k_codebook.bits, kv.v_codebook.bits, kn.dtype == torch.float32, vn.dtype == torch.float32
    df = defines(d, kb, vb, query_tiles(group * n), kind, mdt, kn32, vn32, kv.static, vec,
                 _norms_vec(kn, vn) and kp.shape[2] % 2 == 0, torch.cuda.get_device_capability(query.device), w)
    df.update(Q_DT=_DT[query.dtype], X_DT=_DT[rk.dtype], O_DT=_DT[out.dtype], ROWS=rows, HAD=int(had), NXMAX=parts,
              FOLD=int(fold > 0), MASK_ROW=int(_mask_row(mask_kind, m_arg, ms, kp.shape[2])))
    xbytes, smem, w = rk.element_size(), packed_smem(df), df["WARPS"]
    df.update(XB=exact_batch(d, rows, xbytes, smem, w), XVEC=_vec(rk, rv, sk, sv),
              QV=int(_aligned(4 * query.element_size(), query)))
    lq, lr, window = lengths
    df.update(QPAIR=int(qpair(d, df["NQ"], lq or kp.shape[2], num_splits, w)))  # (static: the capacity)
    msplits, smem = merge_splits(d, rows, max(smem, exact_smem(d, rows, df["XB"], xbytes, w)), w, had)
    df.update(MSPLITS=msplits, MDIRECT=int(merge_direct(d)))
    device = query.device
    main = jit.kernel(source(), NAME, df, device, smem)
    (kt, kt_sh), (vt, vt_sh) = pair_table(kv.k_codebook, hkv, device), pair_table(kv.v_codebook, hkv, device)
    if had:
        sgn, rot = _signs(kv.rotation, device).data_ptr(), (0, 0, 0)
    else:
        pi = pi.contiguous()
        frag, half = _fragments(kv.rotation, device), _halves(kv.rotation, device)
        sgn, rot = 0, (pi.data_ptr(), frag.data_ptr(), half.data_ptr())
    ln, fr = lens if lens is not None else (acc, acc)
    m_ptr = m_arg.data_ptr() if mask_kind else 0
    m_strides = tuple(ms) if mask_kind else (0, 0, 0, 0)
    m_elt = m_arg.element_size() if mask_kind else 1
    params = Params(
        kp.data_ptr(), kp.stride(0), kp.stride(1), kn.data_ptr(), kn.stride(0), kn.stride(1),
        vp.data_ptr(), vp.stride(0), vp.stride(1), vn.data_ptr(), vn.stride(0), vn.stride(1),
        kt.data_ptr(), kt_sh, vt.data_ptr(), vt_sh,
        m_ptr, *m_strides, acc.data_ptr(), ml.data_ptr(), ln.data_ptr(), fr.data_ptr(),
        hkv, group, n, lq, kv.sinks, num_splits, m_elt, kp.shape[2], fold,
        query.data_ptr(), *query.stride()[:3], rot[0],
        sk.data_ptr(), sk.stride(0), sk.stride(1), sv.data_ptr(), sv.stride(0), sv.stride(1),
        rk.data_ptr(), rk.stride(0), rk.stride(1), rv.data_ptr(), rv.stride(0), rv.stride(1),
        out.data_ptr(), *out.stride()[:3], counters.data_ptr(), lr, window, scale_log2, rot[1], rot[2], sgn, parts)
    with torch.cuda.device(device):  # the kernel belongs to this device's context: make it current for the launch
        grid = (b * hkv, num_splits + (0 if fold else parts), 1)  # (the exact copies' own CTAs unless folded)
        main.launch(grid, 32 * w, params, torch.cuda.current_stream(device).cuda_stream)
    return True


def decode_attention(query: torch.Tensor, kv, mask: torch.Tensor | None = None, scale: float | None = None, *,
                     out: torch.Tensor | None = None, chunk: int = 0) -> torch.Tensor | None:
    """Attention of query (B, Hq, n, D) over every position of `kv` by this kernel: what the Triton launcher
    (`..decode_attention.decode_attention`) computes, for the shapes `shape_ok` takes, `chunk` queries a launch
    where it is given (`select.Choice.chunk`). Returns (B, n, Hq, D), written into `out` when given, or None,
    having launched nothing, where the buffers' layout or dtypes are not the kernel's (the caller's fallback then
    serves); raises jit.JitError where the kernel cannot be built or loaded."""
    if chunk:
        return A.by_query_chunks(decode_attention, query, kv, mask, scale, chunk, out)
    b, hq, n, d = query.shape
    group = A.check_heads(query, kv)
    hkv = kv.k_packed.shape[1]
    kcb, vcb = kv.k_codebook, kv.v_codebook
    if not shape_ok(d, kcb.bits, vcb.bits, group * n, kv.key_split is not None, kv.k_packed.shape[2]):
        raise ValueError(f"the CUDA decode kernel does not take head dim {d}, bits k{kcb.bits}v{vcb.bits}, "
                         f"{group}x{n} rows")
    ln = A.lengths(kv)
    rows = A.stored_rows(group, n)
    most = None if kv.scratch is None else kv.scratch.numel() // (b * hkv * rows * (d + 2)) - 1
    nqt = query_tiles(group * n)
    w = warps(d, kcb.bits, vcb.bits, kv.k_norms.dtype == torch.float32, kv.v_norms.dtype == torch.float32, nqt,
              torch.cuda.get_device_capability(query.device))
    w, num_splits, fold = choose(b * hkv, ln.split_len, query.device, most, d, nqt, w)
    exact = kv.sinks + (ln.window if kv.static else ln.lr)  # (at most: a static cache's window is read on the device)
    parts = exact_parts(b * hkv, num_splits, fold, exact, query.device, d, nqt, w,
                        None if most is None else most + 1 - num_splits)
    num_splits = max(1, int(num_splits))
    slots = b * hkv * (num_splits + parts)
    need = slots * rows * (d + 2)
    scratch, counters = A.scratch_for(kv, query.device, need, b * hkv)
    acc, ml = scratch[: slots * rows * d], scratch[slots * rows * d : need]
    mask_args = A.mask_args(mask, b, hq, n, ln.t, query)
    qv = query if query.stride(-1) == 1 else query.contiguous()
    kp, vp = A.packed_rows(kv.k_packed), A.packed_rows(kv.v_packed)
    kn = A.tokens_last(kv.k_norms.unsqueeze(-1), 1).squeeze(-1)
    vn = A.tokens_last(kv.v_norms.unsqueeze(-1), 1).squeeze(-1)
    rk, rv = A.tokens_last(kv.window_k, d), A.tokens_last(kv.window_v, d)
    sk, sv = A.tokens_last(kv.sink_k, d), A.tokens_last(kv.sink_v, d)
    pi = A.rotation_on(kv, query.device)
    out = A.output(query, out)
    scale_log2 = (d**-0.5 if scale is None else float(scale)) * A.LOG2E
    if decode(qv, kv, pi, scale_log2, kp, kn, vp, vn, rk, rv, sk, sv, mask_args, acc, ml, counters, ln.lens,
              (ln.lq, ln.lr, ln.window), num_splits, fold, rows, out, w, parts):
        return out
    return None
