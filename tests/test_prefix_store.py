"""PrefixStore: a restored prefix continues exactly as the cache that was inserted (logits bit for bit), pages are
shared between prompts, move to disk and back, leave under their budgets, and a damaged page file is refused."""

import copy
import glob
import os
import threading

import pytest
import torch

from tq_hf_cache import TurboQuantCache
from tq_hf_cache import prefix_store
from tq_hf_cache.prefix.store import PrefixStore
from tq_hf_cache.prefix.disk import Loc

from conftest import tiny_llama_and_config as model_and_config, token_ids as ids, with_cache


def prefill(model, cfg, x, **kw):
    cache = TurboQuantCache(config=cfg, **kw)
    model(x, **with_cache(cache))
    return cache


def steps(model, cache, x, start):
    return [model(x[:, i:i + 1], **with_cache(cache)).logits for i in range(start, x.shape[1])]


@torch.no_grad()
@pytest.mark.parametrize("kw", [dict(residual_length=8), dict(residual_length=8, skip_layers=[1]),
                                dict(residual_length=8, key_centering=True), dict(residual_length=0, sink_tokens=0),
                                dict(residual_length=8, key_bits=4, value_bits=2, codes="pair", norm_correction=True,
                                     key_centering=True)])
def test_a_matched_prefix_continues_exactly_as_the_inserted_cache(kw):
    model, cfg = model_and_config()
    store = PrefixStore(config=cfg, page_tokens=8, **kw)
    x = ids(60)
    cache = prefill(model, cfg, x[:, :45], **kw)
    assert store.insert(x[:, :45], cache) == (45 - kw["residual_length"]) // 8
    got, n = store.match(x)
    assert n == 45 and got.get_seq_length() == 45
    want = steps(model, copy.deepcopy(cache), x, 45)
    assert all(torch.equal(a, b) for a, b in zip(steps(model, got, x, 45), want))
    empty, none = store.match(ids(60, seed=9))
    assert none == 0 and empty.get_seq_length() == 0
    _, n = store.match(x[:, :45])  # generate must compute the prompt's last token: at most all but it
    assert n == 0


@torch.no_grad()
def test_stored_pages_are_copies_the_inserted_cache_can_go_on_from():
    """What the store holds is its own: the inserted cache decoding on (its window rewritten, tokens packed in place)
    or zeroed changes nothing a later match restores."""
    model, cfg = model_and_config()
    store = PrefixStore(config=cfg, page_tokens=8, residual_length=8)
    x = ids(70)
    cache = prefill(model, cfg, x[:, :45], residual_length=8)
    store.insert(x[:, :45], cache)
    want = steps(model, copy.deepcopy(cache), x, 45)
    steps(model, cache, x, 45)
    for layer in cache.layers:
        for t in vars(layer).values():
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                t.zero_()
    got, n = store.match(x[:, :60])
    assert n == 45
    assert all(torch.equal(a, b) for a, b in zip(steps(model, got, x, 45), want))


@torch.no_grad()
@pytest.mark.parametrize("centred", [False, True])
def test_batches_insert_each_row_and_match_where_every_row_has_an_endpoint(centred):
    """A batch cache stores each row on its own (pages shared where the rows' tokens agree, and with centred keys
    their key means too: each row's mean comes from its own first quantized block); a batch matches at the longest
    length every row has an endpoint at, and continues exactly as the batch cache that was inserted."""
    model, cfg = model_and_config()
    kw = dict(residual_length=8, key_centering=centred)
    store = PrefixStore(config=cfg, page_tokens=8, **kw)
    system = ids(24)
    x = torch.cat([torch.cat([system, ids(36, seed=s)], dim=1) for s in (1, 2)])  # (2, 60): one system prompt
    cache = prefill(model, cfg, x[:, :45], **kw)
    pages = (45 - 8) // 8
    shared = 0 if centred else 24 // 8  # the system prompt's pages, stored once where they are the same
    assert store.insert(x[:, :45], cache) == 2 * pages - shared
    got, n = store.match(x)
    assert n == 45 and got.get_seq_length() == 45 and got.layers[0].kv.batch == 2
    assert all(torch.equal(a, b) for a, b in zip(steps(model, got, x, 45), steps(model, copy.deepcopy(cache), x, 45)))
    one, n1 = store.match(x[1:])  # a row alone finds its own endpoint
    assert n1 == 45 and one.layers[0].kv.batch == 1
    other = torch.cat([x[:1], torch.cat([system, ids(36, seed=7)], dim=1)])  # row 1 has no endpoint: no match
    assert store.match(other)[1] == 0
    assert store.stats()["hits"] == 3


@torch.no_grad()
def test_a_batch_whose_rows_end_in_different_layouts_does_not_match_there():
    """Two endpoints of one length can hold their tokens differently (a prefill leaves residual_length exact, decode
    steps after it more): one batch cache cannot hold both, so the batch matches where every row has one layout,
    here nowhere, and nothing is counted as reused."""
    model, cfg = model_and_config()
    store = PrefixStore(config=cfg, page_tokens=8, residual_length=8)
    a, b = ids(60, seed=1), ids(60, seed=2)
    store.insert(a[:, :45], prefill(model, cfg, a[:, :45], residual_length=8))
    cache = prefill(model, cfg, b[:, :40], residual_length=8)
    steps(model, cache, b[:, :45], 40)  # five decode steps: the residual window holds 13 until it settles
    store.insert(b[:, :45], cache)
    assert store.match(a)[1] == 45 and store.match(b)[1] == 45
    got, n = store.match(torch.cat([a, b]))
    assert n == 0 and got.get_seq_length() == 0
    assert store.stats()["hits"] == 2 and store.stats()["tokens_reused"] == 90


@torch.no_grad()
def test_sliding_window_layers_restore_exactly_past_their_window():
    import transformers

    from conftest import tiny_gemma3_config

    torch.manual_seed(0)
    cfg = tiny_gemma3_config(num_hidden_layers=4, sliding_window=12, head_dim=16,
                             layer_types=["sliding_attention", "full_attention"] * 2)
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    store = PrefixStore(config=cfg, page_tokens=8, residual_length=4)
    x = ids(70)
    cache = prefill(model, cfg, x[:, :60], residual_length=4)
    assert store.insert(x[:, :60], cache) == (60 - 4) // 8  # the full-attention layers' pages
    got, n = store.match(x)
    assert n == 60
    assert all(torch.equal(a, b) for a, b in zip(steps(model, got, x, 60), steps(model, copy.deepcopy(cache), x, 60)))


@torch.no_grad()
def test_prompts_share_pages_and_each_matches_its_own_endpoint():
    model, cfg = model_and_config()
    store = PrefixStore(config=cfg, page_tokens=8, residual_length=8)
    system = ids(32)
    a = torch.cat([system, ids(20, seed=1)], dim=1)
    b = torch.cat([system, ids(17, seed=2)], dim=1)
    ca, cb = prefill(model, cfg, a, residual_length=8), prefill(model, cfg, b, residual_length=8)
    assert store.insert(a, ca) == 5  # (52 - 8) // 8 pages
    assert store.insert(b, cb) == 1  # its first 4 pages are the system prompt's, held already
    assert store.match(torch.cat([a, ids(3, seed=3)], dim=1))[1] == 52
    got, n = store.match(torch.cat([b, ids(3, seed=4)], dim=1))
    assert n == 49
    x = torch.cat([b, ids(3, seed=4)], dim=1)
    assert all(torch.equal(p, q) for p, q in zip(steps(model, got, x, 49), steps(model, copy.deepcopy(cb), x, 49)))
    assert store.match(torch.cat([system, ids(9, seed=5)], dim=1))[1] == 0  # no endpoint inside the system prompt
    stats = store.stats()
    assert stats["hits"] == 2 and stats["tokens_reused"] > 0


@torch.no_grad()
@pytest.mark.parametrize("staged", [None, "one half", "many halves"])
def test_pages_move_to_disk_come_back_exact_and_a_damaged_file_is_dropped(staged, tmp_path, monkeypatch):
    """Both ways disk pages are read: into private memory on threads (a CPU store), or whole through the store's two
    staging halves into one device buffer (a GPU store's way, here on the CPU): all files in one half, or halves of
    the largest file's size, filled in turns; the halves reused by the next restore. A damaged file is dropped with
    what hangs on it (one warning), the match restores what is still whole, and an insert stores it again."""
    if staged == "many halves":
        monkeypatch.setattr(prefix_store, "STAGING_BYTES", 1)
    staged = staged is not None
    model, cfg = model_and_config()
    store = PrefixStore(config=cfg, page_tokens=8, residual_length=8, cpu_bytes=4096, disk_dir=str(tmp_path),
                        disk_bytes=1 << 30)

    def use_staged(store):
        if staged:
            store._reader = prefix_store.StagedReader(store.disk, "cpu", prefix_store.STAGING_BYTES)

    use_staged(store)
    x = ids(70)
    cache = prefill(model, cfg, x[:, :64], residual_length=8)
    store.insert(x[:, :64], cache)
    assert store.stats()["pages"][1] > 0 and glob.glob(str(tmp_path / "*.pack"))
    got, n = store.match(x)
    assert n == 64
    if staged:  # a second restore through the same buffer, then the first one is checked below
        again, _ = store.match(x)
        assert all(torch.equal(a, b) for a, b in zip(steps(model, again, x, 64),
                                                     steps(model, copy.deepcopy(cache), x, 64)))
    # the restored cache owns its tensors (disk pages are read as views of their files, then copied out): files
    # overwritten in place after the match do not reach it
    kept = copy.deepcopy(got)
    packs = glob.glob(str(tmp_path / "*.pack"))
    for path in packs:
        with open(path, "r+b") as f:
            size = f.seek(0, 2)
            f.seek(0)
            f.write(bytes(size))
    assert all(torch.equal(a, b) for a, b in zip(steps(model, got, x, 64), steps(model, copy.deepcopy(cache), x, 64)))
    assert all(torch.equal(a, b) for a, b in zip(steps(model, kept, x, 64), steps(model, copy.deepcopy(cache), x, 64)))
    store.close()
    with pytest.warns(RuntimeWarning, match=f"removed {len(packs)} file"):  # the files zeroed above hold no pages
        store = PrefixStore(config=cfg, page_tokens=8, residual_length=8, cpu_bytes=4096, disk_dir=str(tmp_path),
                            disk_bytes=1 << 30)
    use_staged(store)
    store.insert(x[:, :64], cache)
    held = store.catalog.held
    key = max((k for k, h in held.items() if isinstance(h, Loc)), key=lambda k: held[k].offset)  # a pack's last
    path = store.disk.path(held[key].pack)
    raw = bytearray(open(path, "rb").read())
    raw[-1] ^= 1
    open(path, "wb").write(bytes(raw))
    with pytest.warns(RuntimeWarning, match="drops the page file"):
        got, n = store.match(x)
    assert n == 0 and store.stats()["damaged"] == 1 and key not in store.catalog.held
    store.insert(x[:, :64], cache)  # stored again
    got, n = store.match(x)
    assert n == 64
    assert all(torch.equal(a, b) for a, b in zip(steps(model, got, x, 64), steps(model, copy.deepcopy(cache), x, 64)))
    store.close()


@torch.no_grad()
def test_least_recently_used_prefixes_leave_under_the_budget():
    model, cfg = model_and_config()
    x, y = ids(50), ids(50, seed=1)
    cx, cy = prefill(model, cfg, x[:, :40], residual_length=8), prefill(model, cfg, y[:, :40], residual_length=8)
    one = PrefixStore(config=cfg, page_tokens=8, residual_length=8)
    one.insert(x[:, :40], cx)
    budget = sum(one.stats()["bytes"])  # exactly one prefix
    store = PrefixStore(config=cfg, page_tokens=8, residual_length=8, cpu_bytes=budget)
    store.insert(x[:, :40], cx)
    store.insert(y[:, :40], cy)
    assert store.match(x)[1] == 0 and store.match(y)[1] == 40
    assert sum(store.stats()["bytes"]) <= budget and store.stats()["dropped"] > 0


def test_bad_input_is_refused_before_anything_is_stored():
    model, cfg = model_and_config()
    store = PrefixStore(config=cfg, page_tokens=8, residual_length=8)
    cache = prefill(model, cfg, ids(20), residual_length=8)
    with pytest.raises(ValueError, match="holds 20 tokens, input_ids 19"):
        store.insert(ids(19), cache)
    from transformers import DynamicCache

    with pytest.raises(TypeError, match="takes TurboQuantCaches.*got DynamicCache"):
        store.insert(ids(20), DynamicCache(config=cfg))
    with pytest.raises(ValueError, match=r"\(n,\) or \(batch, n\)"):
        store.match(torch.zeros(2, 5, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="holds batch 1 but token_ids has batch 2"):
        store.insert(torch.cat([ids(20), ids(20, seed=1)]), cache)
    with pytest.raises(ValueError, match="gpu_bytes"):
        PrefixStore(config=cfg, gpu_bytes=1 << 20)
    assert store.stats()["pages"] == [0]
    assert PrefixStore(config=cfg, tq_config="k4v2").namespace != store.namespace


@torch.no_grad()
def test_concurrent_requests():
    model, cfg = model_and_config()
    store = PrefixStore(config=cfg, page_tokens=8, residual_length=8, cpu_bytes=1 << 16)
    prompts = [torch.cat([ids(16), ids(12 + i, seed=i + 1)], dim=1) for i in range(4)]
    caches = [prefill(model, cfg, p, residual_length=8) for p in prompts]
    errors = []

    def worker(w):
        try:
            for i in range(8):
                j = (w + i) % 4
                store.insert(prompts[j], caches[j])
                cache, n = store.match(torch.cat([prompts[j], ids(2, seed=99)], dim=1))
                assert n in (0, prompts[j].shape[1]) and cache.get_seq_length() == n
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@torch.no_grad()
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_gpu_tier_in_front_restores_exactly_on_the_gpu(tmp_path):
    model, cfg = model_and_config()
    model = model.cuda()
    store = PrefixStore(config=cfg, page_tokens=8, residual_length=8, device="cuda", gpu_bytes=16384,
                        cpu_bytes=32768, disk_dir=str(tmp_path), disk_bytes=1 << 30)
    x = ids(90).cuda()
    cache = TurboQuantCache(config=cfg, residual_length=8)
    model(x[:, :80], **with_cache(cache))
    store.insert(x[:, :80], cache)
    assert store.stats()["pages"][0] > 0 and store.stats()["pages"][1] + store.stats()["pages"][2] > 0
    got, n = store.match(x)
    assert n == 80 and got.layers[0].kv.k_buf.packed.device.type == "cuda"
    want = steps(model, copy.deepcopy(cache), x, 80)
    assert all(torch.equal(a, b) for a, b in zip(steps(model, got, x, 80), want))


@torch.no_grad()
@pytest.mark.parametrize("kw", [dict(residual_length=8), dict(residual_length=8, key_centering=True)])
def test_a_static_store_restores_static_caches_exactly(kw):
    """A store of max_cache_len holds TurboQuantStaticCaches: every position's codes are paged (a static layer has
    them all), the window, sinks, lengths and key mean go in the snapshot, and a matched cache (one row or a batch)
    continues bit for bit as the inserted one; the other kind of cache, or a model with a layer the static store
    cannot page, is refused by name."""
    from transformers import DynamicCache

    from tq_hf_cache import TurboQuantStaticCache

    model, cfg = model_and_config()
    store = PrefixStore(config=cfg, page_tokens=8, max_cache_len=80, **kw)
    x = torch.cat([ids(60, seed=1), ids(60, seed=2)])
    cache = TurboQuantStaticCache(cfg, max_cache_len=80, **kw)
    model(x[:, :20], **with_cache(cache))
    model(x[:, 20:45], **with_cache(cache))
    assert store.insert(x[:, :45], cache) == 2 * (45 // 8)
    got, n = store.match(x)
    assert isinstance(got, TurboQuantStaticCache) and n == 45 and int(got.get_seq_length()) == 45
    want = steps(model, copy.deepcopy(cache), x, 45)
    assert all(torch.equal(a, b) for a, b in zip(steps(model, got, x, 45), want))
    one, n1 = store.match(x[1:])
    assert n1 == 45  # row 1 alone: its codes as the batch held them (the forward's rounding differs by batch size)
    torch.testing.assert_close(steps(model, one, x[1:], 45)[-1], want[-1][1:], rtol=1e-4, atol=1e-4)
    with pytest.raises(TypeError, match="TurboQuantStaticCaches of max_cache_len=80.*TurboQuantCache"):
        store.insert(x[:, :45], prefill(model, cfg, x[:, :45], **kw))
    with pytest.raises(TypeError, match="of max_cache_len=80.*of 96"):
        store.insert(x[:, :5], TurboQuantStaticCache(cfg, max_cache_len=96, **kw))
    with pytest.raises(ValueError, match="every layer is a quantized full-attention layer"):
        PrefixStore(config=cfg, max_cache_len=80, skip_layers=[0], **kw)
    with pytest.raises(TypeError, match="takes TurboQuantCaches"):
        PrefixStore(config=cfg, **kw).insert(x[:, :45], DynamicCache(config=cfg))
