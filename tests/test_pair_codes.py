"""Pair codes (`pair_codebook`) and norm correction: the fitted codebooks, the torch reference, the config and preset,
the kernel selection, and both caches through `generate`, prefix files included."""

import json

import pytest
import torch

from conftest import chunked_logits, tiny_llama_and_config, token_ids, with_cache
from tq_hf_cache import TurboQuantCache, TurboQuantConfig, TurboQuantStaticCache, reference
from tq_hf_cache.config import PRESET_OPTIONS, PRESETS
from tq_hf_cache.kernels import select
from tq_hf_cache.quant.codebook import NORM_GAIN, Codebook, expected_mse, theoretical_codebook
from tq_hf_cache.quant.packing import unpack_indices
from tq_hf_cache.quant.pair_codebook import _fit, expected_pair_mse, nearest, theoretical_pair_codebook
from tq_hf_cache.quant.rotation import make_rotation


def fresh_seed() -> int:
    return torch.seed() % 2**31


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("dim", [32, 64, 128])
def test_a_pair_codebook_beats_two_scalar_ones_at_the_same_bits(bits, dim):
    pair = theoretical_pair_codebook(bits, dim)
    assert pair.pair and tuple(pair.centroids.shape) == (4**bits, 2) and pair.boundaries.numel() == 0
    assert expected_pair_mse(pair, dim) < expected_mse(theoretical_codebook(bits, dim), dim) * (1.005 if bits == 1
                                                                                                else 0.99)


def test_the_fit_is_the_same_on_every_call():
    first = _fit(3, 48).clone()
    _fit.cache_clear()
    assert torch.equal(_fit(3, 48), first)


def test_pair_codebooks_refuse_bad_bits_and_dims():
    with pytest.raises(ValueError, match=r"\[1, 4\]"):
        theoretical_pair_codebook(5, 64)
    with pytest.raises(ValueError, match="even head dim"):
        theoretical_pair_codebook(2, 63)
    with pytest.raises(ValueError, match=r"\(\.\.\., 16, 2\)"):
        Codebook.from_points(torch.zeros(15, 2), 2)
    with pytest.raises(ValueError, match="NaN or inf"):
        Codebook.from_points(torch.full((16, 2), float("nan")), 2)


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("bits,dim", [(1, 64), (2, 40), (3, 24), (4, 64), (4, 70)])
def test_pair_codes_are_each_pairs_nearest_point_and_decode_by_table_or_lookup(bits, dim, per_head):
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    heads = 3
    cb = theoretical_pair_codebook(bits, dim)
    if per_head:
        cb = Codebook.from_points(cb.centroids * (1 + 0.3 * torch.rand(heads, 1, 1, generator=g)), bits)
    rot = make_rotation(dim, seed % 1000, "auto")
    x = torch.randn(2, heads, 9, dim, generator=g) * torch.rand(2, heads, 9, 1, generator=g) * 5
    packed, norms = reference.quantize(x, rot, cb, torch.float32)
    idx = unpack_indices(packed, bits, dim)
    y = rot.forward(x / x.norm(dim=-1, keepdim=True)).reshape(2, heads, 9, dim // 2, 2)
    pts = cb.centroids if per_head else cb.centroids.expand(heads, -1, -1)
    for h in range(heads):
        want = nearest(y[:, h].reshape(-1, 2), pts[h])
        got = (idx[:, h, :, 0::2] | (idx[:, h, :, 1::2] << bits)).reshape(-1)
        assert torch.equal(got, want), f"seed {seed}: head {h}'s codes are not the nearest points"
    decoded = reference.centroid_lookup(idx, cb)
    if dim % 8 == 0:
        torch.testing.assert_close(reference.centroids(packed, cb, dim), decoded, rtol=0, atol=0,
                                   msg=lambda m: f"seed {seed}: table vs lookup: {m}")
    torch.testing.assert_close(norms, x.norm(dim=-1), msg=lambda m: f"seed {seed}: norms {m}")


@pytest.mark.parametrize("codes", ["scalar", "pair"])
def test_norm_correction_keeps_each_decoded_vectors_length(codes):
    seed = fresh_seed()
    d = 64
    x = torch.randn(1, 2, 50, d, generator=torch.Generator().manual_seed(seed)) * 30
    rot = make_rotation(d, 3, "auto")
    cb = theoretical_pair_codebook(2, d) if codes == "pair" else theoretical_codebook(2, d)
    plain = reference.dequantize(*reference.quantize(x, rot, cb, torch.float32), rot, cb)
    nc = cb.with_norm_correction()
    assert nc.fingerprint != cb.fingerprint and nc.derived is cb.derived and nc.with_norm_correction(False).fingerprint \
        == cb.fingerprint
    fixed = reference.dequantize(*reference.quantize(x, rot, nc, torch.float32), rot, nc)
    torch.testing.assert_close(fixed.norm(dim=-1), x.norm(dim=-1), msg=lambda m: f"seed {seed}: {m}")
    assert plain.norm(dim=-1).mean() < 0.97 * x.norm(dim=-1).mean()  # plain 2-bit codes shrink vectors ~5 %
    assert torch.allclose(fixed / fixed.norm(dim=-1, keepdim=True), plain / plain.norm(dim=-1, keepdim=True), atol=1e-5)


def test_the_norm_gain_is_capped():
    decoded = torch.tensor([[1.0, 0.0], [0.1, 0.0], [0.0, 0.0]])
    torch.testing.assert_close(reference.norm_gain(decoded), torch.tensor([1.0, NORM_GAIN, NORM_GAIN]))


def test_the_preset_config_and_its_file():
    cfg = TurboQuantConfig.from_preset("k4v2-pairs")
    assert PRESETS["k4v2-pairs"] == (4, 2) and cfg.codes == "pair" and cfg.norm_correction and cfg.key_centering
    assert cfg.preset == "k4v2-pairs" and TurboQuantConfig.from_preset("k4v2").preset == "k4v2"
    assert TurboQuantConfig(key_bits=4, value_bits=2, codes="pair").preset is None
    assert cfg.bits_per_coordinate == 3.0 == TurboQuantConfig.from_preset("k4v2").bits_per_coordinate
    # Llama-3.1-8B's layer at 32k: codes 8 heads x (64 + 32 bytes) + 4 norms, the 132 exact tokens spread over 32k
    want = (132 * 4096 + (32768 - 132) * 8 * (64 + 32 + 4)) / 32768
    assert cfg.bytes_per_token(8, 128, 32768) == pytest.approx(want)
    assert TurboQuantConfig.from_json_string(cfg.to_json_string()) == cfg
    assert set(PRESET_OPTIONS) <= set(PRESETS)


def test_a_version_2_config_file_reads_as_scalar_codes(tmp_path):
    cfg = TurboQuantConfig.from_preset("k4v2")
    cfg.save_pretrained(tmp_path)
    path = tmp_path / "turboquant_config.json"
    doc = json.loads(path.read_text())
    assert doc["tq_config"]["tq_hf_cache_config_version"] == 3 and doc["tq_config"]["codes"] == "scalar"
    for name in ("codes", "norm_correction"):
        del doc["tq_config"][name]
    doc["tq_config"]["tq_hf_cache_config_version"] = 2
    from tq_hf_cache.config import DOC_DIGEST, doc_digest

    doc[DOC_DIGEST] = doc_digest(doc)
    path.write_text(json.dumps(doc))
    back = TurboQuantConfig.from_pretrained(tmp_path)
    assert back == cfg and back.codes == "scalar" and back.norm_correction is False
    doc["tq_config"]["tq_hf_cache_config_version"] = 3  # a version 3 file lacking them was cut or edited
    doc[DOC_DIGEST] = doc_digest(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"lacks the fields \['codes', 'norm_correction'\]"):
        TurboQuantConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("bad,match", [
    ({"codes": "quad"}, r"codes must be one of \('scalar', 'pair'\), got 'quad'"),
    ({"codes": "pair", "key_bits": 5}, r"key_bits \(codes='pair'\) must be an integer in \[1, 4\]"),
    ({"codes": "pair", "layer_bits": {0: [4, 6]}}, r"layer_bits\[0\] value bits \(codes='pair'\)"),
    ({"norm_correction": 1}, "norm_correction must be True or False"),
    ({"codes": "pair", "key_split": {0: {"bits": [4, 2], "sizes": [16, 16], "order": [list(range(32))]}}},
     "codes='pair' splits no keys"),
])
def test_bad_pair_settings_are_refused_by_name(bad, match):
    with pytest.raises(ValueError, match=match):
        TurboQuantConfig(**{"key_bits": 4, "value_bits": 2, **bad})


def test_calibrated_codebooks_are_refused_with_pair_codes():
    _, cfg = tiny_llama_and_config()
    with pytest.raises(ValueError, match="calibrated codebooks are scalar codebooks"):
        TurboQuantCache("k4v2-pairs", config=cfg, codebooks=object())


def test_the_selection_sends_pair_codes_past_the_c_kernels_and_their_quantize_to_the_reference():
    d = 64
    rot = make_rotation(d, 0, "auto")
    pair, scalar = theoretical_pair_codebook(4, d), theoretical_codebook(4, d)
    c = select.kernel("cpu", d, 4, 2, 3, 1, pair=True)
    assert c.kernel == "torch", c
    assert select.kernel("cpu", d, 4, 2, 3, 1).kernel in ("cpu", "torch")
    x = torch.zeros(1, 1, 1, d)
    if torch.cuda.is_available():
        x = x.cuda()
        assert select.quantize_kernel(x, rot, scalar)
        assert not select.quantize_kernel(x, rot, pair) and not select.quantize_kernel(x, rot, pair, quantize=False)
        assert not select.quantize_kernel(x, rot, scalar.with_norm_correction())
        assert select.quantize_kernel(x, rot, scalar.with_norm_correction(), quantize=False)
    else:
        assert not select.quantize_kernel(x, rot, pair)


def _model():
    model, cfg = tiny_llama_and_config()
    return model, cfg


@pytest.mark.parametrize("kernel", ["auto", "torch"])
def test_both_caches_generate_with_pair_codes_and_agree_with_the_workspace_path(kernel, monkeypatch):
    monkeypatch.setenv(select.ENV, kernel)
    model, cfg = _model()
    ids = token_ids(150, seed=3)
    for make in (lambda: TurboQuantCache("k4v2-pairs", config=cfg, residual_length=16),
                 lambda: TurboQuantStaticCache(config=cfg, tq_config="k4v2-pairs", max_cache_len=190,
                                               residual_length=16)):
        model.set_attn_implementation("sdpa")
        dense = chunked_logits(model, make(), ids, 120, chunk=40, step=1)
        from tq_hf_cache import attention  # noqa: F401  (registers "turboquant")

        model.set_attn_implementation("turboquant")
        fused = chunked_logits(model, make(), ids, 120, chunk=40, step=1)
        torch.testing.assert_close(fused, dense, atol=1e-4, rtol=1e-4, msg=lambda m: f"fused vs workspace: {m}")
    model.set_attn_implementation("sdpa")
    out = model.generate(ids[:, :60], **with_cache(TurboQuantCache("k4v2-pairs", config=cfg, residual_length=8)),
                         max_new_tokens=6, do_sample=False)
    assert out.shape == (1, 66)


def test_pair_codes_hold_keys_closer_than_scalar_codes_at_the_same_bytes():
    model, cfg = _model()
    ids = token_ids(300, seed=5)
    from transformers import DynamicCache

    fp = DynamicCache(config=cfg)
    with torch.no_grad():
        model(ids, **with_cache(fp))
    err = {}
    for preset, opts in (("k4v2", {}), ("k4v2", {"codes": "pair", "norm_correction": True})):
        cache = TurboQuantCache(preset, config=cfg, residual_length=16, **opts)
        with torch.no_grad():
            model(ids, **with_cache(cache))
        k, v = cache.layers[1].keys, cache.layers[1].values
        err[bool(opts)] = [float((a - b).norm() / b.norm()) for a, b in ((k, fp.layers[1].keys),
                                                                         (v, fp.layers[1].values))]
    assert err[True][0] < err[False][0] and err[True][1] < err[False][1], err
    scalar = TurboQuantCache("k4v2", config=cfg, residual_length=16)
    with torch.no_grad():
        model(ids, **with_cache(scalar))
    assert cache.nbytes()["packed"] == scalar.nbytes()["packed"] > 0


def test_a_prefix_file_of_pair_codes_restores_the_same_cache(tmp_path):
    model, cfg = _model()
    ids = token_ids(121, seed=7)
    cache = TurboQuantCache("k4v2-pairs", config=cfg, residual_length=16)
    with torch.no_grad():
        model(ids[:, :120], **with_cache(cache))
    path = str(tmp_path / "p")
    cache.save_prefix(path, ids[:, :120])
    back = TurboQuantCache.load_prefix(path, cfg)
    assert back.tq_config == cache.tq_config
    with torch.no_grad():
        a = model(ids[:, 120:], **with_cache(cache)).logits
        b = model(ids[:, 120:], **with_cache(back)).logits
    torch.testing.assert_close(b, a, rtol=0, atol=0)
