"""The index of a prompt-prefix store: which pages of tokens are held, in which tier, and which to move down or drop.

A page is `page_tokens` consecutive tokens of a prompt, keyed by a chained hash (`page_keys`): page i's key binds
every token before it and the store's namespace (the model's weights, the quantization config and the codebooks), so
equal keys mean equal prefixes of one model and config, and a lookup is a walk down the chain. The index holds no
tensors: it says where each page lives (tier 0 is the fastest, e.g. GPU, then pinned CPU, then disk) and returns the
moves its capacity rules need, for the store to carry out:

- a new page enters tier 0; when a tier holds more bytes than it may, its least recently used unpinned page moves one
  tier down, and from the last tier the least recently used unpinned page without a held child is dropped (dropping
  a page inside a chain would strand the pages after it);
- pinned pages (those a live cache is built from) are never moved or dropped;
- a page that cannot fit anywhere is not stored, and the insert says so.

Each tier keeps a heap of (last use, key) entries, checked when popped (a moved, touched, pinned or dropped page's
old entries are stale and skipped), so finding a victim costs O(log n), not a scan of every page. A page may count
other bytes in the file tier (a disk folder's file, headers included) than in memory. Changes between `begin` and
`commit` are journaled, so `rollback` puts every page an insert stored, moved or dropped back where it was (the
store does this when a disk write fails). Thread-safe: one lock around every call.
"""

from __future__ import annotations

import hashlib
import heapq
import threading
from dataclasses import dataclass, field
from typing import Sequence

import torch

__all__ = ["page_keys", "PrefixIndex", "Action"]


def token_bytes(token_ids) -> bytes:
    """Token ids as the int64 little-endian bytes the keys hash."""
    return torch.as_tensor(token_ids, dtype=torch.int64).detach().cpu().contiguous().numpy().astype("<i8").tobytes()


def page_keys(token_ids, page_tokens: int, namespace: str) -> list[str]:
    """The chained keys of the whole pages of a 1-D sequence of token ids: key_i = SHA-256(key_(i-1) + the int64
    little-endian bytes of page i), key_(-1) = SHA-256(namespace). A partial last page has no key."""
    if isinstance(page_tokens, bool) or not isinstance(page_tokens, int) or page_tokens < 1:
        raise ValueError(f"page_tokens must be an integer >= 1, got {page_tokens!r}")
    t = torch.as_tensor(token_ids, dtype=torch.int64).detach().cpu()
    if t.dim() != 1:
        raise ValueError(f"token_ids must be one sequence (1-D), got shape {tuple(t.shape)}")
    data = token_bytes(t)
    key = hashlib.sha256(namespace.encode("utf-8")).digest()
    keys = []
    step = 8 * page_tokens
    for i in range(t.numel() // page_tokens):
        key = hashlib.sha256(key + data[i * step:(i + 1) * step]).digest()
        keys.append(key.hex())
    return keys


@dataclass(frozen=True)
class Action:
    """What the store must do: `store` a new page into `to`; `move` a page from tier `src` to `to`; `drop` it from
    `src`; `skip` a new page that fits nowhere (it is not held)."""

    kind: str
    key: str
    src: int | None = None
    to: int | None = None


@dataclass
class _Page:
    parent: str | None
    tier: int
    nbytes: int
    file_nbytes: int
    used: int
    pins: int = 0
    children: set = field(default_factory=set)
    pack: str | None = None  # in the file tier: the pack (one file of several pages) that holds it

    def copy(self) -> "_Page":
        """The page's place and sizes (not its pins or children), as a journal keeps them."""
        return _Page(self.parent, self.tier, self.nbytes, self.file_nbytes, self.used, pack=self.pack)


@dataclass
class _Pack:
    """A file of the file tier: the pages it holds now, their bytes and the file's. An open pack (the one a
    transaction is filling) grows and shrinks with the pages that enter and leave it; a closed one is written and
    keeps its bytes until its last page leaves."""

    keys: set = field(default_factory=set)
    live_bytes: int = 0
    nbytes: int = 0
    open: bool = True


class _Holdings:
    """Where each page is and what each tier counts: the moves every change of the index is made of (a page added,
    removed, or placed in another tier or pack), each counted, journaled and entered into its tier's LRU heap."""

    def __init__(self, caps: list[int], file_tier: int | None):
        self.capacity = caps
        self.file_tier = file_tier
        self._pages: dict[str, _Page] = {}
        self._held = [0] * len(caps)
        self._count = [0] * len(caps)
        self._pinned = 0  # pages with pins
        self._lru = _Lru(len(caps))
        self._clock = 0
        self._journal = _Journal()
        self._packs = _Packs()

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _enter(self, key: str, page: _Page) -> None:
        """Count a page into its tier (the file tier counts packs: a pack's bytes while it holds a page)."""
        self._count[page.tier] += 1
        self._held[page.tier] += self._packs.enter(key, page) if page.tier == self.file_tier else page.nbytes

    def _leave(self, key: str, page: _Page) -> None:
        self._count[page.tier] -= 1
        self._held[page.tier] -= self._packs.leave(key, page) if page.tier == self.file_tier else page.nbytes

    def _note(self, key: str, page: _Page | None) -> None:
        self._journal.note(key, page)

    def _push(self, key: str, page: _Page) -> None:
        self._lru.push(page.tier, page.used, key, self._count[page.tier], self._pages)

    def _touch(self, keys: Sequence[str]) -> None:
        for k in keys:  # in chain order: a chain's later pages count as used later
            page = self._pages[k]
            page.used = self._tick()
            self._push(k, page)

    def _add(self, key: str, page: _Page) -> None:
        self._note(key, None)
        self._pages[key] = page
        self._enter(key, page)
        if page.parent is not None:
            self._pages[page.parent].children.add(key)
        self._push(key, page)

    def _remove(self, key: str) -> None:
        page = self._pages.pop(key)
        self._pinned -= page.pins > 0
        self._note(key, page)
        self._leave(key, page)
        parent = self._pages.get(page.parent) if page.parent is not None else None
        if parent is not None:
            parent.children.discard(key)
            if not parent.children:
                self._push(page.parent, parent)  # a leaf now: the last tier may drop it

    def _place(self, key: str, page: _Page, tier: int, pack: str | None = None) -> None:
        """Move a page to `tier` (into `pack` there, when it is the file tier: by default the open one)."""
        self._note(key, page)
        self._leave(key, page)
        page.tier, page.pack = tier, pack
        self._enter(key, page)
        self._push(key, page)


class PrefixIndex(_Holdings):
    """Pages held per tier under byte capacities (`tier_bytes`, fastest first), least recently used first out.

    Args:
        tier_bytes: the bytes each tier may hold, e.g. `[gpu_bytes, cpu_bytes, disk_bytes]`.
        page_tokens: tokens per page (for the stats' token counts).
        file_tier: the tier whose pages live in files (`insert`'s `file_bytes`), None for none. Its pages are
            held in packs, a file each: a transaction's pages that enter the file tier share its pack (`begin`),
            pages outside one have a pack each. The tier counts a pack's whole bytes until its last page leaves,
            so what it counts is what its files hold.

    Example:
        >>> index = PrefixIndex([2 << 20, 8 << 20], page_tokens=256)
        >>> keys = page_keys(list(range(1024)), 256, "model-and-config-digest")
        >>> [a.kind for a in index.insert(keys, page_bytes=1 << 20)]
        ['store', 'store', 'store', 'move', 'store', 'move']
        >>> index.match(keys), index.stats()["pages"]
        (4, [2, 2])
    """

    def __init__(self, tier_bytes: Sequence[int], page_tokens: int = 1, file_tier: int | None = None):
        caps = list(tier_bytes)
        if not caps or any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in caps):
            raise ValueError(f"tier_bytes must be a non-empty list of byte counts >= 0, got {tier_bytes!r}")
        if isinstance(page_tokens, bool) or not isinstance(page_tokens, int) or page_tokens < 1:
            raise ValueError(f"page_tokens must be an integer >= 1, got {page_tokens!r}")
        if file_tier is not None and file_tier not in range(len(caps)):
            raise ValueError(f"file_tier must be None or a tier in [0, {len(caps) - 1}], got {file_tier!r}")
        super().__init__(caps, file_tier)
        self.page_tokens = page_tokens
        self._lock = threading.Lock()
        self._stats = {"lookups": 0, "hits": 0, "pages_matched": 0, "stored": 0, "moved": 0, "dropped": 0,
                       "skipped": 0}

    # ---- queries ----

    def match(self, keys: Sequence[str], touch: bool = True) -> int:
        """How many leading pages of `keys` are held (in any tier); they count as used now (with `touch`; without,
        nothing changes, the counts included)."""
        with self._lock:
            n = 0
            while n < len(keys) and keys[n] in self._pages:
                n += 1
            if not touch:
                return n
            self._touch(keys[:n])
            self._stats["lookups"] += 1
            self._stats["hits"] += n > 0
            self._stats["pages_matched"] += n
            return n

    def tier_of(self, key: str) -> int | None:
        with self._lock:
            page = self._pages.get(key)
            return None if page is None else page.tier

    def sizes_of(self, key: str) -> tuple[int, int] | None:
        """(bytes in memory, bytes as a file) of a held page."""
        with self._lock:
            page = self._pages.get(key)
            return None if page is None else (page.nbytes, page.file_nbytes)

    def parent_of(self, key: str) -> str | None:
        with self._lock:
            return self._pages[key].parent

    def stats(self) -> dict:
        """Lookups, hits, tokens reused, pages and bytes per tier, and the pages stored, moved, dropped, skipped."""
        with self._lock:
            out = dict(self._stats)
            out["tokens_reused"] = out["pages_matched"] * self.page_tokens
            out["bytes"] = list(self._held)
            out["pages"] = list(self._count)
            out["pinned"] = self._pinned
            return out

    # ---- changes ----

    def insert(self, keys: Sequence[str], page_bytes: int | Sequence[int],
               file_bytes: int | Sequence[int] | None = None) -> list[Action]:
        """Hold the pages of `keys` (a prefix's chain, from its first page): those held already count as used,
        new ones enter tier 0 (`page_bytes` each, or one size per key; `file_bytes` likewise in the file tier,
        `page_bytes` when None), and the tiers are brought back under their capacities. Returns the actions in the
        order the store must carry them out. Stops at the first page that fits nowhere (it and the pages after it
        are skipped: a chain with a gap cannot be matched past it)."""
        sizes = _sizes(page_bytes, keys, "page_bytes")
        files = sizes if file_bytes is None else _sizes(file_bytes, keys, "file_bytes")
        with self._lock:
            actions: list[Action] = []
            parent = None
            for i, key in enumerate(keys):
                page = self._pages.get(key)
                if page is not None:
                    if page.parent != parent:
                        raise ValueError(f"page {i} of the chain is held under another parent: keys from different "
                                         "chains (page_keys builds a chain from a prefix's first page)")
                    self._touch([key])
                    parent = key
                    continue
                self._add(key, _Page(parent, 0, sizes[i], files[i], self._tick()))
                made = self._fit(0, protect=key)  # the new page may move down, never out
                if made is None:
                    self._remove(key)
                    actions.extend(Action("skip", k) for k in keys[i:])
                    self._stats["skipped"] += len(keys) - i
                    break
                actions.append(Action("store", key, to=self._pages[key].tier))  # where it ended up
                actions.extend(a for a in made if a.key != key)
                self._stats["stored"] += 1
                parent = key
            return actions

    def adopt(self, key: str, parent: str | None, tier: int, page_bytes: int, file_bytes: int,
              pack: str | None = None, pack_bytes: int = 0) -> None:
        """Hold a page found where a store keeps its pages (a disk folder left by an earlier store), as used now;
        its parent must be held. In the file tier it is in `pack`, a file of `pack_bytes`. `fit` brings the tiers
        back under their capacities afterwards."""
        with self._lock:
            if key in self._pages:
                raise ValueError(f"page {key[:12]} is held already")
            if parent is not None and parent not in self._pages:
                raise ValueError(f"page {key[:12]}'s parent {parent[:12]} is not held")
            if tier == self.file_tier:
                if pack is None:
                    raise ValueError("a page adopted into the file tier needs its pack")
                self._packs.packs.setdefault(pack, _Pack(nbytes=pack_bytes, open=False))
            self._add(key, _Page(parent, tier, page_bytes, file_bytes, self._tick(),
                                 pack=pack if tier == self.file_tier else None))

    def fit(self) -> list[Action]:
        """The moves and drops that bring every tier under its capacity (pinned pages stay; what cannot be brought
        under stays over, and a later insert tries again)."""
        with self._lock:
            actions: list[Action] = []
            for t in range(len(self.capacity)):
                while self._held[t] > self.capacity[t]:
                    made = self._evict_one(t)
                    if made is None:
                        break
                    actions += made
            return actions

    def remove_subtree(self, key: str) -> list[str]:
        """Forget `key` and every page that hangs on it (pinned ones too: the caller knows they are unusable);
        returns the keys forgotten, parents before children."""
        with self._lock:
            if key not in self._pages:
                return []
            order, todo = [], [key]
            while todo:
                k = todo.pop()
                order.append(k)
                todo.extend(self._pages[k].children)
            for k in reversed(order):
                self._remove(k)
            return order

    def pin(self, keys: Sequence[str]) -> None:
        """Keep these pages where they are until `unpin` (a live cache reads them)."""
        with self._lock:
            missing = [k for k in keys if k not in self._pages]
            if missing:
                raise KeyError(f"cannot pin pages not held: {missing[:3]}")
            for k in keys:
                page = self._pages[k]
                self._pinned += not page.pins
                page.pins += 1

    def unpin(self, keys: Sequence[str], forgotten_ok: bool = False) -> None:
        """Undo a `pin`. With `forgotten_ok`, pages forgotten meanwhile (`remove_subtree`), or forgotten and stored
        anew (unpinned), are passed over."""
        with self._lock:
            bad = [] if forgotten_ok else [k for k in keys if k not in self._pages or self._pages[k].pins == 0]
            if bad:
                raise KeyError(f"cannot unpin pages not pinned: {bad[:3]}")
            for k in keys:
                page = self._pages.get(k)
                if page is not None and page.pins:
                    page.pins -= 1
                    if not page.pins:
                        self._pinned -= 1
                        self._push(k, page)

    # ---- transactions ----

    def begin(self, pack: str | None = None) -> None:
        """Journal every page the next changes store, move or drop, until `commit` or `rollback`; the pages they
        move into the file tier go into the new pack `pack` (each into a pack of its own when None)."""
        with self._lock:
            if pack is not None and pack in self._packs.packs:
                raise ValueError(f"pack {pack!r} exists already")
            self._journal.begin(self._stats)
            self._packs.open = pack

    def commit(self) -> None:
        """Keep the changes; the transaction's pack is written now (its bytes are final)."""
        with self._lock:
            self._journal.end()
            self._packs.close()

    def rollback(self) -> None:
        """Put every page changed since `begin` back as it was (its use time and pins stay as they are now)."""
        with self._lock:
            pack, self._packs.open = self._packs.open, None
            self._journal.undo(self)
            self._packs.forget(pack)  # (empty now, and never written)

    # ---- packs ----

    def pack_of(self, key: str) -> str | None:
        with self._lock:
            page = self._pages.get(key)
            return None if page is None else page.pack

    def pack_bytes(self, pack: str) -> int | None:
        """The bytes of a pack (what its file holds), None for a pack the index does not hold."""
        with self._lock:
            p = self._packs.packs.get(pack)
            return None if p is None else p.nbytes

    def take_emptied(self) -> list[str]:
        """The packs whose last page left since the last call (not ones a page entered again): their files can be
        removed."""
        with self._lock:
            return self._packs.take_emptied()

    # ---- eviction (the lock is held) ----

    def _evict_one(self, t: int, protect: str | None = None, saved: list | None = None) -> list[Action] | None:
        """Move the least recently used unpinned page of tier `t` one tier down (drop it from the last tier, where
        only pages without a held child may leave); None when there is none. Each page changed goes into `saved`
        as it was, first."""
        last = t == len(self.capacity) - 1
        victim = self._lru.victim(t, self._pages, leaves_only=last, protect=protect)
        if victim is None:
            return None
        page = self._pages[victim]
        pack = page.pack
        if saved is not None:
            saved.append((victim, page.copy()))
        if last:
            self._remove(victim)
            out = [Action("drop", victim, src=t)]
        else:
            self._place(victim, page, t + 1)
            out = [Action("move", victim, src=t, to=t + 1)]
        return out + (self._compact(pack, saved) if t == self.file_tier else [])

    def _compact(self, pack: str, saved: list | None) -> list[Action]:
        """When at most half of a closed pack's bytes are pages still held, those pages move into the open pack
        (the store writes them again there), so the pack's file can go and its dead bytes stop counting: the file
        tier never spends more than half of what it counts on pages that left. Not while a page of it is pinned."""
        keys = self._packs.sparse(pack)
        pages = sorted((self._pages[k].used, k) for k in keys)
        if any(self._pages[k].pins for _, k in pages):
            return []
        out = []
        for _, k in pages:
            if saved is not None:
                saved.append((k, self._pages[k].copy()))
            self._place(k, self._pages[k], self.file_tier, self._packs.open)
            out.append(Action("move", k, src=self.file_tier, to=self.file_tier))
        return out

    def _fit(self, tier: int, protect: str | None = None) -> list[Action] | None:
        """Moves and drops that bring `tier` and the tiers below it back under capacity, carried out on the index;
        None, with every one of them undone, when pinned pages alone exceed a tier."""
        actions: list[Action] = []
        saved: list[tuple[str, _Page]] = []
        last = len(self.capacity) - 1
        for t in range(tier, last + 1):
            while self._held[t] > self.capacity[t]:
                made = self._evict_one(t, protect=protect if t == last else None, saved=saved)
                if made is None:
                    for key, page in reversed(saved):
                        self._undo(key, page)
                    return None
                actions += made
        self._stats["moved"] += sum(a.kind == "move" and a.key != protect for a in actions)
        self._stats["dropped"] += sum(a.kind == "drop" for a in actions)
        return actions

    def _undo(self, key: str, saved: _Page) -> None:
        """Put a page back as it was before a move or drop of `_fit`."""
        page = self._pages.get(key)
        if page is None:  # dropped
            self._add(key, saved.copy())
        else:  # moved
            self._place(key, page, saved.tier, saved.pack)


class _Packs:
    """The file tier's packs, and the one the open transaction fills (`open`; None: each page a pack of its
    own). Counts what the tier holds: a pack's whole bytes while any page of it is held."""

    def __init__(self):
        self.packs: dict[str, _Pack] = {}
        self.open: str | None = None
        self._emptied: set[str] = set()  # packs whose last page left: their files can go

    def enter(self, key: str, page: _Page) -> int:
        """Put a page into its pack (the open one, when it has none); returns the bytes the tier counts more."""
        if page.pack is None:
            page.pack = self.open or key
        p = self.packs.setdefault(page.pack, _Pack())
        before = p.nbytes if p.keys else 0
        p.nbytes += page.file_nbytes if p.open else 0
        p.keys.add(key)
        p.live_bytes += page.file_nbytes
        return p.nbytes - before

    def leave(self, key: str, page: _Page) -> int:
        """Take a page out of its pack; returns the bytes the tier counts less."""
        p = self.packs[page.pack]
        before = p.nbytes if p.keys else 0
        p.nbytes -= page.file_nbytes if p.open else 0
        p.keys.discard(key)
        p.live_bytes -= page.file_nbytes
        if not p.keys:
            self._emptied.add(page.pack)
        return before - (p.nbytes if p.keys else 0)

    def sparse(self, pack: str) -> set[str]:
        """The pages of a closed pack that holds at most half its bytes, when there is an open pack to move them
        into; none otherwise."""
        p = self.packs.get(pack)
        if p is None or p.open or self.open is None or 2 * p.live_bytes > p.nbytes:
            return set()
        return set(p.keys)

    def close(self) -> None:
        """The open pack is written: its bytes are final."""
        if self.open in self.packs:
            self.packs[self.open].open = False
        self.open = None

    def forget(self, pack: str | None) -> None:
        self.packs.pop(pack, None)
        self._emptied.discard(pack)

    def take_emptied(self) -> list[str]:
        out = sorted(p for p in self._emptied if p in self.packs and not self.packs[p].keys)
        for p in out:
            del self.packs[p]
        self._emptied.clear()
        return out


class _Journal:
    """The pages one transaction changed, each as it was before its first change, and the counts before it."""

    def __init__(self):
        self.before: dict[str, _Page | None] | None = None
        self.stats: dict | None = None

    def begin(self, stats: dict) -> None:
        if self.before is not None:
            raise RuntimeError("a transaction is open already")
        self.before = {}
        self.stats = {k: stats[k] for k in ("stored", "moved", "dropped", "skipped")}

    def end(self) -> None:
        self.before = self.stats = None

    def note(self, key: str, page: _Page | None) -> None:
        if self.before is not None and key not in self.before:
            self.before[key] = None if page is None else page.copy()

    def undo(self, index: PrefixIndex) -> None:
        """Put `index`'s pages back as they were at `begin` (its lock is held), and close the transaction."""
        journal, stats = self.before or {}, self.stats
        self.end()
        for key, before in reversed(list(journal.items())):  # the transaction's new pages, children first
            if before is None and key in index._pages:
                index._remove(key)
        back = {k: b for k, b in journal.items() if b is not None}
        while back:  # dropped pages come back parents first; moved ones go back to their tier
            ready = [k for k, b in back.items() if k in index._pages or b.parent is None or b.parent in index._pages]
            if not ready:
                break  # (a parent forgotten meanwhile: what hung on it stays out)
            for k in ready:
                b = back.pop(k)
                page = index._pages.get(k)
                if page is None:
                    index._add(k, b.copy())
                elif (page.tier, page.pack) != (b.tier, b.pack):
                    index._place(k, page, b.tier, b.pack)
        index._stats.update(stats or {})


class _Lru:
    """A heap of (last use, key) per tier. Entries are checked when they reach the top: one of a page that moved,
    was touched, pinned or dropped since is stale and discarded, so finding a victim costs O(log n)."""

    def __init__(self, tiers: int):
        self.heaps: list[list[tuple[int, str]]] = [[] for _ in range(tiers)]

    def push(self, tier: int, used: int, key: str, live: int, pages: dict) -> None:
        heap = self.heaps[tier]
        heapq.heappush(heap, (used, key))
        if len(heap) > 4 * live + 64:  # mostly stale entries: rebuilt from the live pages
            fresh = [(p.used, k) for k, p in pages.items() if p.tier == tier]
            heapq.heapify(fresh)
            self.heaps[tier] = fresh

    def victim(self, tier: int, pages: dict, leaves_only: bool, protect: str | None = None) -> str | None:
        """The least recently used unpinned page of `tier` but `protect` (one with no held child, when
        `leaves_only`). Stale entries are discarded on the way (a page that is pinned, or has children, gets a
        fresh entry when that changes); the victim's own entry stays, stale once it is moved or dropped."""
        heap, aside, found = self.heaps[tier], [], None
        while heap:
            used, key = heap[0]
            page = pages.get(key)
            if page is None or page.tier != tier or page.used != used or page.pins or (leaves_only and page.children):
                heapq.heappop(heap)
                continue
            if key == protect:
                aside.append(heapq.heappop(heap))
                continue
            found = key
            break
        for entry in aside:
            heapq.heappush(heap, entry)
        return found


def _sizes(value, keys: Sequence[str], name: str) -> list[int]:
    sizes = [value] * len(keys) if isinstance(value, int) and not isinstance(value, bool) else list(value)
    if len(sizes) != len(keys) or any(isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in sizes):
        raise ValueError(f"{name} must be an integer >= 0 or one per key ({len(keys)}), got {value!r}")
    return sizes
