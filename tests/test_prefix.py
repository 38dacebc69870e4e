"""Reusable quantized prompt caches: save_prefix / load_prefix round trips exactly and refuses what does not fit."""

import copy
import errno
import hashlib
import json
import os
import shutil

import re

import pytest
import torch
import transformers
from transformers import LlamaForCausalLM

from conftest import tiny_llama_config, with_cache
from tq_hf_cache import TurboQuantCache
from tq_hf_cache.prefix.file import PREFIX_JSON, PREFIX_TENSORS


def ids(batch, length, seed=0):
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def llama(**kw):
    torch.manual_seed(0)
    cfg = tiny_llama_config(**kw)
    return cfg, LlamaForCausalLM(cfg).eval()


def gemma3():
    cfg = transformers.Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=12, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention"] * 2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    return cfg, transformers.Gemma3ForCausalLM(cfg).eval()


def reseal(folder, edit_doc=None, edit_tensors=None):
    """Edit a saved prefix and recompute its digests as the format says (`tensors_sha256`: SHA-256 of the SHA-256
    digests of the tensors file's 16 MiB blocks, one after the other; `index_sha256`: SHA-256 of the index without it, as sorted compact ASCII JSON), so that only the
    checks after the digests can refuse the edit. Deleting either digest field in `edit_doc` keeps it deleted."""
    from safetensors.torch import load_file, save_file

    folder = str(folder)
    if edit_tensors is not None:
        tensors = load_file(os.path.join(folder, PREFIX_TENSORS))
        edit_tensors(tensors)
        save_file(tensors, os.path.join(folder, PREFIX_TENSORS))
    with open(os.path.join(folder, PREFIX_JSON)) as f:
        doc = json.load(f)
    with open(os.path.join(folder, PREFIX_TENSORS), "rb") as f:
        data = f.read()
    blocks = [data[i: i + (1 << 24)] for i in range(0, len(data), 1 << 24)] or [data]
    doc["tensors_sha256"] = hashlib.sha256(b"".join(hashlib.sha256(b).digest() for b in blocks)).hexdigest()
    if edit_doc is not None:
        doc = edit_doc(doc) or doc  # an edit may return a replacement document
    if isinstance(doc, dict) and "index_sha256" in doc:
        body = json.dumps({k: v for k, v in doc.items() if k != "index_sha256"}, sort_keys=True,
                          separators=(",", ":"), ensure_ascii=True)
        doc["index_sha256"] = hashlib.sha256(body.encode("ascii")).hexdigest()
    with open(os.path.join(folder, PREFIX_JSON), "w") as f:
        json.dump(doc, f)


def saved(folder, seed=0, length=20, model_arg=False, **cache_kw):
    """(config, model, token ids) of a llama prefix of `length` tokens saved into `folder`."""
    cfg, model = llama(num_hidden_layers=3)
    x = ids(1, length, seed=seed)
    cache = TurboQuantCache(config=cfg, **{"residual_length": 4, "sink_tokens": 2, **cache_kw})
    with torch.no_grad():
        model(x, **with_cache(cache))
    cache.save_prefix(str(folder), x, **({"model": model} if model_arg else {}))
    return cfg, model, x


def steps(model, cache, x, start):
    return [model(x[:, i : i + 1], **with_cache(cache)).logits for i in range(start, x.shape[1])]


@torch.no_grad()
@pytest.mark.parametrize("build, cache_kw", [
    (llama, dict(residual_length=8)),
    (llama, dict(residual_length=8, skip_layers=[1])),  # a full-precision layer beside a quantized one
    (llama, dict(preset="k4v2", residual_length=0, sink_tokens=0)),
    (gemma3, dict(residual_length=4)),  # sliding-window layers past their window
    (llama, dict(residual_length=8, key_centering=True)),  # the key means travel with the codes
    (llama, dict(preset="k4v2", residual_length=8, split=((8, 24), (5, 3)), key_centering=True)),
    (gemma3, dict(preset="k4v2", residual_length=4, split=((4, 4, 8), (6, 4, 3)), key_centering=True)),
])
def test_a_loaded_prefix_continues_with_the_saved_caches_logits(tmp_path, build, cache_kw):
    cfg, model = build()
    kw = dict(cache_kw)
    preset = kw.pop("preset", None)
    if "split" in kw:  # split keys: a random channel order per KV head and layer
        (sizes, bits), g = kw.pop("split"), torch.Generator().manual_seed(3)
        kw["key_split"] = {i: {"bits": list(bits), "sizes": list(sizes),
                               "order": [torch.randperm(sum(sizes), generator=g).tolist()
                                         for _ in range(cfg.num_key_value_heads)]}
                           for i in range(cfg.num_hidden_layers)}
    x = ids(2, 50)
    cache = TurboQuantCache(preset, config=cfg, **kw)
    model(x[:, :40], **with_cache(cache))
    cache.save_prefix(str(tmp_path), x[:, :40])
    loaded = TurboQuantCache.load_prefix(str(tmp_path), cfg, token_ids=x)
    assert loaded.get_seq_length() == 40
    want = steps(model, cache, x, 40)
    got = steps(model, loaded, x, 40)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@torch.no_grad()
def test_generate_from_a_loaded_prefix_and_from_a_deepcopy(tmp_path):
    cfg, model = llama()
    prefix = ids(1, 30)
    cache = TurboQuantCache(config=cfg, residual_length=8)
    model(prefix, **with_cache(cache))
    cache.save_prefix(str(tmp_path), prefix)
    prompt = torch.cat([prefix, ids(1, 5, seed=1)], dim=1)
    kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=10, do_sample=False, pad_token_id=0)
    from_copy = model.generate(prompt, **with_cache(copy.deepcopy(cache)), **kw)
    from_disk = model.generate(prompt, **with_cache(TurboQuantCache.load_prefix(str(tmp_path), cfg)), **kw)
    again = model.generate(prompt, **with_cache(copy.deepcopy(cache)), **kw)
    assert torch.equal(from_copy, from_disk) and torch.equal(from_copy, again)


@torch.no_grad()
def test_mismatches_are_refused(tmp_path):
    cfg, model = llama()
    x = ids(1, 30)
    cache = TurboQuantCache(config=cfg, residual_length=4)
    model(x[:, :20], **with_cache(cache))
    with pytest.raises(ValueError, match="holds 20 tokens but token_ids has 30"):
        cache.save_prefix(str(tmp_path), x)
    cache.save_prefix(str(tmp_path), x[:, :20])
    with pytest.raises(ValueError, match="num_key_value_heads=2, but this model has num_key_value_heads=4"):
        TurboQuantCache.load_prefix(str(tmp_path), tiny_llama_config(num_key_value_heads=4))
    other = x.clone()
    other[0, 5] += 1
    with pytest.raises(ValueError, match="other tokens than the first 20"):
        TurboQuantCache.load_prefix(str(tmp_path), cfg, token_ids=other)
    with pytest.raises(ValueError, match="other tokens"):
        TurboQuantCache.load_prefix(str(tmp_path), cfg, token_ids=x[:, :10])  # shorter than the prefix
    # codes decode only with the rotation and codebooks they were made with
    reseal(tmp_path, lambda doc: doc["tq_config"].update(seed=5))
    with pytest.raises(ValueError, match="another rotation or other codebooks"):
        TurboQuantCache.load_prefix(str(tmp_path), cfg)


def test_prefix_files_are_plain_safetensors_and_json(tmp_path):
    cfg, model = llama()
    x = ids(1, 20)
    cache = TurboQuantCache(config=cfg, residual_length=4)
    with torch.no_grad():
        model(x, **with_cache(cache))
    cache.save_prefix(str(tmp_path), x)
    assert sorted(os.listdir(tmp_path)) == sorted([PREFIX_JSON, PREFIX_TENSORS])
    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / PREFIX_TENSORS))  # no pickle anywhere
    assert tensors["layers.0.k_packed"].dtype == torch.uint8
    blob = (tmp_path / PREFIX_TENSORS).read_bytes()
    (tmp_path / PREFIX_TENSORS).write_bytes(blob[: len(blob) // 2])
    with pytest.raises(ValueError):
        TurboQuantCache.load_prefix(str(tmp_path), cfg)
    with pytest.raises(FileNotFoundError, match="no turboquant_prefix.json"):
        TurboQuantCache.load_prefix(str(tmp_path / "nothing"), cfg)


def test_save_prefix_needs_the_model_config(tmp_path):
    cache = TurboQuantCache()
    cache.update(torch.randn(1, 2, 5, 32), torch.randn(1, 2, 5, 32), 0)
    with pytest.raises(ValueError, match="config=model.config"):
        cache.save_prefix(str(tmp_path), torch.arange(5))


def test_recurrent_states_are_refused_by_name(tmp_path):
    from tq_hf_cache._compat import IS_V5

    if not IS_V5:
        pytest.skip("linear-attention cache layers exist in transformers 5.x only")
    from transformers.cache_utils import LinearAttentionLayer

    cfg, _ = llama()
    cache = TurboQuantCache(config=cfg)
    cache.layers[1] = LinearAttentionLayer()
    with pytest.raises(ValueError, match="layer 1 is a LinearAttentionLayer"):
        cache.save_prefix(str(tmp_path), torch.zeros(1, 0, dtype=torch.long))


def test_hybrid_layers_are_refused_by_name(tmp_path):
    from tq_hf_cache._compat import IS_V5

    if not IS_V5 or not hasattr(transformers, "FalconH1Config"):
        pytest.skip("hybrid cache layers exist in transformers 5.x only")
    cfg = transformers.FalconH1Config(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=1,
        mamba_d_state=8, mamba_chunk_size=16,
    )
    cache = TurboQuantCache(config=cfg)
    with pytest.raises(ValueError, match="layer 0 is a TurboQuantLinearHybridLayer"):
        cache.save_prefix(str(tmp_path), torch.zeros(1, 0, dtype=torch.long))


# ---- the files are bound together (finding 1) --------------------------------------------------------------------


def _fail_index_replace(monkeypatch):
    """os.replace fails with ENOSPC when it would put the index in place: the tensors file is already written."""
    real = os.replace

    def replace(src, dst, *a, **kw):
        if str(dst).endswith(PREFIX_JSON):
            raise OSError(errno.ENOSPC, "No space left on device (test)")
        return real(src, dst, *a, **kw)

    monkeypatch.setattr(os, "replace", replace)


def test_a_torn_save_into_an_existing_folder_is_refused_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    cfg, _, a = saved(tmp_path)
    _, model, b = llama(num_hidden_layers=3)[0], llama(num_hidden_layers=3)[1], ids(1, 20, seed=1)
    cache = TurboQuantCache(config=cfg, residual_length=4, sink_tokens=2)
    with torch.no_grad():
        model(b, **with_cache(cache))
    _fail_index_replace(monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        cache.save_prefix(str(tmp_path), b)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == sorted([PREFIX_JSON, PREFIX_TENSORS])
    with pytest.raises(ValueError, match=f"{PREFIX_TENSORS}: its SHA-256 differs from field tensors_sha256"):
        TurboQuantCache.load_prefix(str(tmp_path), cfg, token_ids=a)


def test_a_failed_save_into_a_new_folder_leaves_nothing(tmp_path, monkeypatch):
    _fail_index_replace(monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        saved(tmp_path / "prefix")
    assert os.listdir(tmp_path) == []


def test_a_tensors_file_from_another_prefix_of_the_same_length_is_refused(tmp_path):
    cfg, _, a = saved(tmp_path / "a", seed=0)
    saved(tmp_path / "b", seed=1)
    shutil.copy(tmp_path / "b" / PREFIX_TENSORS, tmp_path / "a" / PREFIX_TENSORS)
    with pytest.raises(ValueError, match=f"{PREFIX_TENSORS}: its SHA-256 differs"):
        TurboQuantCache.load_prefix(str(tmp_path / "a"), cfg, token_ids=a)


def test_an_edited_index_is_refused(tmp_path):
    cfg, _, _ = saved(tmp_path)
    doc = json.loads((tmp_path / PREFIX_JSON).read_text())
    doc["tq_config"]["residual_length"] = 5  # no tensor shows it: only the index's own digest does
    (tmp_path / PREFIX_JSON).write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="field index_sha256 does not match"):
        TurboQuantCache.load_prefix(str(tmp_path), cfg)


def test_a_version_1_prefix_is_refused_with_a_hint_to_re_save_it(tmp_path):
    cfg, _, _ = saved(tmp_path)
    reseal(tmp_path, lambda doc: doc.update(format_version=1))
    with pytest.raises(ValueError, match="format_version is 1.*re-save the prefix"):
        TurboQuantCache.load_prefix(str(tmp_path), cfg)


@torch.no_grad()
def test_a_version_2_prefix_loads_as_the_same_cache(tmp_path):
    """Version 2 named the exact window res_k / res_v and its length "residual": such a file loads, converted."""
    cfg, model, x = saved(tmp_path, length=20, key_centering=True)
    want = TurboQuantCache.load_prefix(str(tmp_path), cfg, token_ids=x)

    def to_v2_tensors(t):
        for name in [n for n in t if n.endswith((".window_k", ".window_v"))]:
            t[name.replace(".window_", ".res_")] = t.pop(name)

    def to_v2_doc(doc):
        doc["format_version"] = 2
        for info in doc["layers"]:
            if "window" in info:
                info["residual"] = info.pop("window")

    reseal(tmp_path, to_v2_doc, to_v2_tensors)
    assert json.loads((tmp_path / PREFIX_JSON).read_text())["format_version"] == 2
    got = TurboQuantCache.load_prefix(str(tmp_path), cfg, token_ids=x)
    for a, b in zip(want.layers, got.layers):
        sa, sb = a.kv.state(), b.kv.state()
        assert sa.keys() == sb.keys() and a.kv.lengths() == b.kv.lengths()
        for name in sa:
            torch.testing.assert_close(sb[name], sa[name], rtol=0, atol=0, msg=name)
    nxt = x[:, -1:]
    torch.testing.assert_close(model(nxt, **with_cache(got)).logits, model(nxt, **with_cache(want)).logits,
                               rtol=0, atol=0)


# ---- every stored tensor against the index (finding 6) -----------------------------------------------------------


def _shorter(name, by):
    return lambda t: t.update({name: t[name][:, :, : t[name].shape[2] - by].contiguous()})


def _claim_length(n):
    def edit(doc):
        doc["num_tokens"] = n
        for info in doc["layers"]:
            info["cumulative_length"] = n
    return edit


@pytest.mark.parametrize("edit_tensors, edit_doc, named", [
    (_shorter("layers.1.keys", 3), None, "layers.1.keys"),  # a full-precision layer 3 tokens short
    (lambda t: t.update({"layers.1.values": t["layers.1.values"].repeat(1, 2, 1, 1)}), None, "layers.1.values"),
    (lambda t: t.update({"layers.1.keys": t["layers.1.keys"].half()}), None, "layers.1.keys"),
    (lambda t: t.update({"layers.0.k_norms": t["layers.0.k_norms"].float()}), None, "layers.0.k_norms"),
    (lambda t: t.update({"layers.2.v_packed": t["layers.2.v_packed"].view(torch.int8)}), None, "layers.2.v_packed"),
    (_shorter("layers.0.sink_k", 1), None, "layers.0.sink_k"),
    (_shorter("layers.2.window_v", 1), None, "layers.2.window_v"),
    (lambda t: t.update({"layers.0.key_mean": t["layers.0.key_mean"].half()}), None, "layers.0.key_mean"),
    (lambda t: t.pop("layers.2.k_norms"), None, "layers.2.k_norms"),
    (lambda t: t.update({"layers.9.keys": torch.zeros(1)}), None, "layers.9.keys"),
    # a claimed length above what is stored would shift every later position
    (None, _claim_length(23), "layers[0] stores 20 tokens (quantized + window) but cumulative_length is 23"),
    (None, lambda d: d["layers"][1].update(length=17), "layers[1] stores 17 tokens (length)"),
])
def test_every_stored_tensor_is_checked_against_the_index(tmp_path, edit_tensors, edit_doc, named):
    cfg, _, _ = saved(tmp_path, skip_layers=[1], key_centering=True)
    reseal(tmp_path, edit_doc, edit_tensors)
    with pytest.raises(ValueError, match=re.escape(named)):
        TurboQuantCache.load_prefix(str(tmp_path), cfg)


# ---- bound to the weights (finding 11) ---------------------------------------------------------------------------


def test_a_prefix_saved_with_model_is_bound_to_its_weights(tmp_path):
    cfg, model, x = saved(tmp_path, model_arg=True)
    torch.manual_seed(1)
    other = LlamaForCausalLM(cfg).eval()  # another checkpoint of the same shape
    with pytest.raises(ValueError, match="field weights.sha256 differs from this model's weights"):
        TurboQuantCache.load_prefix(str(tmp_path), cfg, token_ids=x, model=other)
    with pytest.raises(ValueError, match="pass model= to load_prefix"):
        TurboQuantCache.load_prefix(str(tmp_path), cfg, token_ids=x)
    loaded = TurboQuantCache.load_prefix(str(tmp_path), cfg, token_ids=x, model=model)
    assert loaded.get_seq_length() == x.shape[1]


def test_a_prefix_saved_without_model_cannot_be_checked_against_weights(tmp_path):
    cfg, model, x = saved(tmp_path)
    with pytest.raises(ValueError, match="saved without model="):
        TurboQuantCache.load_prefix(str(tmp_path), cfg, model=model)
    assert TurboQuantCache.load_prefix(str(tmp_path), cfg).get_seq_length() == x.shape[1]


def test_save_prefix_refuses_a_model_of_other_facts(tmp_path):
    cfg, model = llama(num_hidden_layers=3)
    cache = TurboQuantCache(config=tiny_llama_config(), residual_length=4)
    with pytest.raises(ValueError, match="model= is a"):
        cache.save_prefix(str(tmp_path), torch.zeros(1, 0, dtype=torch.long), model=model)


def test_a_null_model_type_does_not_match_a_known_one(tmp_path):
    cfg, _, _ = saved(tmp_path)
    reseal(tmp_path, lambda doc: doc["model"].update(model_type=None))
    with pytest.raises(ValueError, match="model.model_type=None, but this model has model_type='llama'"):
        TurboQuantCache.load_prefix(str(tmp_path), cfg)


# ---- the index's schema (finding 13) -----------------------------------------------------------------------------


def _set(*path_value):
    *path, value = path_value

    def edit(doc):
        for k in path[:-1]:
            doc = doc[k]
        doc[path[-1]] = value
    return edit


def _delete(*path):
    def edit(doc):
        for k in path[:-1]:
            doc = doc[k]
        del doc[path[-1]]
    return edit


@pytest.mark.parametrize("edit, field", [
    (_delete("tensors_sha256"), "field tensors_sha256 is missing"),
    (_delete("layers", 0, "digest"), "field layers[0].digest is missing"),
    (_set("num_tokens", "40"), "field num_tokens must be an integer in [0, 2**40], got '40'"),
    (_set("model", [1]), "field model must be an object, got [1]"),
    (_set("layers", 0, "turboquant"), "field layers[0] must be an object, got 'turboquant'"),
    (_set("layers", 0, "dtype", "float8"), "field layers[0].dtype must be one of"),
    (_set("layers", 0, "norm_dtype", "bfloat16"), "field layers[0].norm_dtype must be one of"),
    (_set("layers", 2, "quantized", -1), "field layers[2].quantized must be an integer in [0, 2**40], got -1"),
    (_set("layers", 0, "key_bits", 9), "field layers[0].key_bits must be an integer in [1, 8], got 9"),
    (_set("batch", 10**30), "field batch must be an integer in [1, 2**40]"),
    (_set("model", "head_dim", True), "field model.head_dim must be an integer in [1, 2**40], got True"),
    (_set("weights", "abc"), "field weights must be null or an object, got 'abc'"),
    (_set("tq_config", "residual_length", "4"), "field tq_config is invalid: residual_length must be an integer"),
    (_set("layers", {}), "field layers must be a list, got {}"),
    (_set("layers", 1, "initialized", None), "field layers[1].initialized must be true or false, got None"),
    (_set("token_ids_sha256", "xyz"), "field token_ids_sha256 must be a SHA-256 digest"),
    (_set("layers", 0, "heads2", 2), "field layers[0].heads2 is not part of prefix format version 3"),
    (lambda doc: [doc], "must hold a JSON object, got list"),
])
def test_a_malformed_index_is_refused_naming_the_file_and_the_field(tmp_path, edit, field):
    cfg, _, _ = saved(tmp_path)
    reseal(tmp_path, edit)
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / PREFIX_JSON))) as e:
        TurboQuantCache.load_prefix(str(tmp_path), cfg)
    assert field in str(e.value)


# ---- temporary names and modes (finding 10) ----------------------------------------------------------------------


OLD_AND_LIKELY_TEMP_NAMES = [f"{p}{name}{s}" for name in (PREFIX_JSON, PREFIX_TENSORS) for p in ("", ".")
                             for s in (".tmp", ".tmp.tmp", ".partial")]


def test_temporary_names_are_fresh_and_never_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    folder = tmp_path / "prefix"
    folder.mkdir()
    planted = [folder / n for n in OLD_AND_LIKELY_TEMP_NAMES] + [tmp_path / n for n in (".prefix.tmp", "prefix.tmp")]
    for link in planted:
        link.symlink_to(victim)
    cfg, _, x = saved(folder)
    saved(tmp_path / "fresh")  # a new folder is built under a temporary name beside it
    assert victim.read_text() == "untouched"
    assert all(link.is_symlink() and os.readlink(link) == str(victim) for link in planted)
    assert not (folder / PREFIX_JSON).is_symlink() and not (folder / PREFIX_TENSORS).is_symlink()
    assert TurboQuantCache.load_prefix(str(folder), cfg, token_ids=x).get_seq_length() == x.shape[1]


@pytest.mark.parametrize("umask, file_mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_prefix_files_follow_the_umask(tmp_path, umask, file_mode):
    old = os.umask(umask)
    try:
        saved(tmp_path / "new")
        saved(tmp_path / "new")  # again, into the existing folder
    finally:
        os.umask(old)
    assert oct(os.stat(tmp_path / "new").st_mode & 0o777) == oct(0o777 & ~umask)
    for name in (PREFIX_JSON, PREFIX_TENSORS):
        assert oct(os.stat(tmp_path / "new" / name).st_mode & 0o777) == oct(file_mode)


def test_a_huge_key_split_size_in_the_index_is_refused_without_building_it(tmp_path):
    """Found by the fuzz suite: a size of 10**30 made the spec check build range(10**30) (OverflowError; 10**9
    would have taken gigabytes)."""
    cfg, _, _ = saved(tmp_path)
    reseal(tmp_path, lambda doc: doc["tq_config"].update(key_split={"0": {"bits": [4, 2], "sizes": [10**30, 2],
                                                                         "order": [[0, 1], [1, 0]]}}))
    with pytest.raises(ValueError, match=r"field tq_config is invalid: key_split\[0\]"):
        TurboQuantCache.load_prefix(str(tmp_path), cfg)


def test_quantizer_digest_remembered_per_rotation_and_codebooks_is_the_computed_one():
    """The digest is remembered per rotation object and codebook fingerprints (no read of GPU tensors per restored
    layer); what it returns is the digest of the tensors, and another codebook or rotation gives another."""
    from tq_hf_cache.quant.codebook import theoretical_codebook
    from tq_hf_cache.prefix.file import _quantizer_digest, quantizer_digest
    from tq_hf_cache.quant.rotation import make_rotation

    rot, other_rot = make_rotation(32, 3), make_rotation(32, 4)
    k3, v2 = theoretical_codebook(3, 32), theoretical_codebook(2, 32)
    first = quantizer_digest(rot, k3, v2)
    assert first == quantizer_digest(rot, k3, v2) == _quantizer_digest(rot, k3, v2)
    assert quantizer_digest(rot, v2, k3) != first
    assert quantizer_digest(other_rot, k3, v2) == _quantizer_digest(other_rot, k3, v2) != first
