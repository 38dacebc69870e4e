"""A tried and not kept design of the fused decode attention: whole (BLOCK_N, D) tiles, scores transposed.

The package's kernel (`tq_hf_cache.kernels.decode_attention`, "planes") runs one warp per program and scores each
coordinate plane of a packed tile against the matching plane of the rotated query, with tiles of 16 query rows (4 live
at GQA 4 / one query). This study tests the opposite layout, which lets several warps share a program without
redoing each other's work:
- the packed K tile is unpacked to (BLOCK_N, D) indices in natural coordinate order (`_common.expand_groups`, as the
  dequantize kernel does), its centroids gathered (`_common.gather`), and scored transposed, S^T = K' @ q'^T, so the
  tokens are the rows of the first dot and each warp takes its own;
- acc += P @ V' with the D columns spread over the warps; q' = Pi q and the final y @ Pi are done QC columns at a
  time (a whole (D, D) Pi held 128 registers a thread and spilled); the exact copies use the same transposed loop.
Everything else (split-K, scratch, last-arriver merge) is the package kernel's.

Result on the H100 (triton 3.6, `benchmarks/results/decode_tiles_study_h100.json`): correct (max difference to the
package kernel ~1e-5 on outputs ~1e-2) and 1.6-2.7x slower at every row, with 128-176 registers and no spills, at
every tile size, warp count and programs-per-SM tried. The unpacking reshuffle and the conversions of the whole
(BLOCK_N, D) tiles into dot-operand layouts cost more than the warps win; the plane layout never reshuffles a tile.

Usage:
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/studies/decode_tiles_study.py --check 1   # CPU: matches
    PYTHONPATH=. python benchmarks/studies/decode_tiles_study.py --out DIR                       # H100: timing
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from tq_hf_cache.kernels import _common as C  # noqa: E402
from tq_hf_cache.kernels import decode_attention as da  # noqa: E402
from tq_hf_cache.kernels import num_splits_for  # noqa: E402

MERGE_ROWS = 16  # split partials merged per step: fewer registers than the package kernel's 64


@triton.jit
def _codes(base, offs, t_ok, BITS: tl.constexpr, D: tl.constexpr, STRIDE_T: tl.constexpr, BLOCK_N: tl.constexpr):
    """(BLOCK_N, D) int32 indices of the rows offs (natural coordinate order; rows are whole words)."""
    rows = base + offs.to(tl.int64) * STRIDE_T
    if BITS == 8:
        w = tl.load(rows.to(tl.pointer_type(tl.int32), bitcast=True)[:, None] + tl.arange(0, D // 4)[None, :],
                    mask=t_ok[:, None], other=0)
        idx = tl.reshape(tl.join(tl.join(w & 255, (w >> 16) & 255), tl.join((w >> 8) & 255, (w >> 24) & 255)),
                         (BLOCK_N, D))
    else:
        idx = C.expand_groups(C.load_groups(rows, t_ok, BITS, D, 4, D // 8), BITS, D, BLOCK_N)
    return idx


@triton.jit
def _softmax_t(st, pos, t_ok, m_t, l_t, row_ok, row_i, heads, m_base, smh, smi, smt, causal_limit,
               MASK_KIND: tl.constexpr):
    """One online-softmax step on transposed scores st (BLOCK_N keys, BLOCK_M rows), base 2: (p, alpha, m, l)."""
    ok = t_ok[:, None] & row_ok[None, :]
    if MASK_KIND == 0:
        ok = ok & (pos[:, None] <= causal_limit[None, :])
    elif MASK_KIND == 1:
        mv = tl.load(m_base + heads[None, :] * smh + row_i[None, :] * smi + pos[:, None] * smt, mask=ok, other=0)
        ok = ok & (mv != 0)
    else:
        mv = tl.load(m_base + heads[None, :] * smh + row_i[None, :] * smi + pos[:, None] * smt, mask=ok, other=0.0)
        st = st + mv.to(tl.float32) * 1.4426950408889634
    st = tl.where(ok, st, float("-inf"))
    m_new = tl.maximum(m_t, tl.max(st, 0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(st - m_safe[None, :])
    alpha = tl.exp2(m_t - m_safe)
    return p, alpha, m_new, l_t * alpha + tl.sum(p, 0)


@triton.jit
def _exact_tiles(qt, acc, m_t, l_t, k_base, v_base, length, pos0, ring, row_ok, row_i, heads, m_base, smh, smi,
                 smt, causal_limit, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 MASK_KIND: tl.constexpr, WRAP: tl.constexpr):
    """`length` exact (unrotated) tokens at positions pos0 + j, at slot j, or (pos0 + j) % ring with WRAP; fp32
    operands (tf32 dots), scores transposed as in the packed loop."""
    d = tl.arange(0, D)
    for t0 in range(0, length, BLOCK_N):
        offs = t0 + tl.arange(0, BLOCK_N)
        t_ok = offs < length
        if WRAP:
            slot = (pos0 + offs) % ring
        else:
            slot = offs
        k = tl.load(k_base + slot[:, None] * D + d[None, :], mask=t_ok[:, None], other=0.0).to(tl.float32)
        p, alpha, m_t, l_t = _softmax_t(tl.dot(k, qt), pos0 + offs, t_ok, m_t, l_t, row_ok, row_i, heads, m_base,
                                        smh, smi, smt, causal_limit, MASK_KIND)
        v = tl.load(v_base + slot[:, None] * D + d[None, :], mask=t_ok[:, None], other=0.0).to(tl.float32)
        acc = acc * tl.reshape(alpha, (BLOCK_M, 1)) + tl.dot(tl.trans(p), v)
    return acc, m_t, l_t


@triton.jit
def _tile_kernel(
    q_ptr, sqb, sqh, sqn,
    pi_ptr,
    kp_ptr, skpb, skph, kn_ptr, sknb, sknh,
    vp_ptr, svpb, svph, vn_ptr, svnb, svnh,
    kc_ptr, vc_ptr,
    rk_ptr, srkb, srkh, rv_ptr, srvb, srvh,
    sk_ptr, sskb, sskh, sv_ptr, ssvb, ssvh,
    m_ptr, smb, smh, smi, smt,
    o_ptr, sob, son, soh,
    acc_ptr, ml_ptr, cnt_ptr,
    Hkv, Lq, Lr, N, Ls, tok_per_split, num_splits, scale_log2,
    len_ptr, from_ptr, ring,
    G: tl.constexpr, D: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,
    KPT: tl.constexpr, VPT: tl.constexpr, KC_SH: tl.constexpr, VC_SH: tl.constexpr,
    BLOCK_M: tl.constexpr, R: tl.constexpr, SC: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_KIND: tl.constexpr, STATIC: tl.constexpr, QC: tl.constexpr, FP_BLOCK: tl.constexpr,
):
    """The packed history as whole (BLOCK_N, D) tiles: scores transposed, S^T = K' @ q'^T (tokens are the rows of the
    first dot, so every warp takes its own tokens), then acc += P @ V' (the D columns spread over the warps). K', V'
    are the centroids in the rotated domain (natural coordinate order); the rest is the package kernel's."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b, h, r, row_i, row_ok, heads = da._program_rows(pid, Hkv, N, G, BLOCK_M)
    d = tl.arange(0, D)
    q_rows = q_ptr + b * sqb + heads * sqh + row_i * sqn
    m_base = m_ptr + b * smb
    T, Lq, Lr, Ls = da._lengths(Lq, Lr, Ls, len_ptr, from_ptr, STATIC)
    causal_limit = T - N + row_i
    acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    m_t = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_t = tl.zeros((BLOCK_M,), dtype=tl.float32)
    base = pid.to(tl.int64) * (num_splits + 1)
    slot = base + split
    keep = r < R
    qc = tl.arange(0, QC)
    if split < num_splits:
        # q' = Pi q, transposed (D, BLOCK_M), pre-scaled for exp2; Pi^T is read QC rows at a time
        qr = tl.zeros((BLOCK_M, D), dtype=tl.float32)
        for c0 in tl.static_range(0, D, QC):
            q_c = tl.load(q_rows[:, None] + (c0 + qc)[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
            pit_c = tl.load(pi_ptr + d[None, :] * D + (c0 + qc)[:, None])  # pit_c[j, i] = Pi[i, c0 + j]
            qr = tl.dot(q_c, pit_c, qr, input_precision="ieee")
        qt = tl.trans(qr * scale_log2).to(tl.float16)
        start = split * tok_per_split
        end = tl.minimum(start + tok_per_split, Lq)
        kp = kp_ptr + b * skpb + h * skph
        vp = vp_ptr + b * svpb + h * svph
        kn = kn_ptr + b * sknb + h * sknh
        vn = vn_ptr + b * svnb + h * svnh
        kc = kc_ptr + h * KC_SH
        vc = vc_ptr + h * VC_SH
        for t0 in range(start, end, BLOCK_N):
            offs = t0 + tl.arange(0, BLOCK_N)
            t_ok = (offs < end) & (offs >= Ls)
            kk = C.gather(kc, _codes(kp, offs, t_ok, KBITS, D, KPT, BLOCK_N)).to(tl.float16)
            knorm = tl.load(kn + offs, mask=t_ok, other=0.0).to(tl.float32)
            p, alpha, m_t, l_t = _softmax_t(tl.dot(kk, qt) * knorm[:, None], offs, t_ok, m_t, l_t, row_ok, row_i,
                                            heads, m_base, smh, smi, smt, causal_limit, MASK_KIND)
            vnorm = tl.load(vn + offs, mask=t_ok, other=0.0).to(tl.float32)
            pv = tl.trans((p * vnorm[:, None]).to(tl.float16))  # (BLOCK_M, BLOCK_N)
            vv = C.gather(vc, _codes(vp, offs, t_ok, VBITS, D, VPT, BLOCK_N)).to(tl.float16)
            acc = acc * tl.reshape(alpha, (BLOCK_M, 1)) + tl.dot(pv, vv)
        # back from the rotated domain, y @ Pi = Pi^T y, QC output columns at a time, straight into the partials
        for c0 in tl.static_range(0, D, QC):
            pim_c = tl.load(pi_ptr + d[:, None] * D + (c0 + qc)[None, :])
            tl.store(acc_ptr + (slot * R + r[:, None]) * D + (c0 + qc)[None, :], tl.dot(acc, pim_c),
                     mask=keep[:, None])
    else:
        # the exact copies, unrotated: sinks, then the ring
        q = tl.load(q_rows[:, None] + d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
        qx = tl.trans(q * scale_log2)
        acc, m_t, l_t = _exact_tiles(qx, acc, m_t, l_t, sk_ptr + b * sskb + h * sskh, sv_ptr + b * ssvb + h * ssvh,
                                     Ls, 0, ring, row_ok, row_i, heads, m_base, smh, smi, smt, causal_limit,
                                     D, BLOCK_M, FP_BLOCK, MASK_KIND, False)
        acc, m_t, l_t = _exact_tiles(qx, acc, m_t, l_t, rk_ptr + b * srkb + h * srkh, rv_ptr + b * srvb + h * srvh,
                                     Lr, Lq, ring, row_ok, row_i, heads, m_base, smh, smi, smt, causal_limit,
                                     D, BLOCK_M, FP_BLOCK, MASK_KIND, STATIC)
        tl.store(acc_ptr + (slot * R + r[:, None]) * D + d[None, :], acc, mask=keep[:, None])
    tl.store(ml_ptr + slot * 2 * R + r, m_t, mask=keep)
    tl.store(ml_ptr + slot * 2 * R + R + r, l_t, mask=keep)
    _merge(pid, base, num_splits, acc_ptr, ml_ptr, cnt_ptr, o_ptr, sob, son, soh, b, h, d, G, N, R, SC, D)


_merge = da._merge  # the package kernel's split merge, as is



def tiles_attention(query, kv, mask=None, scale=None, *, num_splits=None, block_n=64, num_warps=4, fp_block=16):
    """`da.decode_attention`'s contract (dynamic and static PackedKV, masks, sinks), with the tile kernel."""
    b, hq, n, d = query.shape
    hkv = kv.k_packed.shape[1]
    group = hq // hkv
    kcb, vcb = kv.k_codebook, kv.v_codebook
    if kv.static:
        lq = lr = 0
        split_len = t = kv.capacity
        lens, ring = (kv.length, kv.exact_from), kv.ring_k.shape[2]
    else:
        lq, lr = int(kv.exact_from), int(kv.length) - int(kv.exact_from)
        split_len, t = lq, lq + lr
        lens, ring = None, 0
    block_m, rows, _ = da._rows(group, n)
    num_splits, tok_per_split = da._split_plan(b * hkv, split_len, query.device, num_splits, block_n)
    slots = b * hkv * (num_splits + 1)
    need = slots * rows * (d + 2)
    scratch, counters = da._scratch(query.device, need, b * hkv)
    acc, ml = scratch[: slots * rows * d], scratch[slots * rows * d : need]
    mask_kind, m_arg, ms = da._mask_args(mask, b, hq, n, t, query)
    qv = query if query.stride(-1) == 1 else query.contiguous()
    kp, vp = da._packed(kv.k_packed), da._packed(kv.v_packed)
    kn = da._tokens_last(kv.k_norms.unsqueeze(-1), 1).squeeze(-1)
    vn = da._tokens_last(kv.v_norms.unsqueeze(-1), 1).squeeze(-1)
    rk, rv = da._tokens_last(kv.ring_k, d), da._tokens_last(kv.ring_v, d)
    sk, sv = da._tokens_last(kv.sink_k, d), da._tokens_last(kv.sink_v, d)
    pi = kv.rotation.matrix.to(query.device)
    kc, _, kc_sh, _ = C.codebook_tables(kcb, hkv, query.device)
    vc, _, vc_sh, _ = C.codebook_tables(vcb, hkv, query.device)
    out = torch.empty(b, n, hq, d, dtype=query.dtype, device=query.device)
    len_ptr, from_ptr = lens if lens is not None else (counters, counters)
    _tile_kernel[(b * hkv, num_splits + 1)](
        qv, *qv.stride()[:3],
        pi,
        kp, kp.stride(0), kp.stride(1), kn, kn.stride(0), kn.stride(1),
        vp, vp.stride(0), vp.stride(1), vn, vn.stride(0), vn.stride(1),
        kc, vc,
        rk, rk.stride(0), rk.stride(1), rv, rv.stride(0), rv.stride(1),
        sk, sk.stride(0), sk.stride(1), sv, sv.stride(0), sv.stride(1),
        m_arg, *ms,
        out, *out.stride()[:3],
        acc, ml, counters,
        hkv, lq, lr, n, kv.sinks, tok_per_split, num_splits, (d**-0.5 if scale is None else float(scale)) * da.LOG2E,
        len_ptr, from_ptr, ring,
        G=group, D=d, KBITS=kcb.bits, VBITS=vcb.bits, KPT=kp.shape[-1], VPT=vp.shape[-1], KC_SH=kc_sh, VC_SH=vc_sh,
        BLOCK_M=block_m, R=rows, SC=max(1, MERGE_ROWS // rows), BLOCK_N=block_n, MASK_KIND=mask_kind,
        STATIC=kv.static, QC=32, FP_BLOCK=fp_block, num_warps=num_warps,
    )
    return out


def check():
    """CPU (interpreter): the tile kernel against the package kernel on random packed layers, several presets."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
    from tq_hf_cache.codebook import theoretical_codebook
    from tq_hf_cache.packed_kv import PackedKV
    from tq_hf_cache.packing import packed_bytes
    from tq_hf_cache.rotation import make_rotation

    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    g = torch.Generator().manual_seed(seed)
    for kb, vb, n, t in ((5, 3, 1, 300), (4, 4, 3, 200), (4, 2, 1, 161), (7, 8, 2, 150)):
        b, hkv, hq, d, lr, sinks = 2, 2, 8, 64, 20, 4
        lq = t - lr
        kp = torch.randint(0, 256, (b, hkv, lq, packed_bytes(d, kb)), dtype=torch.uint8, generator=g)
        vp = torch.randint(0, 256, (b, hkv, lq, packed_bytes(d, vb)), dtype=torch.uint8, generator=g)
        kn, vn = torch.rand(b, hkv, lq, generator=g).add(0.5).half(), torch.rand(b, hkv, lq, generator=g).add(0.5).half()
        rk, rv = torch.randn(b, hkv, lr, d, generator=g), torch.randn(b, hkv, lr, d, generator=g)
        sk, sv = torch.randn(b, hkv, sinks, d, generator=g), torch.randn(b, hkv, sinks, d, generator=g)
        kv = PackedKV(kp, kn, vp, vn, sk, sv, rk, rv, t, lq, make_rotation(d, 0), theoretical_codebook(kb, d),
                      theoretical_codebook(vb, d), sinks, -1, -1)
        q = torch.randn(b, hq, n, d, generator=g)
        want = da.decode_attention(q, kv, None, None, num_splits=3)
        got = tiles_attention(q, kv, None, None, num_splits=3, block_n=32)
        err = float((got - want).abs().max())
        print(f"k{kb}v{vb} n={n} t={t}: max |tiles - planes| = {err:.2e} (seed {seed})")
        assert err < 1e-3 * float(want.abs().max()) + 1e-5, f"tiles differ from planes (seed {seed})"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", type=int, default=0)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    if a.check:
        return check()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import bench_attention as ba
    from tq_hf_cache import TurboQuantConfig

    bw = ba.copy_bandwidth()
    res = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "copy_GBps": round(bw / 1e9, 1),
           "rows": [], "sweep": []}
    path = os.path.join(a.out, "decode_tiles_study.json")

    def timed(f):
        out = f()
        torch.cuda.synchronize()
        return triton.testing.do_bench_cudagraph(f), out

    sdpa = {}
    for preset, (b, t) in itertools.product(("k5v3", "k4v4", "k4v2"), ((1, 32768), (1, 131072), (8, 32768))):
        cfg = TurboQuantConfig.from_preset(preset)
        kv, nbytes = ba.packed_layer(b, t, cfg.key_bits, cfg.value_bits)
        q = torch.randn(b, ba.HQ, 1, ba.D, device="cuda", dtype=torch.bfloat16)
        if (b, t) not in sdpa:
            sdpa[(b, t)] = ba.sdpa_time(b, t)[0]
        planes_ms, want = timed(lambda: da.decode_attention(q, kv))
        tiles_ms, got = timed(lambda: tiles_attention(q, kv))
        row = {"preset": preset, "batch": b, "context": t, "planes_ms": round(planes_ms, 4),
               "tiles_ms": round(tiles_ms, 4), "sdpa_ms": round(sdpa[(b, t)], 4),
               "tiles_over_planes_time": round(tiles_ms / planes_ms, 2),
               "max_abs_diff": float((got.float() - want.float()).abs().max()),
               "max_abs_out": float(want.float().abs().max())}
        res["rows"].append(row)
        print(row, flush=True)
        for block_n, warps, per_sm in itertools.product((32, 64), (4, 8), (2, 4)):
            if preset != "k5v3" or (b, t) == (1, 32768):
                continue
            splits = num_splits_for(b * ba.HKV, t - ba.RESIDUAL, torch.device("cuda"), per_sm)
            ms, out = timed(lambda: tiles_attention(q, kv, num_splits=splits, block_n=block_n, num_warps=warps))
            r = {"preset": preset, "batch": b, "context": t, "block_n": block_n, "num_warps": warps,
                 "programs_per_sm": per_sm, "tiles_ms": round(ms, 4), "planes_ms": round(planes_ms, 4),
                 "max_abs_diff": float((out.float() - want.float()).abs().max())}
            res["sweep"].append(r)
            print(r, flush=True)
        json.dump(res, open(path, "w"), indent=1)
        del kv
        torch.cuda.empty_cache()
    print("wrote", path)


if __name__ == "__main__":
    main()
