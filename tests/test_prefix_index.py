"""The prefix store's index (`prefix_index`) against a plain dict model of it: random insert / match / pin / unpin
sequences under small tier capacities, the index's actions replayed on the model, and its invariants checked after
every step."""

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tq_hf_cache.prefix.index import PrefixIndex, page_keys

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


def test_a_transactions_file_pages_share_a_pack_counted_whole_until_its_last_page_leaves():
    """The file tier holds packs: what one transaction moves there is one file, counted at its whole size while
    any of its pages is held (the file stays until then), and handed back by take_emptied once its last page left."""
    index = PrefixIndex([0, 2000], file_tier=1)
    a = page_keys(list(range(40)), 4, "ns")  # 10 pages of 50 bytes, 60 as a file: all go to the file tier
    index.begin("pack-a")
    index.insert(a, page_bytes=50, file_bytes=60)
    assert index.pack_bytes("pack-a") == 600 and index.stats()["bytes"] == [0, 600]
    index.commit()
    assert {index.pack_of(k) for k in a} == {"pack-a"}
    index.remove_subtree(a[7])  # 3 pages leave: the file stays, counted whole
    assert index.pack_bytes("pack-a") == 600 and index.stats()["bytes"][1] == 600 and index.take_emptied() == []
    index.remove_subtree(a[0])
    assert index.take_emptied() == ["pack-a"] and index.pack_bytes("pack-a") is None
    assert index.stats()["bytes"] == [0, 0]


@pytest.mark.parametrize("pinned", [False, True])
def test_a_pack_left_holding_half_its_bytes_is_rewritten_into_the_open_one(pinned):
    """Drops from the file tier free nothing until a pack empties; a closed pack left holding at most half of its
    bytes moves its pages into the transaction's pack (moves within the tier), so its file goes. A pinned page
    keeps its pack where it is: then nothing can be freed and the new pages that do not fit are skipped."""
    index = PrefixIndex([0, 1000], file_tier=1)
    a = page_keys(list(range(40)), 4, "ns")  # 10 pages, 60 bytes each as a file
    index.begin("pack-a")
    index.insert(a, page_bytes=50, file_bytes=60)
    index.commit()
    index.match(a[:4])  # used again: a[4:] are the least recently used
    if pinned:
        index.pin(a[:1])
    b = page_keys(list(range(100, 140)), 4, "ns")
    index.begin("pack-b")
    actions = index.insert(b, page_bytes=50, file_bytes=60)
    index.commit()
    kinds = {kind: [x.key for x in actions if x.kind == kind] for kind in ("drop", "move", "skip")}
    if not pinned:  # the 7th new page is over: a[9..5] drop, then pack-a holds 300 of 600 bytes and is rewritten
        assert kinds["drop"] == a[9:4:-1] and kinds["move"] == [a[4], *a[:4]] and kinds["skip"] == []
        assert all(x.src == x.to == 1 for x in actions if x.kind == "move")
        assert index.take_emptied() == ["pack-a"] and {index.pack_of(k) for k in a[:5] + b} == {"pack-b"}
        assert index.stats()["bytes"] == [0, 900] and index.pack_bytes("pack-b") == 900
    else:  # nothing of pack-a can go: what was evicted for the 7th page comes back, and b[6:] are skipped
        assert kinds["drop"] == kinds["move"] == [] and kinds["skip"] == b[6:]
        assert index.stats()["bytes"] == [0, 960] and index.take_emptied() == []


def test_a_rolled_back_transaction_leaves_no_pack_and_puts_every_page_back():
    index = PrefixIndex([100, 1000], file_tier=1)
    a = page_keys(list(range(40)), 4, "ns")
    index.begin("pack-a")
    index.insert(a, page_bytes=50, file_bytes=60)
    index.commit()
    before = index.stats()
    index.begin("pack-b")
    index.insert(page_keys(list(range(200, 280)), 4, "ns"), page_bytes=50, file_bytes=60)
    index.rollback()
    assert index.pack_bytes("pack-b") is None and index.take_emptied() == []
    assert index.stats() == before and {index.pack_of(k) for k in a[:8]} == {"pack-a"}
    with pytest.raises(ValueError, match="exists already"):
        index.begin("pack-a")
