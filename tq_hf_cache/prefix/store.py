"""`PrefixStore`: many requests share their prompts' quantized K/V, held in pages across tiers (CPU memory, the GPU,
a disk folder) under byte budgets.

What is stored for a cache of E tokens (`insert`):
- pages: the packed codes and norms of every whole `page_tokens` page inside its quantized part, per layer, keyed by
  `prefix_index.page_keys` (a chained hash of the tokens from the first one, bound to the model and config, and to
  the row's key means and norm dtypes: `prefix_pages.binding`), shared by every prompt that starts with those tokens;
- a snapshot of the endpoint E: the packed tokens after the last whole page, the exact residual window, the exact
  sink copies, a centred layer's key mean and the layers kept in full precision. A TurboQuantCache of E tokens holds
  its newest tokens exact, so only an endpoint some cache reached can be restored exactly.

`match(input_ids)` restores the longest stored endpoint that the prompt extends (at most all but its last token,
which generate must compute) and how many tokens it covers. The restored cache holds the inserted cache's snapshot
(its exact tokens, lengths and the codes past its last whole page) and, for every whole page, the codes of the
first insert that stored that page: the same tokens under the same model, config and binding. Where every insert of
those tokens computed them alike (the same chunks), that is the inserted cache bit for bit; where another insert
computed them another way (other chunks, token by token, another batch), its pages differ from the inserted cache's
by that computation's rounding and nothing else.

Concurrency: `match` never waits on a disk write. One lock guards the store's state and is held only for bookkeeping;
an insert reserves its pages in the index (a transaction), copies them and writes those bound for disk as one pack
(`prefix_disk`) outside the lock, then publishes them (or rolls the whole insert back when the write fails: an insert
is all or nothing). Inserts run one at a time.
A match reads pinned pages outside the lock; a page found damaged or missing on disk is dropped with what hangs on it
(one warning), and the match returns the longest prefix still whole. Pages are copied into the restored cache, so
the store never lends a live cache its memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import threading
import time
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch

from . import pages as pp
from ..config import model_facts
from .file import weights_digest
from .catalog import ROOT, Catalog
from .checks import QuantizerCheck, check_args, check_cache
from .disk import DiskTier, Loc, PageDamaged, StagedReader
from .index import PrefixIndex, page_keys

__all__ = ["PrefixStore"]

STAGING_BYTES = 64 << 20  # each of the two host halves disk pages pass through on their way to a GPU
YIELD_S = 0.0002  # an insert's longest stretch of work before it hands the interpreter on
GIVE_WAY_S = 0.005  # the longest an insert waits, at one page boundary, for the lookups under way


class PrefixStore:
    """Quantized prompt prefixes shared by requests, in pages across tiers.

    Args:
        config: the model's transformers config (the caches `match` builds are for it).
        tq_config: the caches' TurboQuantConfig (a preset name, a config, or None for the default).
        page_tokens: tokens per page (the granularity of sharing).
        cpu_bytes: bytes of pages held in CPU memory.
        gpu_bytes: bytes of pages held on `device` (a CUDA device; 0 for none), the first tier when given.
        device: where restored caches live (and the GPU tier's pages).
        disk_dir: a folder for pages that leave memory (None: no disk tier), taken by this store alone until
            `close`. The page files a closed store left there are adopted (files of another model or config are
            removed), so the folder never holds more than `disk_bytes` of page files. With a CUDA `device` the store
            pins 2 x `STAGING_BYTES` (64 MiB) of host memory, made now, that disk pages pass through.
        disk_bytes: bytes of page files (headers included) the disk tier may hold; > 0 with `disk_dir`.
        model: the model itself, to bind the store to its weights (another checkpoint of the same shape never
            matches).
        codebooks: calibrated codebooks the caches use.
        max_cache_len: set, the store holds `TurboQuantStaticCache`s of this capacity (full-attention models, every
            layer quantized): `insert` takes them and `match` restores one; None: `TurboQuantCache`s.
        **overrides: TurboQuantConfig fields, as `TurboQuantCache` takes them.

    Example:
        >>> with PrefixStore(config=model.config, cpu_bytes=2 << 30) as store:    # doctest: +SKIP
        ...     cache, n = store.match(input_ids)
        ...     out = model.generate(input_ids, past_key_values=cache)
        ...     store.insert(input_ids, cache_that_prefilled_them)
    """

    def __init__(self, *, config, tq_config=None, page_tokens: int = 256, cpu_bytes: int = 1 << 30,
                 gpu_bytes: int = 0, device=None, disk_dir: str | None = None, disk_bytes: int = 0, model=None,
                 codebooks=None, max_cache_len: int | None = None, **overrides):
        from ..hf.cache import TurboQuantCache

        self.device = check_args(page_tokens, cpu_bytes, gpu_bytes, disk_dir, disk_bytes, device)
        self.config, self.codebooks, self.max_cache_len = config, codebooks, max_cache_len
        # the caches' config, resolved (and a bad one refused) now; `overrides` as TurboQuantCache takes them
        self.tq_config = TurboQuantCache(tq_config, config=config, codebooks=codebooks, **overrides).tq_config
        if max_cache_len is not None:
            pp.check_static(self._new_cache())
        self.page_tokens = page_tokens
        self.namespace = _namespace(config, self.tq_config, max_cache_len, model, codebooks)
        self.tiers = ([self.device] if gpu_bytes else []) + [torch.device("cpu")] + (["disk"] if disk_dir else [])
        caps = ([gpu_bytes] if gpu_bytes else []) + [cpu_bytes] + ([disk_bytes] if disk_dir else [])
        self.disk_dir = disk_dir
        disk_tier = len(caps) - 1 if disk_dir else None
        self.index = PrefixIndex(caps, page_tokens=page_tokens, file_tier=disk_tier)
        self.catalog = Catalog(self.namespace, page_tokens)
        self._check_quantizers = QuantizerCheck(self._new_cache, max_cache_len is not None)
        self._counts = {"lookups": 0, "hits": 0, "tokens_reused": 0, "damaged": 0, "failed_inserts": 0}
        self._lock = threading.Lock()  # the state above; never held across disk I/O
        self._insert_lock = threading.Lock()  # one insert (or damage drop) at a time
        self._closed = False
        self._lookups = 0  # lookups under way (under _lock); _idle is set when there are none
        self._idle = threading.Event()
        self._idle.set()
        self.disk = DiskTier(disk_dir, self.namespace) if disk_dir else None
        self._reader = None
        if self.disk is not None:
            weakref.finalize(self, self.disk.close)
            self._adopt()
            if self.device.type == "cuda":  # made now, off any request's path
                self._reader = StagedReader(self.disk, self.device, STAGING_BYTES)

    # ---- insert ----

    def insert(self, input_ids, cache) -> int:
        """Store what `cache` (a TurboQuantCache holding exactly `input_ids`: (n,) or (batch, n), each row stored on
        its own, padding included) holds: its whole pages (those not held already) and a snapshot of each row's
        endpoint. All or nothing: when a page file cannot be written (disk full, I/O error) nothing of this insert
        is kept and the OSError is raised. Returns the pages newly stored."""
        self._check_open()
        rows = pp.rows_of(input_ids)
        check_cache(cache, rows, self.tq_config, self.max_cache_len)
        with self._insert_lock:  # (the pages held cannot change under it but by lookups touching them)
            yielder = _Yielder(self._idle)
            while True:
                try:
                    return self._insert(rows, cache, yielder)
                except PageDamaged as e:  # a page it had to rewrite: dropped, and the insert made again
                    self._mark_damaged(e)

    def _insert(self, rows, cache, yielder) -> int:
        static = self.max_cache_len is not None
        tensors, infos, layout, paged, m = pp.capture(cache, rows, static, self.page_tokens)
        yielder()
        self._check_quantizers(infos)
        P = self.page_tokens
        rows_keys = []
        for r, ids in enumerate(rows):
            row = {k: v[r: r + 1] for k, v in tensors.items()}
            tkeys = page_keys(ids[: m * P], P, self.namespace)
            bound = pp.binding(row, paged)
            keys = pp.bind(tkeys, bound)
            end = (tkeys[-1] if tkeys else ROOT, ids.numel(), bound, layout)
            rows_keys.append((row, keys, self.catalog.snapshot_key(keys, ids[m * P:], bound), end))
            yielder()
        self._check_files({k for _, keys, snap, _ in rows_keys for k in (*keys, snap)})
        self._drop_damaged()
        chains, new, ends = [], {}, {}
        for row, keys, snap, end in rows_keys:
            for p, k in enumerate(keys):
                if k not in new and k not in self.catalog.held:  # (a page held already is only touched)
                    new[k] = (pp.slice_pages(row, paged, p * P, (p + 1) * P), keys[p - 1] if p else None)
                    yielder()
            if snap not in self.catalog.held:
                new.setdefault(snap, ({"tensors": pp.slice_pages(row, paged, m * P, None, rest=True),
                                       "infos": infos, "num_tokens": end[1], "end": list(end)},
                                      keys[-1] if keys else None))
            ends[snap] = end
            chains.append(keys + [snap])
        # held pages keep their sizes (one may leave and come back within this insert)
        sizes = {k: self.index.sizes_of(k) for chain in chains for k in chain if k not in new}
        for k, (p, parent) in new.items():
            sizes[k] = (pp.nbytes(p), self._file_bytes(k, parent, p))
            yielder()
        return _Insert(self, new, ends, yielder).run(chains, sizes)

    # ---- match ----

    def match(self, input_ids):
        """(cache, n): a TurboQuantCache (a TurboQuantStaticCache for a store of `max_cache_len`) holding the longest
        stored endpoint of `input_ids` that leaves at least its last token to compute, and its length n; (an empty
        cache, 0) when none is stored. For a batch (batch, len), each row matches on its own and n is the longest
        length at which every row has a stored endpoint of one layout (how many tokens each layer holds packed and
        exact: one cache holds them alike)."""
        self._check_open()
        rows = pp.rows_of(input_ids)
        tkeys = [page_keys(ids, self.page_tokens, self.namespace) for ids in rows]
        with self._lock:
            self._counts["lookups"] += len(rows)
            self._lookups += 1
            self._idle.clear()
        try:
            return self._match(rows, tkeys)
        finally:
            with self._lock:
                self._lookups -= 1
                if not self._lookups:
                    self._idle.set()

    def _match(self, rows, tkeys):
        while True:
            with self._lock:
                chains, length = self.catalog.longest(rows, tkeys)
                if chains is None:
                    return self._new_cache(), 0
                keys = list(dict.fromkeys(k for chain in chains for k in chain))  # rows share pages: loaded once
                self.index.match(keys)  # used now: pages and snapshots move to the front of their tiers
                self.index.pin(keys)
                held = {k: self.catalog.held[k] for k in keys}
            try:
                loaded = self._read(held)
            except PageDamaged as e:
                with self._lock:  # a page an insert moved to another pack meanwhile (its old one removed) is fine
                    moved = self.catalog.held.get(e.key, held[e.key]) != held[e.key]
                if not moved:
                    self._mark_damaged(e)
                continue
            finally:
                with self._lock:
                    self.index.unpin(keys, forgotten_ok=True)  # (damaged pages may be dropped meanwhile)
            with self._lock:
                self._counts["hits"] += len(rows)
                self._counts["tokens_reused"] += length * len(rows)
            cache = pp.restore(self._new_cache(), [[loaded[k] for k in chain] for chain in chains], self.config,
                               self.device, self.max_cache_len is not None)
            return cache, length

    def _read(self, held: dict) -> dict:
        """Every chain payload in memory: disk pages read and checked outside the lock (threads: file reads and
        hashing release the GIL; a GPU store's through its staging halves)."""
        on_disk = {k: h for k, h in held.items() if isinstance(h, Loc)}
        loaded = {k: h for k, h in held.items() if not isinstance(h, Loc)}
        if on_disk and self._reader is not None:
            loaded.update(self._reader.read(on_disk))
        elif on_disk:
            def one(k):
                return pp.unflatten(*self.disk.read(k, on_disk[k]))
            with ThreadPoolExecutor(max(1, min(16, os.cpu_count() or 1, len(on_disk)))) as pool:
                loaded.update(zip(on_disk, pool.map(one, on_disk)))
        return loaded

    # ---- the rest of the API ----

    def stats(self) -> dict:
        """Lookups, hits (prefixes restored), tokens reused, page files found damaged, inserts rolled back; pages
        and bytes per tier (the disk tier's as file bytes), pages stored, moved, dropped (the index's counts)."""
        with self._lock:
            out = self.index.stats()
            out.pop("pages_matched")  # the index's own lookups: the store's count restored prefixes instead
            out.update(self._counts)
            out["tiers"] = [str(t) for t in self.tiers]
            return out

    def close(self) -> None:
        """Release the disk folder (its page files stay, for the next store on it to adopt) and refuse further
        calls; memory tiers are freed with the store."""
        with self._insert_lock:
            self._closed = True
            if self.disk is not None:
                self.disk.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- internals ----

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("this PrefixStore is closed")

    def _file_bytes(self, key: str, parent: str | None, payload: dict) -> int:
        if self.disk is None:
            return pp.nbytes(payload)
        return self.disk.file_bytes(key, parent, *pp.parts(payload))

    def _mark_damaged(self, e: PageDamaged) -> None:
        with self._lock:
            new = e.key not in self.catalog.damaged and e.key in self.catalog.held
            self.catalog.damaged.add(e.key)
            if new:
                self._counts["damaged"] += 1
        if new:
            warnings.warn(f"tq_hf_cache: PrefixStore drops the page file {e.path} and what follows it: {e.why}. "
                          "Lookups restore the longest prefix still whole; inserting the prompt again stores it again",
                          RuntimeWarning, stacklevel=3)
        if self._insert_lock.acquire(blocking=False):  # never waits for an insert: else the next insert drops it
            try:
                self._drop_damaged()
            finally:
                self._insert_lock.release()

    def _check_files(self, keys: set) -> None:
        """Pages on disk this insert would reuse whose pack is gone or of another size than written count as
        damaged (so the insert stores them again); a pack changed in place is found when it is read."""
        sizes = {}
        for k in keys:
            held = self.catalog.held.get(k)
            if isinstance(held, Loc):
                if held.pack not in sizes:
                    try:
                        sizes[held.pack] = os.stat(self.disk.path(held.pack), follow_symlinks=False).st_size
                    except OSError:
                        sizes[held.pack] = None
                ok = sizes[held.pack] == self.index.pack_bytes(held.pack)
                if not ok:
                    with self._lock:
                        self._counts["damaged"] += k not in self.catalog.damaged
                        self.catalog.damaged.add(k)

    def _drop_damaged(self) -> None:
        """Forget the damaged pages and everything that hangs on them (the insert lock is held)."""
        with self._lock:
            for key in self.catalog.damaged:
                for k in self.index.remove_subtree(key):
                    self.catalog.unpublish(k)
            self.catalog.damaged.clear()
            packs = self.index.take_emptied()
        self._remove_packs(packs)

    def _adopt(self) -> None:
        """Hold the pages an earlier store left in the folder (parents before children, the oldest first as least
        recently used), leave out what hangs on nothing, and bring the folder under its budget."""
        found, sizes, removed = self.disk.scan()
        tier = len(self.tiers) - 1
        todo, done = {p.key: p for p in found}, 0  # (a page in two packs: the newer one)
        while todo:
            ready = [p for p in todo.values() if p.parent is None or p.parent in self.catalog.held]
            if not ready:
                break
            for p in ready:
                del todo[p.key]
                self.index.adopt(p.key, p.parent, tier, p.tensor_bytes, p.file_bytes, p.loc.pack, sizes[p.loc.pack])
                end = p.meta.get("end")
                self.catalog.publish(p.key, p.loc, end[0] if end else None, end)
                done += 1
        unused = [pack for pack in sizes if self.index.pack_bytes(pack) is None]  # (only pages whose chain is gone)
        for a in self.index.fit():
            self.catalog.unpublish(a.key)
        self._remove_packs(unused + self.index.take_emptied())
        if removed or todo:
            warnings.warn(f"tq_hf_cache: PrefixStore removed {removed + len(unused)} file(s) from {self.disk.folder} "
                          f"and left out {len(todo)} page(s) that were not whole pages of this model and config; "
                          f"adopted {done}", RuntimeWarning, stacklevel=3)

    def _remove_packs(self, packs) -> None:
        for pack in packs:
            _remove_file(self.disk.path(pack))

    def _new_cache(self):
        from ..hf.cache import TurboQuantCache
        from ..hf.static_cache import TurboQuantStaticCache

        if self.max_cache_len is None:
            return TurboQuantCache(self.tq_config, config=self.config, codebooks=self.codebooks)
        return TurboQuantStaticCache(self.config, self.max_cache_len, tq_config=self.tq_config, codebooks=self.codebooks)


class _Insert:
    """One insert's transaction: reserve its pages in the index (under the store's lock), carry out the index's
    copies outside the lock and write the pages it sends to disk as one pack, then publish them; or roll everything
    back when the write fails."""

    def __init__(self, store: PrefixStore, new: dict, ends: dict, yielder: _Yielder):
        self.store, self.new, self.ends, self.yielder = store, new, ends, yielder
        self.staged: dict = {}  # key -> its payload in its new tier (a disk page's Loc once its pack is written)
        self.to_disk: dict = {}  # key -> (parent key, payload): the pack's pages, in order
        self.pack = secrets.token_hex(32) if store.disk is not None else None
        self.written = False
        self.gone: dict = {}  # published pages the index dropped: what `publish` needs to put them back

    def run(self, chains, sizes) -> int:
        """Carry the chains' pages in; returns the pages newly stored."""
        st = self.store
        with st._lock:
            st.index.begin(self.pack)
            actions = []
            for chain in chains:
                actions += st.index.insert(chain, [sizes[k][0] for k in chain], [sizes[k][1] for k in chain])
            self.gone = {a.key: st.catalog.unpublish(a.key) for a in actions
                         if a.kind == "drop" and a.key in st.catalog.held}
        last_drop = {a.key: i for i, a in enumerate(actions) if a.kind == "drop"}
        try:
            for i, a in enumerate(actions):
                if a.kind in ("store", "move") and last_drop.get(a.key, -1) > i:
                    continue  # dropped later in this insert: nothing to copy or write
                self._carry_out(a)
                self.yielder()
            if self.to_disk:
                self._write_pack()
        except BaseException as e:
            self._roll_back(failed=not isinstance(e, PageDamaged))
            if isinstance(e, OSError):
                raise OSError(e.errno, f"the prefix store could not write a page file ({e.strerror or e}); "
                                       "nothing of this insert was stored", getattr(e, "filename", None)) from e
            raise
        with st._lock:
            st.index.commit()
            for key, held in self.staged.items():
                end = self.ends.get(key)
                st.catalog.publish(key, held, end[0] if end else None, end)
            emptied = st.index.take_emptied()
        st._remove_packs(emptied)
        return sum(a.kind == "store" and a.key not in self.ends for a in actions)

    def _write_pack(self) -> None:
        st = self.store
        pages = ((k, parent, *pp.flatten(payload)) for k, (parent, payload) in self.to_disk.items())
        self.written = True
        locs = st.disk.write_pack(self.pack, pages, self.yielder)
        size = sum(loc.size for loc in locs.values())
        if size != st.index.pack_bytes(self.pack):
            raise RuntimeError(f"the pack written holds {size} bytes, the index counted {st.index.pack_bytes(self.pack)}")
        self.staged.update(locs)

    def _roll_back(self, failed: bool) -> None:
        st = self.store
        with st._lock:
            st.index.rollback()
            for key, (held, parent, end) in self.gone.items():
                st.catalog.publish(key, held, parent, end)
            st._counts["failed_inserts"] += failed
        if self.written:
            st._remove_packs([self.pack])

    def _carry_out(self, a) -> None:
        """One index action's copy, or a page set aside for the pack: the result goes into `staged` or `to_disk`."""
        st, staged = self.store, self.staged
        if a.kind == "skip":
            return
        if a.kind == "drop":  # a page stored earlier in this insert (published drops are `run`'s)
            staged.pop(a.key, None)
            self.to_disk.pop(a.key, None)
            return
        if a.key in staged:
            payload = staged[a.key]
        elif a.key in self.new:
            payload = self.new[a.key][0]
        else:  # held before this insert, or held and dropped earlier in it (its pack stays until the commit)
            payload = st.catalog.held[a.key] if a.key in st.catalog.held else self.gone[a.key][0]
            if isinstance(payload, Loc):
                payload = pp.unflatten(*st.disk.read(a.key, payload))
        where = st.tiers[a.to]
        if where != "disk":
            staged[a.key] = pp.to_device(payload, where)
            return
        staged.pop(a.key, None)
        parent = self.new[a.key][1] if a.key in self.new else st.index.parent_of(a.key)
        self.to_disk[a.key] = (parent, payload)


class _Yielder:
    """Where an insert gives way to lookups, between pages: while a lookup runs, the insert waits for it (up to
    `GIVE_WAY_S` at a time, so a stream of lookups slows inserts but cannot stop them); otherwise it hands the
    interpreter to other threads every `YIELD_S` of its work. Lookups come first: an insert is background work
    after a response, a lookup is in front of one."""

    def __init__(self, idle: threading.Event):
        self.idle, self.last = idle, time.perf_counter()

    def __call__(self) -> None:
        if not self.idle.is_set():
            self.idle.wait(GIVE_WAY_S)
            self.last = time.perf_counter()
        elif time.perf_counter() - self.last > YIELD_S and threading.active_count() > 1:
            time.sleep(1e-6)
            self.last = time.perf_counter()


def _remove_file(path: str) -> None:
    """Remove a file the store let go of (one already gone is fine; another failure is a warning)."""
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        warnings.warn(f"tq_hf_cache: PrefixStore could not remove {path}: {e}", RuntimeWarning, stacklevel=2)


def _namespace(config, tq_config, max_cache_len, model, codebooks) -> str:
    """What every page key is bound to: the model (its facts, and its weights when given), the config, the cache
    kind and the codebooks."""
    ns = {"model": model_facts(config), "tq_config": tq_config.to_dict(), "static": max_cache_len,
          "weights": None if model is None else weights_digest(model),
          "codebooks": None if codebooks is None else repr(getattr(codebooks, "info", None))}
    return hashlib.sha256(json.dumps(ns, sort_keys=True, default=str).encode()).hexdigest()
