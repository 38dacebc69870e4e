"""What a `PrefixStore` can restore: every published page (its payload in memory, or the path of its file) and, per
chain position, the endpoints stored there. It holds no lock and makes no moves: the store calls it under its lock.

An endpoint is where an inserted cache ended: its snapshot (the codes past its last whole page, the exact tokens)
hangs on the key of the page before it (or on ROOT), with its length, binding and layer layout. A lookup walks a
prompt's page keys from the longest down and takes the longest endpoint whose whole chain is published and sound.
"""

from __future__ import annotations

import hashlib
from typing import Any

from . import pages as pp
from .index import token_bytes

ROOT = "root"


class Catalog:
    """Published pages and endpoints.

    Args:
        namespace: the store's namespace (an endpoint without pages hangs on it).
        page_tokens: tokens per page.

    Example:
        >>> cat = Catalog("ns", page_tokens=16)
        >>> cat.publish("k1", {"x": None}, None, None)
        >>> "k1" in cat.held, cat.unpublish("k1")[0]
        (True, {'x': None})
    """

    def __init__(self, namespace: str, page_tokens: int):
        self.namespace, self.page_tokens = namespace, page_tokens
        self.held: dict[str, Any] = {}  # published key -> a payload (dict of tensors) or the path of its file
        # the tokens' last page key (or ROOT) -> {snapshot key: (its length, its binding, its layout)}
        self.ends: dict[str, dict[str, tuple[int, str, str]]] = {}
        self._parent_of: dict[str, str] = {}  # snapshot key -> its key in `ends`
        self.damaged: set[str] = set()  # page files found damaged, dropped by the next insert (or match)

    def snapshot_key(self, keys: list[str], rest, bound: str) -> str:
        """The key of an endpoint after the page `keys` and the tokens `rest`, under a binding."""
        parent = keys[-1] if keys else self.namespace + bound
        return hashlib.sha256(b"end:" + parent.encode() + token_bytes(rest)).hexdigest()

    def publish(self, key: str, held, parent: str | None, end) -> None:
        """Make a page (`end` None) or a snapshot (`end`: its parent key, length, binding, layout) restorable."""
        self.held[key] = held
        if end is not None:
            self.ends.setdefault(parent, {})[key] = tuple(end[1:])
            self._parent_of[key] = parent

    def unpublish(self, key: str) -> tuple[Any, str | None, tuple | None]:
        """Take a page out of lookups; returns what `publish` needs to put it back."""
        held = self.held.pop(key, None)
        parent = self._parent_of.pop(key, None)
        end = None
        if parent is not None:
            ends = self.ends.get(parent, {})
            end = (parent, *ends.pop(key))
            if not ends:
                self.ends.pop(parent, None)
        return held, parent, end

    def longest(self, rows, tkeys) -> tuple[list | None, int]:
        """(a chain per row, its length) of the longest length at which every row has a published endpoint of one
        layout; (None, 0) when there is none."""
        found = [self._endpoints(ids, t) for ids, t in zip(rows, tkeys)]
        for n in sorted(set.intersection(*(set(f) for f in found)), reverse=True):
            layouts = set.intersection(*(set(f[n]) for f in found))
            if layouts:
                layout = min(layouts)
                return [f[n][layout] for f in found], n
        return None, 0

    def _endpoints(self, ids, tkeys: list[str]) -> dict[int, dict[str, list[str]]]:
        """{length: {layout: chain (page keys, then the snapshot's)}} of every published endpoint that `ids`
        extends past, whose pages are all published and none found damaged."""
        P = self.page_tokens
        out: dict[int, dict[str, list[str]]] = {}
        bound: dict[tuple[int, str], list[str]] = {}
        for m in range(len(tkeys), -1, -1):
            for snap, (length, b, layout) in self.ends.get(tkeys[m - 1] if m else ROOT, {}).items():
                if length >= ids.numel() or layout in out.get(length, {}) or snap not in self.held:
                    continue
                keys = bound.get((m, b))
                if keys is None:
                    keys = bound[(m, b)] = pp.bind(tkeys[:m], b)
                chain = keys + [snap]
                if all(k in self.held and k not in self.damaged for k in chain) \
                        and snap == self.snapshot_key(keys, ids[m * P: length], b):
                    out.setdefault(length, {})[layout] = chain
        return out
