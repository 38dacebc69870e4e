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

Thread-safe: one lock around every call.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
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
    used: int
    pins: int = 0
    children: int = 0


class PrefixIndex:
    """Pages held per tier under byte capacities (`tier_bytes`, fastest first), least recently used first out.

    Args:
        tier_bytes: the bytes each tier may hold, e.g. `[gpu_bytes, cpu_bytes, disk_bytes]`.
        page_tokens: tokens per page (for the stats' token counts).

    Example:
        >>> index = PrefixIndex([2 << 20, 8 << 20], page_tokens=256)
        >>> keys = page_keys(list(range(1024)), 256, "model-and-config-digest")
        >>> [a.kind for a in index.insert(keys, page_bytes=1 << 20)]
        ['store', 'store', 'store', 'move', 'store', 'move']
        >>> index.match(keys), index.stats()["pages"]
        (4, [2, 2])
    """

    def __init__(self, tier_bytes: Sequence[int], page_tokens: int = 1):
        caps = list(tier_bytes)
        if not caps or any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in caps):
            raise ValueError(f"tier_bytes must be a non-empty list of byte counts >= 0, got {tier_bytes!r}")
        if isinstance(page_tokens, bool) or not isinstance(page_tokens, int) or page_tokens < 1:
            raise ValueError(f"page_tokens must be an integer >= 1, got {page_tokens!r}")
        self.capacity = caps
        self.page_tokens = page_tokens
        self._pages: dict[str, _Page] = {}
        self._held = [0] * len(caps)
        self._clock = 0
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

    def stats(self) -> dict:
        """Lookups, hits, tokens reused, pages and bytes per tier, and the pages stored, moved, dropped, skipped."""
        with self._lock:
            out = dict(self._stats)
            out["tokens_reused"] = out["pages_matched"] * self.page_tokens
            out["bytes"] = list(self._held)
            out["pages"] = [sum(p.tier == t for p in self._pages.values()) for t in range(len(self.capacity))]
            out["pinned"] = sum(p.pins > 0 for p in self._pages.values())
            return out

    # ---- changes ----

    def insert(self, keys: Sequence[str], page_bytes: int | Sequence[int]) -> list[Action]:
        """Hold the pages of `keys` (a prefix's chain, from its first page): those held already count as used,
        new ones enter tier 0 (`page_bytes` each, or one size per key), and the tiers are brought back under their
        capacities. Returns the actions in the order the store must carry them out. Stops at the first page that
        fits nowhere (it and the pages after it are skipped: a chain with a gap cannot be matched past it)."""
        sizes = [page_bytes] * len(keys) if isinstance(page_bytes, int) else list(page_bytes)
        if len(sizes) != len(keys) or any(isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in sizes):
            raise ValueError(f"page_bytes must be an integer >= 0 or one per key ({len(keys)}), got {page_bytes!r}")
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
                page = _Page(parent, 0, sizes[i], self._tick())
                self._pages[key] = page
                self._held[0] += sizes[i]
                if parent is not None:
                    self._pages[parent].children += 1
                made = self._fit(0, protect=key)  # the new page may move down, never out
                if made is None:
                    self._remove(key)
                    actions.extend(Action("skip", k) for k in keys[i:])
                    self._stats["skipped"] += len(keys) - i
                    break
                actions.append(Action("store", key, to=page.tier))  # where it ended up: no move of it to carry out
                actions.extend(a for a in made if a.key != key)
                self._stats["stored"] += 1
                parent = key
            return actions

    def pin(self, keys: Sequence[str]) -> None:
        """Keep these pages where they are until `unpin` (a live cache reads them)."""
        with self._lock:
            missing = [k for k in keys if k not in self._pages]
            if missing:
                raise KeyError(f"cannot pin pages not held: {missing[:3]}")
            for k in keys:
                self._pages[k].pins += 1

    def unpin(self, keys: Sequence[str]) -> None:
        with self._lock:
            bad = [k for k in keys if k not in self._pages or self._pages[k].pins == 0]
            if bad:
                raise KeyError(f"cannot unpin pages not pinned: {bad[:3]}")
            for k in keys:
                self._pages[k].pins -= 1

    # ---- internals (the lock is held) ----

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _touch(self, keys: Sequence[str]) -> None:
        for k in keys:  # in chain order: a chain's later pages count as used later
            self._pages[k].used = self._tick()

    def _remove(self, key: str) -> None:
        page = self._pages.pop(key)
        self._held[page.tier] -= page.nbytes
        if page.parent is not None and page.parent in self._pages:
            self._pages[page.parent].children -= 1

    def _fit(self, tier: int, protect: str | None = None) -> list[Action] | None:
        """Moves and drops that bring `tier` and the tiers below it back under capacity, carried out on the index;
        None, with every one of them undone, when pinned pages alone exceed a tier."""
        actions: list[Action] = []
        undo: list[tuple[str, _Page]] = []
        last = len(self.capacity) - 1
        for t in range(tier, last + 1):
            while self._held[t] > self.capacity[t]:
                victim = self._victim(t, leaves_only=t == last, protect=protect if t == last else None)
                if victim is None:
                    for key, page in reversed(undo):
                        self._restore(key, page)
                    return None
                page = self._pages[victim]
                undo.append((victim, _Page(page.parent, page.tier, page.nbytes, page.used, page.pins, page.children)))
                if t == last:
                    self._remove(victim)
                    actions.append(Action("drop", victim, src=t))
                else:
                    self._held[t] -= page.nbytes
                    self._held[t + 1] += page.nbytes
                    page.tier = t + 1
                    actions.append(Action("move", victim, src=t, to=t + 1))
        self._stats["moved"] += sum(a.kind == "move" and a.key != protect for a in actions)
        self._stats["dropped"] += sum(a.kind == "drop" for a in actions)
        return actions

    def _restore(self, key: str, saved: _Page) -> None:
        """Put a page back as it was before a move or drop of `_fit`."""
        page = self._pages.get(key)
        if page is None:  # dropped
            self._pages[key] = saved
            self._held[saved.tier] += saved.nbytes
            if saved.parent is not None and saved.parent in self._pages:
                self._pages[saved.parent].children += 1
        else:  # moved
            self._held[page.tier] -= page.nbytes
            self._held[saved.tier] += saved.nbytes
            page.tier = saved.tier

    def _victim(self, tier: int, leaves_only: bool, protect: str | None = None) -> str | None:
        """The least recently used unpinned page of `tier` but `protect` (one with no held child, when
        `leaves_only`)."""
        best, best_used = None, None
        for k, p in self._pages.items():
            if p.tier == tier and p.pins == 0 and k != protect and (not leaves_only or p.children == 0):
                if best_used is None or p.used < best_used:
                    best, best_used = k, p.used
        return best
