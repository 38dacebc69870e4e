"""Tensors derived from a quantizer (kernel tables, rotation operands, RoPE tables), held by the object they derive
from.

A `Derived` belongs to a Rotation, Codebook or RopeAngles. Each entry is built on first use, once per key (a name and
the device it lives on), and lives as long as its owner: the cache layers own those objects, so a cache's tables go
with the cache, and no kernel looks a table up in a process-wide side table. A copy of the owner on another device
shares the holder (the same quantizer; the entries are per device). A pickle or deep copy carries no entry: the
owner comes back with an empty holder, built again on first use, or, where the holder is `shared` (a theoretical
codebook's, a function of its bits and dim), with the holder of the same name in the new process.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable

_MISSING = object()


class Derived:
    """Entries derived from one quantizer, by key (see the module docstring)."""

    __slots__ = ("_items", "_shared", "__weakref__")

    def __init__(self, shared: tuple[Callable[..., "Derived"], tuple] | None = None):
        """shared: (function, args) whose call returns this holder (a memoized function of plain values), so that
        an unpickled or copied owner finds this holder rather than a new, empty one."""
        self._items: dict = {}
        self._shared = shared

    def get(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """The entry `key`, made by `build()` the first time (a None result is kept too: "no such table")."""
        value = self._items.get(key, _MISSING)
        if value is _MISSING:
            value = self._items[key] = build()
        return value

    def find(self, key: Hashable, default: Any = None) -> Any:
        return self._items.get(key, default)

    def put(self, key: Hashable, value: Any) -> Any:
        self._items[key] = value
        return value

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def keys(self) -> list:
        return list(self._items)

    def __reduce__(self):
        return self._shared if self._shared is not None else (Derived, ())

    def __repr__(self) -> str:
        return f"Derived({len(self._items)} entries)"
