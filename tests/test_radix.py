"""RadixCache and PageAllocator: hand-checked cases, then a property test that drives both the way
the scheduler does (match + lock, allocate or evict, insert + free duplicates + unlock)."""

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from flexsgl.cache.pool import DUMMY_PAGE, PageAllocator
from flexsgl.cache.radix import RadixCache

A, B, C, D, E, F, X, Y = range(1, 9)


def test_match_is_whole_pages_only():
    c = RadixCache(2)
    assert c.insert([A, B, C, D, E, F], [10, 11, 12]) == []
    pages, node = c.match([A, B, C, D, E, F])
    assert pages == [10, 11, 12] and node.key == (A, B, C, D, E, F)
    assert c.match([A, B, C, D, E, F, X])[0] == [10, 11, 12]  # trailing partial page ignored
    assert c.match([A, B, C, X, E, F])[0] == [10]  # diverges inside page 2: only page 1
    assert c.match([A, B, C])[0] == [10]
    assert c.match([A]) == ([], c.root) and c.match([]) == ([], c.root)
    c.check()

    c4 = RadixCache(4)
    c4.insert([A, B, C, D], [5])
    assert c4.match([A, B, C]) == ([], c4.root)  # shorter than a page
    assert c4.match([A, B, C, X, A]) == ([], c4.root)


def test_insert_ignores_trailing_partial_page():
    c = RadixCache(4)
    assert c.insert([A, B, C, D, E, F, X], [10, 11]) == []  # 11 is not cached, nor returned
    assert c.all_pages() == [10] and c.num_pages == c.num_evictable == 1
    (node,) = c.root.children.values()
    assert node.key == (A, B, C, D)
    c.insert([X, Y, X, Y, A], [20])  # fewer pages than tokens: only whole, paged ones
    assert sorted(c.all_pages()) == [10, 20]
    c.check()


def test_split_then_sibling_insert():
    c = RadixCache(2)
    c.insert([A, B, C, D, E, F], [10, 11, 12])
    pages, node = c.match([A, B, C, D, X, Y])
    assert pages == [10, 11]
    assert list(c.root.children.values()) == [node]  # the edge was cut after 2 pages
    assert node.key == (A, B, C, D) and node.pages == [10, 11]
    (low,) = node.children.values()
    assert low.key == (E, F) and low.pages == [12] and low.parent is node
    c.check()
    assert c.insert([A, B, C, D, X, Y], [20, 21, 22]) == [20, 21]  # tree already holds A..D
    assert set(node.children) == {(E, F), (X, Y)} and node.children[(X, Y)].pages == [22]
    assert sorted(c.all_pages()) == [10, 11, 12, 22] and c.num_pages == 4
    assert c.match([A, B, C, D, X, Y])[0] == [10, 11, 22]
    assert c.match([A, B, C, D, E, F])[0] == [10, 11, 12]
    c.check()


def test_salts_partition_the_tree():
    """K/V cached under one salt serve that salt's requests only; the unsalted tree is one more
    partition. Splits and eviction keep each node under its own key."""
    c = RadixCache(2)
    assert c.insert([A, B, C, D], [10, 11]) == []
    assert c.insert([A, B, C, D], [20, 21], salt="s") == []  # the same tokens, other K/V: both kept
    assert c.match([A, B, C, D])[0] == [10, 11] and c.match([A, B, C, D], salt="s")[0] == [20, 21]
    assert c.match([A, B, C, D], salt="t") == ([], c.root)
    pages, node = c.match([A, B, X, Y], salt="s")  # splits the salted edge
    assert pages == [20] and node.edge == ("s", (A, B)) and c.root.children[("s", (A, B))] is node
    assert c.insert([A, B, X, Y], [30, 31], salt="s") == [30]
    assert c.match([A, B, X, Y], salt="s")[0] == [20, 31] and c.match([A, B, X, Y])[0] == [10]
    c.check()
    assert sorted(c.evict(10)) == [10, 11, 20, 21, 31] and c.root.children == {}
    c.check()


def test_evict_least_recently_used_leaf_first():
    c = RadixCache(2)
    c.insert([1, 1], [1])
    c.insert([2, 2], [2])
    c.insert([3, 3], [3])
    c.match([1, 1])  # touch: now [2, 2] is the oldest
    assert [c.evict(1) for _ in range(4)] == [[2], [3], [1], []]
    assert c.num_pages == c.num_evictable == 0 and c.all_pages() == []
    c.check()


@pytest.mark.parametrize("touch_parent, order", [(False, [2, 3, 1, 5]), (True, [2, 3, 5, 1])])
def test_evicting_leaf_exposes_parent(touch_parent, order):
    c = RadixCache(2)
    c.insert([1, 1, 2, 2], [1, 2])
    c.insert([1, 1, 3, 3], [1, 3])  # splits: [1 1] -> {[2 2], [3 3]}; [2 2] keeps its old time
    c.insert([5, 5], [5])
    if touch_parent:
        c.match([1, 1])  # the parent [1 1] becomes newer than [5 5]
    # After [2 2] and [3 3] go, the parent is a leaf and competes by its own last use.
    assert c.evict(4) == order
    c.check()


def test_locked_paths_are_not_evicted():
    c = RadixCache(2)
    c.insert([1, 1, 2, 2], [1, 2])
    c.insert([1, 1, 3, 3], [1, 3])
    c.insert([4, 4], [4])
    pages, node = c.match([1, 1, 2, 2])
    assert pages == [1, 2]
    c.lock(node)
    c.lock(node)
    assert c.num_evictable == 2 and c.num_pages == len(c.all_pages()) == 4
    assert sorted(c.evict(10)) == [3, 4]  # [1 1] and [2 2] are locked
    assert sorted(c.all_pages()) == [1, 2] and c.num_evictable == 0
    c.unlock(node)
    assert c.evict(10) == [] and c.num_evictable == 0  # still locked once
    c.unlock(node)
    assert c.num_evictable == c.num_pages == 2
    c.check()
    assert c.evict(10) == [2, 1]  # leaf first, then its parent
    assert c.num_pages == c.num_evictable == 0 and c.all_pages() == []


def test_ref_counts_and_check_can_fail():
    c = RadixCache(2)
    c.insert([1, 1, 2, 2], [1, 2])
    _, node = c.match([1, 1, 2, 2])
    for _ in range(3):
        c.lock(node)
    assert node.ref == 3 and c.root.ref == 4
    for _ in range(3):
        c.unlock(node)
    assert node.ref == 0 and c.root.ref == 1 and c.num_evictable == 2
    c.check()
    node.ref = -1
    with pytest.raises(AssertionError, match="negative"):
        c.check()


PS, NUM_PAGES = 2, 40


class SchedulerLike(RuleBasedStateMachine):
    """live[i] = (tokens, salt, locked node, matched pages, own pages): own pages are the ones the request
    allocated and has not handed to the cache yet. holds[p] is the salt and token prefix page p's KV
    stands for (a page serves requests of its own salt only)."""

    @initialize(seed=st.none() | st.integers(0, 2**32 - 1))
    def setup(self, seed):
        self.alloc = PageAllocator(NUM_PAGES, shuffle_seed=seed)
        self.cache = RadixCache(PS)
        self.live, self.holds, self.seen = [], {}, []

    def check_pages(self, pages, tokens, salt, what):
        for k, p in enumerate(pages):
            assert self.holds.get(p) == (salt, tuple(tokens[: (k + 1) * PS])), f"{what}: page {p} at {k} of {tokens}"

    @rule(tokens=st.lists(st.integers(0, 2), max_size=20), reuse=st.none() | st.integers(0, 99),
          salt=st.sampled_from([None, None, "a", "b"]))
    def request(self, tokens, reuse, salt):
        if reuse is not None and self.seen:  # often extend a prefix of an earlier request
            prev = self.seen[reuse % len(self.seen)]
            tokens = (prev[: reuse % (len(prev) + 1)] + tokens)[:20]
        self.seen.append(tokens)
        matched, node = self.cache.match(tokens, salt)
        assert not set(matched) & set(self.alloc._free), f"match of {tokens} returned free pages"
        self.check_pages(matched, tokens, salt, "match")
        self.cache.lock(node)
        need = -(-len(tokens) // PS) - len(matched)
        if need > self.alloc.num_free:
            self.alloc.free(self.cache.evict(need - self.alloc.num_free))
        if need > self.alloc.num_free:
            self.cache.unlock(node)
            return
        own = self.alloc.alloc(need)
        for k, p in enumerate(own, start=len(matched)):
            self.holds[p] = (salt, tuple(tokens[: (k + 1) * PS]))
        self.live.append((tokens, salt, node, matched, own))

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def finish(self, i):
        tokens, salt, node, matched, own = self.live.pop(i % len(self.live))
        whole = len(tokens) // PS
        dups = self.cache.insert(tokens, matched + own, salt)
        assert set(dups) <= set(own[: whole - len(matched)]), f"insert {tokens}: odd duplicates {dups}"
        self.alloc.free(dups + own[whole - len(matched):])
        self.cache.unlock(node)
        pages, _ = self.cache.match(tokens, salt)  # just inserted, nothing evicted since
        assert len(pages) == whole, f"{tokens} was inserted but only {len(pages)} pages match"
        self.check_pages(pages, tokens, salt, "match after insert")

    @rule(k=st.integers(0, 10))
    def evict(self, k):
        before, evictable = self.cache.num_pages, self.cache.num_evictable
        freed = self.cache.evict(k)
        assert len(freed) >= min(k, evictable), f"evict({k}) freed {freed} of {evictable} evictable"
        assert self.cache.num_pages == before - len(freed)
        self.alloc.free(freed)

    @invariant()
    def consistent(self):
        self.cache.check()
        free, tree = list(self.alloc._free), self.cache.all_pages()
        own = [p for *_, o in self.live for p in o]
        everything = free + tree + own
        assert len(everything) == len(set(everything)), "free, cached and live pages overlap"
        assert set(everything) == set(range(NUM_PAGES)) - {DUMMY_PAGE}, "a page leaked"
        assert 0 <= self.cache.num_evictable <= self.cache.num_pages == len(tree)
        for _, _, node, matched, _ in self.live:
            assert set(matched) <= set(tree), "a locked page left the tree"
        # every cached page holds the prefix its tree path spells, under the salt its root edge names
        stack = [(ch, (), ch.edge[0] if ch.edge != ch.key[:PS] else None) for ch in self.cache.root.children.values()]
        while stack:
            n, prefix, salt = stack.pop()
            assert n.ref >= 0
            prefix += n.key
            start = len(prefix) // PS - len(n.pages)
            for k, p in enumerate(n.pages, start=start):
                assert self.holds.get(p) == (salt, prefix[: (k + 1) * PS]), f"page {p} sits at the wrong prefix"
            stack += [(ch, prefix, salt) for ch in n.children.values()]


TestSchedulerLike = SchedulerLike.TestCase
TestSchedulerLike.settings = settings(max_examples=200, stateful_step_count=40, deadline=None, database=None)
