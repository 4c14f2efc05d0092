"""Radix prefix cache over page-aligned token keys, partitioned by salt.

A request's K/V serve only requests of the same salt (None for most; flexsgl/attention/
request_variants.py says which requests have one): the root's children are keyed by the salt with
the first page's tokens, so every path below holds one salt's K/V.

Invariants (checked by `check()`, which the property tests call after every operation):
- Every edge holds whole pages: len(node.key) == len(node.pages) * page_size > 0 (root excepted).
- A page id appears at most once in the tree; the tree's pages are disjoint from the free list.
- node.ref >= 0, and a node's ref is at least each child's ref (locks hold whole root paths).
- Only unreferenced leaves are evicted, least recently used first; evicting a leaf can make its
  parent an unreferenced leaf, which then competes by its own last-use time.
"""

from __future__ import annotations

import heapq
import itertools

_clock = itertools.count()


class Node:
    __slots__ = ("key", "pages", "children", "parent", "edge", "ref", "last_use")

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: "Node | None", edge: tuple = ()):
        """edge: this node's key in its parent's children (RadixCache._edge)."""
        self.key, self.pages, self.parent, self.edge = key, pages, parent, edge
        self.children: dict[tuple, Node] = {}
        self.ref = 0
        self.last_use = next(_clock)


class RadixCache:
    def __init__(self, page_size: int):
        self.ps = page_size
        self.root = Node((), [], None)
        self.root.ref = 1  # never evicted
        self.num_pages = 0  # pages held by the tree
        self.num_evictable = 0  # pages in nodes nobody references

    def _first(self, tokens) -> tuple[int, ...]:
        return tuple(tokens[: self.ps])

    def _edge(self, parent: Node, tokens, salt) -> tuple:
        """The key in `parent`'s children of a child whose tokens start with `tokens`: its first page's
        tokens, with the salt in front under the root."""
        first = self._first(tokens)
        return (salt, first) if parent is self.root and salt is not None else first

    def match(self, tokens: list[int], salt=None) -> tuple[list[int], Node]:
        """Pages of the longest prefix of `tokens` made of whole pages that `salt`'s requests cached,
        and its last node. A partly matching edge is split at the last matching page boundary."""
        node, pages, i = self.root, [], 0
        while len(tokens) - i >= self.ps:
            child = node.children.get(self._edge(node, tokens[i:], salt))
            if child is None:
                break
            n = self._common_pages(child.key, tokens[i:])
            if n < len(child.pages):
                child = self._split(child, n)
            child.last_use = next(_clock)
            pages += child.pages
            i += len(child.key)
            node = child
        return pages, node

    def _common_pages(self, key, tokens) -> int:
        n = 0
        while (n + 1) * self.ps <= min(len(key), len(tokens)) and \
                key[n * self.ps:(n + 1) * self.ps] == tuple(tokens[n * self.ps:(n + 1) * self.ps]):
            n += 1
        return n

    def _split(self, node: Node, n_pages: int) -> Node:
        """Cut `node` after n_pages pages; returns the new upper part."""
        cut = n_pages * self.ps
        upper = Node(node.key[:cut], node.pages[:n_pages], node.parent, node.edge)
        upper.ref, upper.last_use = node.ref, node.last_use
        node.parent.children[node.edge] = upper
        node.key, node.pages, node.parent = node.key[cut:], node.pages[n_pages:], upper
        node.edge = self._first(node.key)
        upper.children[node.edge] = node
        return upper

    def insert(self, tokens: list[int], pages: list[int], salt=None) -> list[int]:
        """Cache `pages` as holding `tokens` (whole pages only) for `salt`'s requests. Returns the given
        pages that were not taken because the tree already holds those tokens in other pages (free them)."""
        n_full = min(len(tokens) // self.ps, len(pages))
        tokens, pages = tokens[: n_full * self.ps], pages[:n_full]
        node, i, duplicates = self.root, 0, []
        while i < len(tokens):
            edge = self._edge(node, tokens[i:], salt)
            child = node.children.get(edge)
            if child is None:
                new = Node(tuple(tokens[i:]), pages[i // self.ps:], node, edge)
                node.children[edge] = new
                self.num_pages += len(new.pages)
                self.num_evictable += len(new.pages) if new.ref == 0 else 0
                return duplicates
            n = self._common_pages(child.key, tokens[i:])
            if n < len(child.pages):
                child = self._split(child, n)
            mine = pages[i // self.ps: i // self.ps + n]
            duplicates += [p for p, q in zip(mine, child.pages) if p != q]
            child.last_use = next(_clock)
            i += len(child.key)
            node = child
        return duplicates

    def lock(self, node: Node) -> None:
        while node is not None:
            if node.ref == 0:
                self.num_evictable -= len(node.pages)
            node.ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not None:
            node.ref -= 1
            if node.ref == 0:
                self.num_evictable += len(node.pages)
            node = node.parent

    def evict(self, n_pages: int) -> list[int]:
        """Free at least `n_pages` pages (fewer if not enough are unreferenced), LRU leaves first."""
        heap = [(leaf.last_use, id(leaf), leaf) for leaf in self._leaves() if leaf.ref == 0]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < n_pages:
            _, _, leaf = heapq.heappop(heap)
            freed += leaf.pages
            parent = leaf.parent
            del parent.children[leaf.edge]
            self.num_pages -= len(leaf.pages)
            self.num_evictable -= len(leaf.pages)
            if parent is not self.root and not parent.children and parent.ref == 0:
                heapq.heappush(heap, (parent.last_use, id(parent), parent))
        return freed

    def _leaves(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            if not node.children and node is not self.root:
                yield node
            stack.extend(node.children.values())

    def all_pages(self) -> list[int]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out += node.pages
            stack.extend(node.children.values())
        return out

    def check(self) -> None:
        pages = self.all_pages()
        assert len(pages) == len(set(pages)) == self.num_pages, "a page is in the tree twice"
        evictable = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            assert node.ref >= 0, "negative reference count"
            if node is not self.root:
                assert len(node.key) == len(node.pages) * self.ps > 0, "edge is not whole pages"
                assert node.parent.ref >= node.ref, "a lock does not cover its root path"
                evictable += len(node.pages) if node.ref == 0 else 0
            for edge, child in node.children.items():
                first = child.key[: self.ps]
                assert child.parent is node and child.edge == edge, "a child under another key"
                assert edge == first or (node is self.root and edge[1:] == (first,)), "a key not its first page"
            stack.extend(node.children.values())
        assert evictable == self.num_evictable, "evictable page count drifted"
