"""The prefix store's index (`prefix_index`) against a plain dict model of it: random insert / match / pin / unpin
sequences under small tier capacities, the index's actions replayed on the model, and its invariants checked after
every step."""

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tq_hf_cache.prefix_index import PrefixIndex, page_keys

PAGE = 4


def test_page_keys_chain_every_token_before_them_and_the_namespace():
    a = page_keys(list(range(13)), PAGE, "m")
    assert len(a) == 3 and len(set(a)) == 3  # the partial last page has no key
    assert page_keys(list(range(8)), PAGE, "m") == a[:2]  # a prefix's keys are the longer sequence's first keys
    b = page_keys([0, 1, 2, 99] + list(range(4, 13)), PAGE, "m")
    assert b[0] != a[0] and b[1] != a[1]  # a change in page 0 changes every later key
    assert page_keys(list(range(13)), PAGE, "other model")[0] != a[0]
    with pytest.raises(ValueError, match="page_tokens"):
        page_keys([1, 2], 0, "m")
    with pytest.raises(ValueError, match="1-D"):
        page_keys([[1, 2]], 1, "m")


def test_bad_capacities_and_sizes_are_refused_naming_the_value():
    with pytest.raises(ValueError, match="tier_bytes"):
        PrefixIndex([])
    with pytest.raises(ValueError, match="tier_bytes"):
        PrefixIndex([10, -1])
    with pytest.raises(ValueError, match="page_bytes"):
        PrefixIndex([10]).insert(["k"], -3)


class Model:
    """What the index should hold, built only from the actions it returns."""

    def __init__(self, caps):
        self.caps = caps
        self.tier: dict[str, int] = {}
        self.size: dict[str, int] = {}
        self.parent: dict[str, str | None] = {}
        self.pins: dict[str, int] = {}

    def apply(self, actions, keys, page_bytes):
        parent = {k: (keys[i - 1] if i else None) for i, k in enumerate(keys)}
        for a in actions:
            assert self.pins.get(a.key, 0) == 0 or a.kind == "store", f"{a} touches a pinned page"
            if a.kind == "store":
                assert a.key not in self.tier
                self.tier[a.key], self.size[a.key], self.parent[a.key] = a.to, page_bytes, parent[a.key]
            elif a.kind == "move":
                assert self.tier[a.key] == a.src and a.to == a.src + 1
                self.tier[a.key] = a.to
            elif a.kind == "drop":
                assert self.tier[a.key] == a.src == len(self.caps) - 1
                del self.tier[a.key], self.size[a.key], self.parent[a.key]
            else:
                assert a.kind == "skip" and a.key not in self.tier

    def longest(self, keys):
        n = 0
        while n < len(keys) and keys[n] in self.tier:
            n += 1
        return n

    def check(self, index: PrefixIndex):
        held = [0] * len(self.caps)
        for k, t in self.tier.items():
            held[t] += self.size[k]
            assert index.tier_of(k) == t
            assert self.parent[k] is None or self.parent[k] in self.tier, "a held page's parent was dropped"
        stats = index.stats()
        assert stats["bytes"] == held
        assert all(h <= c for h, c in zip(held, self.caps)), (held, self.caps)
        assert stats["pages"] == [sum(t == i for t in self.tier.values()) for i in range(len(self.caps))]


sequences = st.lists(st.integers(0, 2), min_size=0, max_size=5 * PAGE)
ops = st.lists(st.tuples(st.sampled_from(["insert", "match", "pin", "unpin"]), sequences, st.integers(1, 3)),
               min_size=1, max_size=40)


@settings(max_examples=150, deadline=None)
@given(ops, st.lists(st.integers(0, 6), min_size=1, max_size=3))
def test_the_index_follows_its_model(steps, caps):
    index, model = PrefixIndex(caps, page_tokens=PAGE), Model(caps)
    pinned: list[list[str]] = []
    for op, tokens, size in steps:
        keys = page_keys(tokens, PAGE, "m")
        if op == "insert":
            actions = index.insert(keys, size)
            model.apply(actions, keys, size)
            stored = [a.key for a in actions if a.kind == "store"]
            skipped = [a.key for a in actions if a.kind == "skip"]
            assert skipped == keys[len(keys) - len(skipped):]  # skips end the chain
            assert all(k in model.tier for k in keys[: len(keys) - len(skipped)])
            assert set(stored) <= set(keys)
        elif op == "match":
            assert index.match(keys) == model.longest(keys)
        elif op == "pin":
            n = index.match(keys)
            index.pin(keys[:n])
            for k in keys[:n]:
                model.pins[k] = model.pins.get(k, 0) + 1
            pinned.append(keys[:n])
        elif pinned:
            chain = pinned.pop(0)
            index.unpin(chain)
            for k in chain:
                model.pins[k] -= 1
        model.check(index)
    assert index.stats()["pinned"] == sum(v > 0 for v in model.pins.values())


def test_least_recently_used_pages_leave_first_and_a_chain_keeps_its_front():
    index = PrefixIndex([2, 2], page_tokens=PAGE)
    a = page_keys([0] * 12, PAGE, "m")  # three pages
    b = page_keys([1] * 8, PAGE, "m")
    index.insert(a, 1)  # a0 moves down when a2 arrives
    assert [index.tier_of(k) for k in a] == [1, 0, 0]
    index.match(a)  # a is used now
    actions = index.insert(b, 1)
    # b0 pushes a1 (used before a2) down; b1 pushes a2 down, and the full last tier drops its one page without a
    # held child (a2): the chain a0 -> a1 keeps its front
    assert [(x.kind, x.key) for x in actions] == [("store", b[0]), ("move", a[1]), ("store", b[1]), ("move", a[2]),
                                                  ("drop", a[2])]
    assert [index.tier_of(k) for k in a + b] == [1, 1, None, 0, 0]
    assert index.match(a) == 2


def test_pinned_pages_stay_and_a_page_that_fits_nowhere_is_skipped():
    index = PrefixIndex([1], page_tokens=PAGE)
    a, b = page_keys([0] * 4, PAGE, "m"), page_keys([1] * 4, PAGE, "m")
    assert [x.kind for x in index.insert(a, 1)] == ["store"]
    index.pin(a)
    assert [x.kind for x in index.insert(b, 1)] == ["skip"]
    assert index.tier_of(a[0]) == 0 and index.tier_of(b[0]) is None
    index.unpin(a)
    assert [x.kind for x in index.insert(b, 1)] == ["store", "drop"]
    with pytest.raises(KeyError, match="not pinned"):
        index.unpin(b)
    assert [x.kind for x in index.insert(page_keys([2] * 4, PAGE, "m"), 5)] == ["skip"]  # larger than every tier


def test_concurrent_requests_leave_a_consistent_index():
    caps = [40, 80]
    index = PrefixIndex(caps, page_tokens=PAGE)
    seqs = [[s] * PAGE * (1 + s % 5) + list(range(PAGE * 3)) for s in range(24)]

    def worker(w):
        for i in range(60):
            keys = page_keys(seqs[(w * 7 + i) % len(seqs)], PAGE, "m")
            if i % 3:
                index.insert(keys, 3)
            else:
                n = index.match(keys)
                index.pin(keys[:n])
                index.unpin(keys[:n])

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = index.stats()
    assert all(b <= c for b, c in zip(stats["bytes"], caps)) and stats["pinned"] == 0
    assert stats["bytes"] == [3 * n for n in stats["pages"]]
