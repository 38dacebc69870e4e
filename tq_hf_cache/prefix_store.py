"""`PrefixStore`: many requests share their prompts' quantized K/V, held in pages across tiers (CPU memory, the GPU,
a disk folder) under byte budgets.

What is stored for a cache of E tokens (`insert`):
- pages: the packed codes and norms of every whole `page_tokens` page inside its quantized part, per layer, keyed by
  `prefix_index.page_keys` (a chained hash of the tokens from the first one, bound to the model and config), shared
  by every prompt that starts with those tokens;
- a snapshot of the endpoint E: the packed tokens after the last whole page, the exact residual window, the exact
  sink copies, a centred layer's key mean and the layers kept in full precision. A TurboQuantCache of E tokens holds
  its newest tokens exact, so only an endpoint some cache reached can be restored exactly.

`match(input_ids)` restores the longest stored endpoint that the prompt extends (at most all but its last token, which
generate must compute): a TurboQuantCache identical to the inserting one (codes, exact tokens, lengths), and how many
tokens it covers. Which pages live where is `prefix_index.PrefixIndex`'s business: least recently used pages move
down a tier and leave from the last, snapshots first (they are leaves). Pages are copied into the restored cache, so
the store never lends a live cache its memory. Thread-safe (one lock).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from . import _io
from .config import model_facts
from .prefix import _restore_layer, _save_layer, quantizer_digest, weights_digest
from .prefix_index import PrefixIndex, page_keys, token_bytes

__all__ = ["PrefixStore"]

STAGING_BYTES = 64 << 20  # each of the two host halves disk pages pass through on their way to a GPU
_ROOT = "root"


class PrefixStore:
    """Quantized prompt prefixes shared by requests, in pages across tiers.

    Args:
        config: the model's transformers config (the caches `match` builds are for it).
        tq_config: the caches' TurboQuantConfig (a preset name, a config, or None for the default).
        page_tokens: tokens per page (the granularity of sharing).
        cpu_bytes: bytes of pages held in CPU memory.
        gpu_bytes: bytes of pages held on `device` (a CUDA device; 0 for none), the first tier when given.
        device: where restored caches live (and the GPU tier's pages).
        disk_dir: a folder for pages that leave memory (None: no disk tier). With a CUDA `device` the store pins
            2 x `STAGING_BYTES` (64 MiB) of host memory, made now, that disk pages pass through on their way back.
        disk_bytes: bytes of pages the disk tier may hold.
        model: the model itself, to bind the store to its weights (another checkpoint of the same shape never
            matches).
        codebooks: calibrated codebooks the caches use.
        max_cache_len: set, the store holds `TurboQuantStaticCache`s of this capacity (full-attention models, every
            layer quantized): `insert` takes them and `match` restores one; None: `TurboQuantCache`s.
        **overrides: TurboQuantConfig fields, as `TurboQuantCache` takes them.

    Example:
        >>> store = PrefixStore(config=model.config, cpu_bytes=2 << 30)           # doctest: +SKIP
        >>> cache, n = store.match(input_ids)                                      # doctest: +SKIP
        >>> out = model.generate(input_ids, past_key_values=cache)                 # doctest: +SKIP
        >>> store.insert(input_ids, cache_that_prefilled_them)                     # doctest: +SKIP
    """

    def __init__(self, *, config, tq_config=None, page_tokens: int = 256, cpu_bytes: int = 1 << 30,
                 gpu_bytes: int = 0, device=None, disk_dir: str | None = None, disk_bytes: int = 0, model=None,
                 codebooks=None, max_cache_len: int | None = None, **overrides):
        from .cache import TurboQuantCache

        self.config, self.codebooks, self.max_cache_len = config, codebooks, max_cache_len
        # the caches' config, resolved (and a bad one refused) now; `overrides` as TurboQuantCache takes them
        self.tq_config = TurboQuantCache(tq_config, config=config, codebooks=codebooks, **overrides).tq_config
        if max_cache_len is not None:
            _check_static(self._new_cache())
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        tiers, caps = [], []
        if gpu_bytes:
            if self.device.type != "cuda":
                raise ValueError(f"gpu_bytes={gpu_bytes} needs a CUDA device, got device={self.device}")
            tiers.append(self.device), caps.append(gpu_bytes)
        tiers.append(torch.device("cpu")), caps.append(cpu_bytes)
        if disk_dir is not None:
            os.makedirs(disk_dir, exist_ok=True)
            tiers.append("disk"), caps.append(disk_bytes)
        self.tiers, self.disk_dir = tiers, disk_dir
        self.page_tokens = page_tokens
        self.index = PrefixIndex(caps, page_tokens=page_tokens)
        ns = {"model": model_facts(config), "tq_config": self.tq_config.to_dict(), "static": max_cache_len,
              "weights": None if model is None else weights_digest(model),
              "codebooks": None if codebooks is None else repr(getattr(codebooks, "info", None))}
        self.namespace = hashlib.sha256(json.dumps(ns, sort_keys=True, default=str).encode()).hexdigest()
        self._held: dict[str, Any] = {}  # key -> page or snapshot payload: a dict of tensors, or a disk file's path
        self._on_disk: dict[str, tuple[str, dict]] = {}  # key -> (SHA-256 of its file, the payload's non-tensor part)
        self._counts = {"lookups": 0, "hits": 0, "tokens_reused": 0}
        # the tokens' parent page key (or _ROOT) -> {snapshot key: (its length, its key means' digest, its layout)}
        self._ends: dict[str, dict[str, tuple[int, str | None, str]]] = {}
        self._parent_of: dict[str, str] = {}  # snapshot key -> its key in _ends
        self._lock = threading.Lock()
        # disk pages for a GPU: read through two pinned halves of STAGING_BYTES (made now, off any request's path),
        # one filling while the other's copy to the device runs
        self._staged_reads = self.device.type == "cuda"
        self._staging: list[torch.Tensor] = []
        if self._staged_reads and disk_dir is not None:
            self._stage_halves(STAGING_BYTES)

    # ---- insert ----

    def insert(self, input_ids, cache) -> int:
        """Store what `cache` (a TurboQuantCache holding exactly `input_ids`: (n,) or (batch, n), each row stored on
        its own, padding included) holds: its whole pages (those not held already) and a snapshot of each row's
        endpoint. Returns the pages newly stored."""
        from .cache import TurboQuantCache
        from .static_cache import TurboQuantStaticCache

        want = TurboQuantCache if self.max_cache_len is None else TurboQuantStaticCache
        if not isinstance(cache, want) or getattr(cache, "capacity", None) != self.max_cache_len:
            raise TypeError(f"this store takes {want.__name__}s" + (f" of max_cache_len={self.max_cache_len}"
                            if self.max_cache_len else "") + f" (the caches match restores), got "
                            f"{type(cache).__name__}" + (f" of {cache.capacity}" if hasattr(cache, "capacity") else ""))
        rows = _rows(input_ids)
        if int(cache.get_seq_length()) != rows.shape[1]:
            raise ValueError(f"the cache holds {int(cache.get_seq_length())} tokens, input_ids {rows.shape[1]}: "
                             "insert a cache that prefilled exactly these tokens")
        if self.max_cache_len is not None:
            tensors, infos, paged = _static_state(cache, rows.shape[0])
            quantized = [rows.shape[1]]  # a static layer holds the codes of every position
        else:
            for layer in cache.layers:
                if getattr(layer, "is_initialized", False) and hasattr(layer, "_settle"):
                    layer._settle()  # what a decode step left beyond the residual window, as a dense step leaves it
            tensors = {}
            infos = [_save_layer(layer, i, tensors, rows.shape[0]) for i, layer in enumerate(cache.layers)]
            infos = [{**info, "batch": 1} if "batch" in info else info for info in infos]
            # pages: the full-attention TurboQuant layers' packed tokens, which are the sequence's first ones (a
            # sliding layer's packed buffers begin wherever its window does: they go whole into the snapshot)
            tq = [i for i, info in enumerate(infos) if info.get("class") == "TurboQuantLayer" and info["initialized"]]
            paged = {n for n in tensors if n.endswith(_PAGED) and n.startswith(tuple(f"layers.{i}." for i in tq))}
            quantized = [infos[i]["quantized"] for i in tq]
        m = (min(quantized) if quantized else 0) // self.page_tokens
        # the layer layout every row's endpoint is stored under (one for the batch: the rows share their layers)
        layout = hashlib.sha256(json.dumps(infos, sort_keys=True, default=str).encode()).hexdigest()
        return sum(self._insert_row(ids, {k: v[r: r + 1] for k, v in tensors.items()}, infos, layout, paged, m)
                   for r, ids in enumerate(rows))

    def _insert_row(self, ids: torch.Tensor, tensors: dict, infos: list[dict], layout: str, paged: set,
                    m: int) -> int:
        P = self.page_tokens
        tkeys = page_keys(ids[: m * P], P, self.namespace)
        mu = _means_digest(tensors)
        keys = _bind(tkeys, mu)
        payloads = {k: _slice_pages(tensors, paged, p * P, (p + 1) * P) for p, k in enumerate(keys)}
        snap_key = self._snapshot_key(keys, ids[m * P:], mu)
        payloads[snap_key] = {"tensors": _slice_pages(tensors, paged, m * P, None, rest=True), "infos": infos,
                              "num_tokens": ids.numel()}
        chain = keys + [snap_key]
        with self._lock:
            actions = self.index.insert(chain, [_nbytes(payloads[k]) for k in chain])
            self._apply(actions, payloads)
            if snap_key in self._held:
                parent = tkeys[-1] if tkeys else _ROOT
                self._ends.setdefault(parent, {})[snap_key] = (ids.numel(), mu, layout)
                self._parent_of[snap_key] = parent
            return sum(a.kind == "store" and a.key != snap_key for a in actions)

    # ---- match ----

    def match(self, input_ids):
        """(cache, n): a TurboQuantCache (a TurboQuantStaticCache for a store of `max_cache_len`) holding the longest
        stored endpoint of `input_ids` that leaves at least its last token to compute, and its length n; (an empty
        cache, 0) when none is stored. For a batch (batch, len), each row matches on its own and n is the longest
        length at which every row has a stored endpoint of one layout (how many tokens each layer holds packed and
        exact: one cache holds them alike)."""
        rows = _rows(input_ids)
        P = self.page_tokens
        with self._lock:
            self._counts["lookups"] += len(rows)
            found = [self._endpoints(ids, page_keys(ids, P, self.namespace)) for ids in rows]
            chains, length = None, 0
            for n in sorted(set.intersection(*(set(f) for f in found)), reverse=True):
                layouts = set.intersection(*(set(f[n]) for f in found))
                if layouts:
                    layout = min(layouts)
                    chains, length = [f[n][layout] for f in found], n
                    break
            if chains is None:
                return self._new_cache(), 0
            keys = list(dict.fromkeys(k for chain in chains for k in chain))  # rows share pages: each loaded once
            self.index.match(keys)  # used now: pages and snapshots move to the front of their tiers
            self.index.pin(keys)
            try:  # disk pages are read and checked on threads (file reads and hashing release the GIL)
                on_disk = [k for k in keys if isinstance(self._held[k], str)]
                loaded = {k: self._held[k] for k in keys if not isinstance(self._held[k], str)}
                if on_disk and self._staged_reads:
                    loaded.update(self._load_staged(on_disk))
                elif on_disk:
                    with ThreadPoolExecutor(max(1, min(16, os.cpu_count() or 1, len(on_disk)))) as pool:
                        loaded.update(zip(on_disk, pool.map(lambda k: self._load(k, copy=False), on_disk)))
            finally:
                self.index.unpin(keys)
            self._counts["hits"] += len(rows)
            self._counts["tokens_reused"] += length * len(rows)
        return self._restore([[loaded[k] for k in chain] for chain in chains]), length

    def _endpoints(self, ids: torch.Tensor, tkeys: list[str]) -> dict[int, dict[str, list[str]]]:
        """{length: {layout: chain (page keys, then the snapshot's)}} of every held endpoint that `ids` extends
        past."""
        P = self.page_tokens
        out: dict[int, dict[str, list[str]]] = {}
        bound: dict[tuple[int, str | None], list[str]] = {}
        for m in range(len(tkeys), -1, -1):
            for snap, (length, mu, layout) in self._ends.get(tkeys[m - 1] if m else _ROOT, {}).items():
                if length >= ids.numel() or layout in out.get(length, {}) or snap not in self._held:
                    continue
                keys = bound.get((m, mu))
                if keys is None:
                    keys = bound[(m, mu)] = _bind(tkeys[:m], mu)
                if self.index.match(keys, touch=False) == m and snap == self._snapshot_key(keys, ids[m * P: length], mu):
                    out.setdefault(length, {})[layout] = keys + [snap]
        return out

    def stats(self) -> dict:
        """Lookups, hits (prefixes restored), tokens reused; pages and bytes per tier, pages stored, moved, dropped
        (the index's counts); the tiers."""
        with self._lock:
            out = self.index.stats()
            out.pop("pages_matched")  # the index's own lookups: the store's count restored prefixes instead
            out.update(self._counts)
            out["tiers"] = [str(t) for t in self.tiers]
            return out

    # ---- internals ----

    def _snapshot_key(self, keys: list[str], rest, mu: str | None) -> str:
        parent = keys[-1] if keys else self.namespace + (mu or "")
        return hashlib.sha256(b"end:" + parent.encode() + token_bytes(rest)).hexdigest()

    def _apply(self, actions, payloads: dict) -> None:
        """Carry out the index's actions: store new pages, move pages down a tier, drop pages."""
        for a in actions:
            if a.kind == "store":
                self._held[a.key] = self._put(a.key, payloads[a.key], a.to)
            elif a.kind == "move":
                self._held[a.key] = self._put(a.key, self._load(a.key), a.to)
            elif a.kind == "drop":
                self._forget(a.key)

    def _put(self, key: str, payload: dict, tier: int):
        where = self.tiers[tier]
        if where != "disk":
            return _to(payload, where)
        flat, meta = _flatten(payload)
        blob = _io.safetensors_bytes(flat, metadata={"key": key})
        path = os.path.join(self.disk_dir, f"{key}.safetensors")
        _io.write_bytes(path, blob)
        self._on_disk[key] = (_io.sha256_bytes(blob), meta)
        return path

    def _load(self, key: str, copy: bool = True) -> dict:
        """A page's payload in memory (read once, checked and parsed when it is on disk); `copy=False`: a disk
        page's tensors are views of its file's mapping, for `_restore`, which copies them out once, joined."""
        held = self._held[key]
        if not isinstance(held, str):
            return held
        # one mapping, hashed, then parsed, as prefix.py reads its tensors (16 threads loading a 32k prefix's 128
        # pages, one run each on H100 hosts: 0.69 s; read into a bytearray 1.47 s, into anonymous memory 0.93 s)
        data = _io.map_file(held)
        self._check_digest(key, held, data)
        return _unflatten(_io.parse_safetensors(data, held, copy=copy), self._on_disk[key][1])

    def _check_digest(self, key: str, path: str, data) -> None:
        """A page file's bytes as read are the ones this store wrote, or a ValueError naming the file."""
        if _io.sha256_bytes(data) != self._on_disk[key][0]:
            raise ValueError(f"{path}: the page file differs from the one this store wrote (changed or replaced)")

    def _stage_halves(self, nbytes: int) -> None:
        pin = torch.cuda.is_available()
        self._staging = []  # (the old halves go before bigger ones are made)
        self._staging = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]

    def _load_staged(self, keys: list[str]) -> dict[str, dict]:
        """Disk pages' payloads on the store's device: the files read whole (no mapping: no page faults) on threads
        into one of two host halves (pinned where CUDA is), each file checked (SHA-256) and its header parsed there;
        a full half is copied to its place in one device buffer while the other fills; each tensor is one strided
        view of that buffer. Called under the store's lock, which guards the halves: every copy is complete when this
        returns. (The device buffer holds the pages while `_restore` joins them: a restore's peak is twice its
        bytes.)"""
        sizes = [os.path.getsize(self._held[k]) for k in keys]
        padded = [-(-n // 8) * 8 for n in sizes]  # each file at an 8-byte boundary: its tensors stay aligned
        if not self._staging or self._staging[0].numel() < max(padded):
            self._stage_halves(max(STAGING_BYTES, max(padded)))
        half = self._staging[0].numel()
        starts, groups = [0], [[]]  # files' places in the device buffer; runs of files that fit a half
        for i, n in enumerate(padded):
            if groups[-1] and starts[-1] + n - starts[groups[-1][0]] > half:
                groups.append([])
            groups[-1].append(i)
            starts.append(starts[-1] + n)
        total = starts[-1]
        dev = torch.empty(max(total, 8), dtype=torch.uint8, device=self.device)
        cuda = self.device.type == "cuda"
        done = [None, None]  # each half's copy-finished event
        views = [memoryview(h.numpy()) for h in self._staging]

        def read(h: int, first: int, i: int) -> tuple[int, dict]:
            key, path = keys[i], self._held[keys[i]]
            part = views[h][starts[i] - starts[first]: starts[i] - starts[first] + sizes[i]]
            with open(path, "rb") as f:
                if f.readinto(part) != sizes[i] or f.read(1):
                    raise ValueError(f"{path}: the page file changed size while it was read")
            self._check_digest(key, path, part)
            return _io.safetensors_layout(part, path)

        parsed = [None] * len(keys)
        try:
            with ThreadPoolExecutor(max(1, min(16, os.cpu_count() or 1, len(keys)))) as pool:
                for g, group in enumerate(groups):
                    h = g % 2
                    if done[h] is not None:
                        done[h].synchronize()  # this half's last copy has left it
                    first = group[0]
                    for i, lay in zip(group, pool.map(lambda i: read(h, first, i), group)):
                        parsed[i] = lay
                    n = starts[group[-1] + 1] - starts[first]
                    dev[starts[first]: starts[first] + n].copy_(self._staging[h][:n], non_blocking=cuda)
                    if cuda:
                        done[h] = torch.cuda.Event()
                        done[h].record(torch.cuda.current_stream(self.device))
        finally:
            for e in done:
                if e is not None:
                    e.synchronize()  # the halves are free for the next restore, whatever happened
        typed: dict[torch.dtype, torch.Tensor] = {}
        out = {}
        for key, at, (base, layout) in zip(keys, starts, parsed):
            tensors = {}
            for name, (dtype, shape, start, end) in layout.items():
                first = at + base + start
                if first % dtype.itemsize:  # (not from this store's writer: copied out)
                    tensors[name] = dev[first: at + base + end].clone().view(dtype).view(shape)
                    continue
                flat = typed.get(dtype)
                if flat is None:
                    flat = typed[dtype] = dev[: dev.numel() // dtype.itemsize * dtype.itemsize].view(dtype)
                stride, acc = [], 1
                for n in reversed(shape):
                    stride.append(acc)
                    acc *= n
                tensors[name] = flat.as_strided(shape, stride[::-1], first // dtype.itemsize)
            out[key] = _unflatten(tensors, self._on_disk[key][1])
        return out

    def _forget(self, key: str) -> None:
        held = self._held.pop(key, None)
        self._on_disk.pop(key, None)
        if isinstance(held, str) and os.path.exists(held):
            os.remove(held)
        parent = self._parent_of.pop(key, None)
        if parent is not None:
            ends = self._ends.get(parent, {})
            ends.pop(key, None)
            if not ends:
                self._ends.pop(parent, None)

    def _new_cache(self):
        from .cache import TurboQuantCache
        from .static_cache import TurboQuantStaticCache

        if self.max_cache_len is None:
            return TurboQuantCache(self.tq_config, config=self.config, codebooks=self.codebooks)
        return TurboQuantStaticCache(self.config, self.max_cache_len, tq_config=self.tq_config, codebooks=self.codebooks)

    def _restore(self, rows: list[list[dict]]):
        """A cache of the rows' chains (each: pages, then the snapshot), stacked along the batch."""
        snaps = [chain[-1] for chain in rows]
        if any(s["infos"] != snaps[0]["infos"] for s in snaps[1:]):
            raise ValueError("the rows' snapshots describe different layers: they cannot share one cache")
        cache = self._new_cache()
        facts = model_facts(self.config)
        doc = {"batch": len(rows), "num_tokens": snaps[0]["num_tokens"]}
        tensors = {}
        for name in snaps[0]["tensors"]:  # per row: pages then the snapshot's part, along the tokens
            per_row = []
            for chain in rows:
                parts = [p[name] for p in chain[:-1] if name in p] + [chain[-1]["tensors"][name]]
                if all(t.device.type == "cpu" and not t.is_pinned() for t in parts):
                    # pages read from disk (or a CPU-only machine): joined here, then one copy, not one a page
                    # (through pinned memory it was slower on the H100 host: 0.57 s against 0.43 for 1.1 GB)
                    per_row.append(torch.cat(parts, dim=2).to(self.device))
                else:  # pinned or device pages: each copied asynchronously, joined by one kernel there
                    per_row.append(torch.cat([t if t.device == self.device else t.to(self.device, non_blocking=True)
                                              for t in parts], dim=2))
            tensors[name] = torch.cat(per_row, dim=0) if len(per_row) > 1 else per_row[0]
        if self.max_cache_len is not None:
            _restore_static(cache, snaps[0]["infos"], tensors, len(rows), self.device)
            return cache

        def get(name, shape, dtype, i):
            t = tensors[name]
            if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                raise ValueError(f"the store's layer {i} tensor {name!r} is {tuple(t.shape)} {t.dtype}, expected "
                                 f"{tuple(shape)} {dtype}")
            return t

        for i, (layer, info) in enumerate(zip(cache.layers, snaps[0]["infos"])):
            info = {**info, "batch": len(rows)} if "batch" in info else info
            _restore_layer(layer, i, info, doc, facts, get, "the prefix store", self.device)
        return cache


def _rows(input_ids) -> torch.Tensor:
    """(batch, n) int64 token ids on the CPU, from (n,) or (batch, n)."""
    t = torch.as_tensor(input_ids).detach().cpu()
    if t.dim() == 1:
        t = t[None]
    if t.dim() != 2 or t.shape[0] == 0:
        raise ValueError(f"input_ids must be (n,) or (batch, n) token ids; got shape {tuple(t.shape)}")
    return t.to(torch.int64)


_PAGED = ("_packed", "_norms")


_STATIC_PAGED = ("k_packed", "k_norms", "v_packed", "v_norms")  # a static layer's parts with a row per position


def _check_static(cache) -> None:
    from .static_cache import TurboQuantStaticLayer

    other = [(i, type(layer).__name__) for i, layer in enumerate(cache.layers)
             if not isinstance(layer, TurboQuantStaticLayer)]
    if other:
        raise ValueError(f"a PrefixStore of static caches takes models whose every layer is a quantized full-attention "
                         f"layer; layers {other[:4]} are not (use the store without max_cache_len)")


def _static_state(cache, batch: int) -> tuple[dict, list[dict], set]:
    """(tensors, infos, paged names) of a TurboQuantStaticCache: every layer's state (`TurboQuantStaticLayer.state`),
    the lengths in the infos."""
    _check_static(cache)
    tensors, infos, paged = {}, [], set()
    for i, layer in enumerate(cache.layers):
        if not layer.is_initialized:
            infos.append({"class": "TurboQuantStaticLayer", "initialized": False})
            continue
        if layer.batch_size != batch:
            raise ValueError(f"layer {i} holds batch {layer.batch_size} but token_ids has batch {batch}")
        state = layer.state()
        length, exact_from = (int(x) for x in state.pop("lengths"))
        for name, t in state.items():
            tensors[f"layers.{i}.{name}"] = t[:, :, :length] if name.startswith(_STATIC_PAGED) else t
            if name.startswith(_STATIC_PAGED):
                paged.add(f"layers.{i}.{name}")
        infos.append({"class": "TurboQuantStaticLayer", "initialized": True, "dtype": str(layer.dtype),
                      "heads": layer.num_heads, "head_dim": layer.k_head_dim, "length": length,
                      "exact_from": exact_from, "digest": quantizer_digest(*layer._quantizers, layer.key_split)})
    return tensors, infos, paged


def _restore_static(cache, infos: list[dict], tensors: dict, batch: int, device) -> None:
    """Write a snapshot's tensors into a fresh TurboQuantStaticCache's layers (each initialized to the stored shape)."""
    for i, (layer, info) in enumerate(zip(cache.layers, infos)):
        if not info["initialized"]:
            continue
        dtype = getattr(torch, info["dtype"].removeprefix("torch."))
        x = torch.zeros(batch, info["heads"], 1, info["head_dim"], dtype=dtype, device=device)
        layer.lazy_initialization(x, x)
        if quantizer_digest(*layer._quantizers, layer.key_split) != info["digest"]:
            raise ValueError(f"the store's static layer {i} was quantized with other rotations or codebooks than this "
                             "cache's")
        state = layer.state()
        old = state.pop("lengths")
        for name, view in state.items():
            t = tensors[f"layers.{i}.{name}"]
            dst = view[:, :, : info["length"]] if name.startswith(_STATIC_PAGED) else view
            if tuple(dst.shape) != tuple(t.shape) or dst.dtype != t.dtype:
                raise ValueError(f"the store's layer {i} tensor {name!r} is {tuple(t.shape)} {t.dtype}, this cache's "
                                 f"{tuple(dst.shape)} {dst.dtype}")
            dst.copy_(t)
        old.copy_(torch.tensor([info["length"], info["exact_from"]], dtype=torch.int64))
        layer._mu_pending = False  # the key mean, when there is one, came with the state


def _means_digest(tensors: dict) -> str | None:
    """SHA-256 of a row's key means (centred layers), None without: a centred layer's codes depend on its mean, which
    the tokens of the cache's first quantized block set, so pages are shared only between caches of equal means."""
    names = sorted(n for n in tensors if n.endswith(".key_mean"))
    if not names:
        return None
    h = hashlib.sha256()
    for n in names:
        h.update(n.encode() + tensors[n].detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _bind(keys: list[str], mu: str | None) -> list[str]:
    """The page keys of tokens' keys under key means `mu` (the keys themselves without)."""
    return keys if mu is None else [hashlib.sha256((k + mu).encode()).hexdigest() for k in keys]


def _slice_pages(tensors: dict, paged: set, start: int, stop: int | None, rest: bool = False) -> dict:
    """Positions [start, stop) (axis 2) of the tensors named in `paged` (a page); with `rest`, also every other
    stored tensor whole (the snapshot's parts). Views: `_to` copies the pages the index stores, only those."""
    out = {}
    for name, t in tensors.items():
        if name in paged:
            out[name] = t[:, :, start:stop]
        elif rest:
            out[name] = t
    return out


def _nbytes(payload: dict) -> int:
    """The bytes of a page's (or a snapshot's) tensors."""
    tensors = payload["tensors"] if "tensors" in payload else payload
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _to(payload: dict, device) -> dict:
    if "tensors" in payload:
        return {**payload, "tensors": _to(payload["tensors"], device)}
    pin = device.type == "cpu" and torch.cuda.is_available()

    def copy(v):  # always a copy of its own: a page never holds on to (or aliases) a cache's buffer
        if pin:
            return torch.empty(v.shape, dtype=v.dtype, pin_memory=True).copy_(v)
        return v.to(device, copy=True)

    return {k: copy(v) for k, v in payload.items()}


def _flatten(payload: dict) -> tuple[dict, dict]:
    if "tensors" in payload:
        return {k: v.contiguous().cpu() for k, v in payload["tensors"].items()}, {
            k: v for k, v in payload.items() if k != "tensors"}
    return {k: v.contiguous().cpu() for k, v in payload.items()}, {}


def _unflatten(tensors: dict, meta: dict) -> dict:
    return {**meta, "tensors": tensors} if meta else tensors
