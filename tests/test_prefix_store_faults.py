"""PrefixStore as a server leans on it: foreign caches refused, the contract on shared pages in every insert order,
norm dtypes never mixed, damaged / missing files dropped, failed writes rolled back, the folder taken by one store,
adopted by the next and kept within its budget, lookups never waiting on an insert's disk writes, O(log n) eviction,
and bad arguments refused before anything is made."""

import copy
import errno
import glob
import os
import subprocess
import sys
import threading

import pytest
import torch

from tq_hf_cache import TurboQuantCache
from tq_hf_cache.quant.codebook import Codebook, theoretical_codebook
from tq_hf_cache import prefix_disk
from tq_hf_cache.prefix.disk import Loc
from tq_hf_cache.prefix.index import PrefixIndex, page_keys
from tq_hf_cache.prefix.store import PrefixStore

from conftest import tiny_llama_and_config as model_and_config, token_ids as ids, with_cache

KW = dict(residual_length=8)


def prefill(model, cfg, x, chunks=None, **kw):
    cache = TurboQuantCache(config=cfg, **{**KW, **kw})
    at = 0
    for c in chunks or [x.shape[1]]:
        model(x[:, at: at + c], **with_cache(cache))
        at += c
    return cache


def steps(model, cache, x, start):
    return [model(x[:, i:i + 1], **with_cache(cache)).logits for i in range(start, x.shape[1])]


def same(a, b):
    return all(torch.equal(p, q) for p, q in zip(a, b))


def disk_bytes(folder):
    return sum(os.path.getsize(p) for p in glob.glob(os.path.join(folder, "*.pack")))


class _Codebooks:
    """Calibrated-looking codebooks: the theoretical ones, shifted a little."""

    def get(self, layer_idx, kind, bits):
        c = theoretical_codebook(bits, 32).centroids
        return Codebook.from_centroids(c * 0.97, bits)

    def check_states(self, *_):
        pass


@torch.no_grad()
def test_a_cache_of_other_quantizers_is_refused_by_name():
    model, cfg = model_and_config()
    store = PrefixStore(config=cfg, page_tokens=8, **KW)
    x = ids(40)
    with pytest.raises(ValueError, match="another config than the store's: seed=7"):
        store.insert(x, prefill(model, cfg, x, seed=7))
    with pytest.raises(ValueError, match="rotation_kind|rotation"):
        store.insert(x, prefill(model, cfg, x, rotation="hadamard" if store.tq_config.rotation != "hadamard"
                                else "dense"))
    with pytest.raises(ValueError, match="other rotations or codebooks than the store's"):
        store.insert(x, prefill(model, cfg, x, codebooks=_Codebooks()))
    assert store.stats()["pages"] == [0]
    right = prefill(model, cfg, x)
    store.insert(x, right)
    got, n = store.match(torch.cat([x, ids(2, 5)], 1))
    assert n == 40


@torch.no_grad()
@pytest.mark.parametrize("order", ["chunked first", "one chunk first", "alike"])
def test_shared_pages_are_the_first_inserts_and_the_rest_the_inserted_caches(order):
    """The contract of docs/prefix_cache.md: a restored endpoint holds its own snapshot, and for each whole page the
    codes of the first insert that stored it; computed alike, that is the inserted cache bit for bit; computed
    another way, the logits differ by that computation's rounding (measured here) and nothing else."""
    model, cfg = model_and_config()
    x = ids(60, seed=3)
    a = prefill(model, cfg, x[:, :40], chunks=[13, 14, 13])  # same first pages, another computation
    b = prefill(model, cfg, x[:, :45])
    if order == "alike":
        a = prefill(model, cfg, x[:, :40], chunks=[40])
        a_same = prefill(model, cfg, x[:, :45])
        assert torch.equal(a_same.layers[0].kv.k_buf.live()[0], b.layers[0].kv.k_buf.live()[0])
    first, second = ((a, x[:, :40]), (b, x[:, :45])) if order != "one chunk first" else ((b, x[:, :45]), (a, x[:, :40]))
    store = PrefixStore(config=cfg, page_tokens=8, **KW)
    store.insert(first[1], first[0])
    store.insert(second[1], second[0])
    got, n = store.match(x)
    assert n == 45
    pages = 32  # the whole pages of a's quantized part (40 - 8 exact)
    owner = first[0]
    for i, layer in enumerate(got.layers):
        for name in ("k_buf", "v_buf"):
            mine, ref, theirs = (getattr(c.layers[i].kv, name).live()[0] for c in (got, owner, b))
            assert torch.equal(mine[:, :, :pages], ref[:, :, :pages]), (i, name, "pages")
            assert torch.equal(mine[:, :, pages:], theirs[:, :, pages:]), (i, name, "snapshot")
        assert torch.equal(layer.kv.window.keys, b.layers[i].kv.window.keys) and layer.cumulative_length == 45
    want = steps(model, copy.deepcopy(b), x, 45)
    out = steps(model, got, x, 45)
    if order != "chunked first":
        assert same(out, want)
    else:
        other = steps(model, prefill(model, cfg, x[:, :45], chunks=[13, 14, 18]), x, 45)
        diff = max((p - q).abs().max().item() for p, q in zip(out, want))
        between = max((p - q).abs().max().item() for p, q in zip(other, want))
        assert diff <= 4 * max(between, 1e-6), (diff, between)  # the size of rounding between two computations


def _widened(cfg, x, big: bool):
    """A cache of x's tokens fed K/V directly: with `big`, a norm past float16's range widens layer 0's norms."""
    cache = TurboQuantCache(config=cfg, **KW)
    g = torch.Generator().manual_seed(1)
    for i in range(cfg.num_hidden_layers):
        k = torch.randn(1, 2, x.shape[1], 32, generator=g)
        v = torch.randn(1, 2, x.shape[1], 32, generator=g)
        if big and i == 0:
            k[0, 0, 3] *= 1e5
        cache.update(k, v, i)
    if big:
        cache.layers[0].kv.k_buf.norms  # (settles the pending check)
    return cache


@pytest.mark.parametrize("wide_first", [True, False])
def test_pages_of_float32_norms_never_mix_with_float16_ones(wide_first):
    _, cfg = model_and_config()
    x = ids(45)
    with pytest.warns(RuntimeWarning, match="float16"):
        wide = _widened(cfg, x, True)
    narrow = _widened(cfg, x[:, :41], False)
    assert wide.layers[0].norm_dtype == torch.float32 and narrow.layers[0].norm_dtype == torch.float16
    store = PrefixStore(config=cfg, page_tokens=8, **KW)
    pair = [(x, wide), (x[:, :41], narrow)]
    for y, c in (pair if wide_first else pair[::-1]):
        store.insert(y, c)
    for y, c in pair:
        got, n = store.match(torch.cat([y, ids(1, 9)], 1))
        assert n == y.shape[1]
        for i in range(cfg.num_hidden_layers):
            for name in ("k_buf", "v_buf"):
                (mp, mn), (tp, tn) = getattr(got.layers[i].kv, name).live(), getattr(c.layers[i].kv, name).live()
                assert mn.dtype == tn.dtype and torch.equal(mn, tn) and torch.equal(mp, tp)


@torch.no_grad()
@pytest.mark.parametrize("fault", ["deleted", "truncated", "damaged"])
def test_a_bad_page_file_is_dropped_and_the_longest_whole_prefix_returned(fault, tmp_path):
    model, cfg = model_and_config()
    x = ids(70)
    short, long = prefill(model, cfg, x[:, :24]), prefill(model, cfg, x[:, :64])
    store = PrefixStore(config=cfg, page_tokens=8, **KW, cpu_bytes=1, disk_dir=str(tmp_path), disk_bytes=1 << 30)
    store.insert(x[:, :24], short)
    store.insert(x[:, :64], long)  # (its pages past the short one's go into a pack of their own)
    short_chain = _chain_keys(store, x[:, :25])
    key = next(k for k, h in store.catalog.held.items() if isinstance(h, Loc) and k not in short_chain)  # the long one's
    path = store.disk.path(store.catalog.held[key].pack)
    if fault == "deleted":
        os.remove(path)
    elif fault == "truncated":
        os.truncate(path, os.path.getsize(path) // 2)
    else:
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) - 3)
            f.write(b"\xff\xfe\xfd")
    with pytest.warns(RuntimeWarning, match="drops the page file"):
        got, n = store.match(x)
    assert n == 24 and same(steps(model, got, x, 24), steps(model, copy.deepcopy(short), x, 24))
    assert store.match(x)[1] == 24  # no second warning, still the short one
    store.insert(x[:, :64], long)  # stored again
    got, n = store.match(x)
    assert n == 64 and same(steps(model, got, x, 64), steps(model, copy.deepcopy(long), x, 64))
    assert store.stats()["bytes"][-1] == disk_bytes(tmp_path)


def _chain_keys(store, y):
    with store._lock:
        chains, _ = store.catalog.longest(y, [page_keys(y[0], 8, store.namespace)])
    return set(chains[0]) if chains else set()


@torch.no_grad()
def test_a_failed_disk_write_leaves_the_store_as_it_was(tmp_path, monkeypatch):
    model, cfg = model_and_config()
    x, y = ids(70), ids(70, seed=1)
    cx, cy = prefill(model, cfg, x[:, :64]), prefill(model, cfg, y[:, :64])
    store = PrefixStore(config=cfg, page_tokens=8, **KW, cpu_bytes=4096, disk_dir=str(tmp_path), disk_bytes=1 << 30)
    store.insert(x[:, :64], cx)
    before = store.stats()
    files = sorted(glob.glob(str(tmp_path / "*")))
    from tq_hf_cache.prefix.disk import DiskTier

    real = prefix_disk._write_all

    def flaky(f, parts):  # the disk fills up part way through the pack
        real(f, parts[:3])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(prefix_disk, "_write_all", flaky)
    with pytest.raises(OSError, match="nothing of this insert was stored"):
        store.insert(y[:, :64], cy)
    after = store.stats()
    assert after["bytes"] == before["bytes"] and after["pages"] == before["pages"]
    assert sorted(glob.glob(str(tmp_path / "*"))) == files and after["failed_inserts"] == 1
    assert store.match(y)[1] == 0
    got, n = store.match(x)
    assert n == 64 and same(steps(model, got, x, 64), steps(model, copy.deepcopy(cx), x, 64))
    monkeypatch.setattr(prefix_disk, "_write_all", real)
    store.insert(y[:, :64], cy)
    got, n = store.match(y)
    assert n == 64 and same(steps(model, got, y, 64), steps(model, copy.deepcopy(cy), y, 64))
    assert store.stats()["bytes"][-1] == disk_bytes(tmp_path)


@torch.no_grad()
def test_a_folder_is_one_stores_and_the_next_store_adopts_it_within_budget(tmp_path):
    model, cfg = model_and_config()
    kw = dict(config=cfg, page_tokens=8, **KW, cpu_bytes=1, disk_dir=str(tmp_path))
    prompts = [ids(70, seed=s) for s in range(4)]
    caches = [prefill(model, cfg, p[:, :64]) for p in prompts]
    one = PrefixStore(**kw, disk_bytes=1 << 30)
    with pytest.raises(ValueError, match="in use by another PrefixStore"):
        PrefixStore(**kw, disk_bytes=1 << 30)
    code = ("import sys; sys.path.insert(0, 'tests'); from conftest import tiny_llama_config; "
            "from tq_hf_cache import PrefixStore; "
            f"PrefixStore(config=tiny_llama_config(), page_tokens=8, residual_length=8, disk_dir={str(tmp_path)!r}, "
            "disk_bytes=1<<30)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(__file__)))
    assert run.returncode != 0 and "in use by another PrefixStore" in run.stderr
    one.insert(prompts[0][:, :64], caches[0])
    per_prompt = disk_bytes(tmp_path)
    one.close()
    with pytest.raises(ValueError, match="closed"):
        one.match(prompts[0])
    budget = 2 * per_prompt + per_prompt // 2
    for r in range(1, 4):  # restarts: each adopts what the last left, and the folder stays within its budget
        with PrefixStore(**kw, disk_bytes=budget) as store:
            got, n = store.match(prompts[r - 1])
            assert n == 64 and same(steps(model, got, prompts[r - 1], 64),
                                    steps(model, copy.deepcopy(caches[r - 1]), prompts[r - 1], 64))
            store.insert(prompts[r][:, :64], caches[r])
            assert store.stats()["bytes"][-1] == disk_bytes(tmp_path) <= budget
    with pytest.warns(RuntimeWarning, match="removed"):  # another config's store: the files are not its own
        PrefixStore(**{**kw, "residual_length": 16}, disk_bytes=budget).close()
    assert disk_bytes(tmp_path) == 0


@torch.no_grad()
def test_a_lookup_does_not_wait_for_an_inserts_disk_writes(tmp_path, monkeypatch):
    model, cfg = model_and_config()
    x, y = ids(70), ids(70, seed=1)
    cx, cy = prefill(model, cfg, x[:, :40]), prefill(model, cfg, y[:, :64])
    store = PrefixStore(config=cfg, page_tokens=8, **KW, cpu_bytes=1 << 20, disk_dir=str(tmp_path),
                        disk_bytes=1 << 30)
    store.insert(x[:, :40], cx)
    store.index.capacity[0] = store.stats()["bytes"][0]  # full: the next insert moves pages to disk
    from tq_hf_cache.prefix.disk import DiskTier

    entered, release = threading.Event(), threading.Event()
    real = DiskTier.write_pack

    def slow(self, *a, **k):
        entered.set()
        release.wait(30)
        return real(self, *a, **k)

    monkeypatch.setattr(DiskTier, "write_pack", slow)
    writer = threading.Thread(target=store.insert, args=(y[:, :64], cy))
    writer.start()
    try:
        assert entered.wait(30)
        result = {}
        reader = threading.Thread(target=lambda: result.update(n=store.match(x)[1]))
        reader.start()
        reader.join(10)
        assert result.get("n") == 40, "the lookup waited for the insert's disk write"
    finally:
        release.set()
        writer.join(30)
    assert store.match(y)[1] == 64


def test_eviction_looks_at_few_pages_per_victim():
    """Two tiers of 4000 pages filled and churned: the pages the index looks at stay a small multiple of the pages
    inserted (a scan of every page per victim would look at millions)."""
    seen = {"n": 0}

    class Counting(dict):
        def items(self):
            seen["n"] += len(self)
            return super().items()

        def values(self):
            seen["n"] += len(self)
            return super().values()

        def __iter__(self):
            seen["n"] += len(self)
            return super().__iter__()

    index = PrefixIndex([2000 * 10, 2000 * 10], page_tokens=4)
    index._pages = Counting()
    total = 0
    for i in range(1000):
        keys = page_keys(list(range(i * 100, i * 100 + 32)), 4, "m")
        index.insert(keys, 10)
        total += len(keys)
    assert index.stats()["pages"] == [2000, 2000] and index.stats()["dropped"] == total - 4000
    assert seen["n"] < 20 * total, seen


def test_bad_arguments_are_refused_by_name_before_anything_is_made(tmp_path):
    _, cfg = model_and_config()
    folder = str(tmp_path / "pages")
    for kw, msg in [(dict(cpu_bytes=1e9), "cpu_bytes must be an integer"),
                    (dict(disk_dir=folder), "needs disk_bytes > 0"),
                    (dict(disk_bytes=1 << 20), "needs disk_dir"),
                    (dict(page_tokens=0), "page_tokens must be"),
                    (dict(disk_dir=folder, disk_bytes=-1), "disk_bytes must be"),
                    (dict(disk_dir=folder, disk_bytes=1 << 20, tq_config="nope"), "nope")]:
        with pytest.raises(ValueError, match=msg):
            PrefixStore(config=cfg, **kw)
        assert not os.path.exists(folder), kw
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA"):
            PrefixStore(config=cfg, device="cuda")


@torch.no_grad()
def test_the_docs_snippet_serves_a_repeated_prompt():
    """docs/prefix_cache.md's loop, twice over one prompt: the second time the whole prompt but its last token is
    restored, and nothing is left to prefill."""
    model, cfg = model_and_config()
    store = PrefixStore(config=cfg, page_tokens=8, **KW)
    prompt_ids = ids(30)
    for _ in range(2):
        cache, n = store.match(prompt_ids)
        if n < prompt_ids.shape[1] - 1:
            model(prompt_ids[:, n:-1], **with_cache(cache))
            store.insert(prompt_ids[:, :-1], cache)
        model.generate(prompt_ids, **with_cache(cache), max_new_tokens=3, do_sample=False)
    assert n == 29


def test_a_file_that_shrinks_while_read_is_an_error_naming_it(tmp_path, monkeypatch):
    """Readers take files into private memory: a file truncated while it is read is a clear error (through a mapping
    it was a SIGBUS)."""
    from tq_hf_cache import _io

    path = tmp_path / "f.bin"
    path.write_bytes(bytes(4096))
    real = os.fstat

    def bigger(fd):
        st = real(fd)
        return os.stat_result((*st[:6], st.st_size + 100, *st[7:]))

    monkeypatch.setattr(os, "fstat", bigger)
    with pytest.raises(ValueError, match="f.bin changed size while it was read"):
        _io.read_private(str(path))


def test_two_writers_of_one_new_prefix_folder_give_the_loser_a_clear_error(tmp_path, monkeypatch):
    from tq_hf_cache import _io

    target = str(tmp_path / "prefix")
    real = os.rename

    def racing(src, dst):  # another writer finishes first
        os.makedirs(dst)
        open(os.path.join(dst, "x"), "w").close()
        return real(src, dst)

    monkeypatch.setattr(os, "rename", racing)
    with pytest.raises(FileExistsError, match="created by another writer while this one wrote it"):
        _io.write_folder(target, {"a": b"1"})
    assert os.listdir(target) == ["x"] and [p for p in os.listdir(tmp_path) if p != "prefix"] == []


@torch.no_grad()
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tiny_tiers_under_random_inserts_and_lookups(seed, tmp_path):
    """Pages stored, moved, dropped, stored again and moved within one insert (tiers of a few pages): every lookup
    restores an endpoint that was inserted, continuing as its inserted cache did, and the folder holds what the store
    counts."""
    model, cfg = model_and_config()
    rng = torch.Generator().manual_seed(100 + seed)
    base = ids(48, seed=seed)
    prompts = [torch.cat([base[:, : 8 * int(torch.randint(0, 6, (1,), generator=rng))], ids(24, seed=50 + i)], 1)
               for i in range(6)]
    caches = [prefill(model, cfg, p) for p in prompts]
    page = PrefixStore(config=cfg, page_tokens=8, **KW)
    page.insert(prompts[0], caches[0])
    per = max(page.stats()["bytes"][0] // 8, 1)
    store = PrefixStore(config=cfg, page_tokens=8, **KW, cpu_bytes=3 * per, disk_dir=str(tmp_path),
                        disk_bytes=10 * per)
    for step in range(40):
        i = int(torch.randint(0, len(prompts), (1,), generator=rng))
        if torch.rand(1, generator=rng) < 0.5:
            store.insert(prompts[i], caches[i])
        else:
            x = torch.cat([prompts[i], ids(1, seed=7)], 1)
            got, n = store.match(x)
            if n:
                j = next(j for j, p in enumerate(prompts) if p.shape[1] == n and torch.equal(p[0], x[0, :n]))
                a, b = steps(model, got, x, n), steps(model, copy.deepcopy(caches[j]), x, n)
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"seed {seed} step {step}")
        assert store.stats()["bytes"][-1] == disk_bytes(tmp_path) <= 10 * per, (seed, step)


@torch.no_grad()
@pytest.mark.parametrize("fault", [None, "deleted"])
def test_a_pack_left_half_empty_is_rewritten_and_one_found_gone_meanwhile_is_dropped(fault, tmp_path):
    """Pages are written a pack (one file) per insert. When evictions leave a pack holding half its bytes or less,
    the next insert moves its pages into its own pack and the old file goes: the folder holds what the store
    counts, within budget. A pack deleted before that rewrite: its pages are dropped (one warning) and the insert
    goes on without them."""
    model, cfg = model_and_config()
    x, y = ids(70), ids(70, seed=1)
    cx, cy = prefill(model, cfg, x[:, :64]), prefill(model, cfg, y[:, :64])
    probe = PrefixStore(config=cfg, page_tokens=8, **KW, cpu_bytes=1, disk_dir=str(tmp_path / "probe"),
                        disk_bytes=1 << 30)
    probe.insert(x[:, :64], cx)
    one = disk_bytes(tmp_path / "probe")
    probe.close()
    budget = one + one // 2  # the second prompt's pages push out more than half of the first's
    store = PrefixStore(config=cfg, page_tokens=8, **KW, cpu_bytes=1, disk_dir=str(tmp_path / "d"),
                        disk_bytes=budget)
    store.insert(x[:, :64], cx)
    (first,) = glob.glob(str(tmp_path / "d" / "*.pack"))
    if fault:
        os.remove(first)
        with pytest.warns(RuntimeWarning, match="drops the page file"):
            store.insert(y[:, :64], cy)
    else:
        store.insert(y[:, :64], cy)
    rewritten = store.stats()["moved"]
    assert not os.path.exists(first) and store.stats()["bytes"][-1] == disk_bytes(tmp_path / "d") <= budget
    assert len(glob.glob(str(tmp_path / "d" / "*.pack"))) == 1
    got, n = store.match(y)
    assert n == 64 and same(steps(model, got, y, 64), steps(model, copy.deepcopy(cy), y, 64))
    if not fault:  # the first prompt's earliest pages were kept (more than y's 8 and its snapshot), rewritten
        assert rewritten > 0 and store.stats()["pages"][-1] > 9
    store.insert(x[:, :64], cx)  # and it can be stored again
    got, n = store.match(x)
    assert n == 64 and same(steps(model, got, x, 64), steps(model, copy.deepcopy(cx), x, 64))
    assert store.stats()["bytes"][-1] == disk_bytes(tmp_path / "d") <= budget



@torch.no_grad()
def test_a_new_store_adopts_a_torn_pack_up_to_its_first_bad_page_and_removes_old_format_files(tmp_path):
    model, cfg = model_and_config()
    x = ids(70)
    cx = prefill(model, cfg, x[:, :64])
    kw = dict(config=cfg, page_tokens=8, **KW, cpu_bytes=1, disk_dir=str(tmp_path), disk_bytes=1 << 30)
    with PrefixStore(**kw) as store:
        store.insert(x[:, :64], cx)
        locs = sorted(store.catalog.held.values(), key=lambda loc: loc.offset)
    (pack,) = glob.glob(str(tmp_path / "*.pack"))
    os.truncate(pack, locs[3].offset + locs[3].size // 2)  # a crash while the 4th page was written
    old = tmp_path / ("ab" * 32 + ".safetensors")  # a page file of the format before packs
    old.write_bytes(b"\0" * 64)
    with pytest.warns(RuntimeWarning, match="removed 1 file"):
        store = PrefixStore(**kw)
    assert store.stats()["pages"][-1] == 3 and store.stats()["bytes"][-1] == os.path.getsize(pack)
    assert not old.exists()
    assert store.match(x)[1] == 0  # (no endpoint is whole)
    store.insert(x[:, :64], cx)
    got, n = store.match(x)
    assert n == 64 and same(steps(model, got, x, 64), steps(model, copy.deepcopy(cx), x, 64))
    assert store.stats()["bytes"][-1] == disk_bytes(tmp_path)
    store.close()
