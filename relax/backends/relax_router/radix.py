"""A character-level radix tree (compressed trie) from text keys to values, with longest-prefix lookup.

Two users: the router's prefix affinity (text -> worker that served it) and the token cache of
`radix_middleware` (conversation text -> the token ids, log-probs and loss mask that produced it).
Memory is bounded by `max_entries` and, when given, `max_size` (the sum of the sizes given at insert,
e.g. token counts): the least recently used entry is dropped first, and nodes left
without a value or children are pruned (a valueless node with one child is merged into that child,
so the tree stays compressed).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Generic, Optional, TypeVar

V = TypeVar("V")


class _Node:
    __slots__ = ("edge", "children", "parent", "value", "has_value", "size")

    def __init__(self, edge: str = "", parent: Optional["_Node"] = None):
        self.edge = edge
        self.children: dict[str, _Node] = {}
        self.parent = parent
        self.value: Any = None
        self.has_value = False
        self.size = 0


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class RadixTree(Generic[V]):
    def __init__(self, max_entries: int = 100_000, max_size: Optional[int] = None):
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = int(max_entries)
        self.max_size = max_size
        self.size = 0
        self.root = _Node()
        # value-holding nodes, least recently used first (keyed by the node's identity)
        self._lru: "OrderedDict[int, _Node]" = OrderedDict()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._lru)

    def insert(self, key: str, value: V, size: int = 1) -> Optional[V]:
        """Set `key` to `value` (counting `size` towards `max_size`); returns the value it replaces (None when new).
        The entry just inserted is never evicted, even when it alone exceeds `max_size`."""
        node, i = self.root, 0
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                new = _Node(key[i:], node)
                node.children[key[i]] = new
                node = new
                break
            common = _common_prefix(child.edge, key[i:i + len(child.edge)])
            if common < len(child.edge):  # split the edge at the divergence
                mid = _Node(child.edge[:common], node)
                node.children[key[i]] = mid
                child.edge = child.edge[common:]
                child.parent = mid
                mid.children[child.edge[0]] = child
                child = mid
            node = child
            i += common
        old = node.value if node.has_value else None
        self.size += size - node.size
        node.value, node.has_value, node.size = value, True, size
        self._lru[id(node)] = node
        self._lru.move_to_end(id(node))
        while len(self._lru) > 1 and (len(self._lru) > self.max_entries
                                      or (self.max_size is not None and self.size > self.max_size)):
            _, victim = self._lru.popitem(last=False)
            self._drop(victim)
            self.evictions += 1
        return old

    def longest_prefix(self, key: str) -> tuple[int, Optional[V]]:
        """(length, value) of the longest key stored in the tree that is a prefix of `key`; (0, None) if none."""
        node, i = self.root, 0
        best_len, best = (0, self.root) if self.root.has_value else (0, None)
        while i < len(key):
            child = node.children.get(key[i])
            if child is None or not key.startswith(child.edge, i):
                break
            i += len(child.edge)
            node = child
            if node.has_value:
                best_len, best = i, node
        if best is None:
            return 0, None
        self._lru.move_to_end(id(best))
        return best_len, best.value

    def get(self, key: str) -> Optional[V]:
        n, value = self.longest_prefix(key)
        return value if n == len(key) and value is not None else None

    def _drop(self, node: _Node) -> None:
        self.size -= node.size
        node.value, node.has_value, node.size = None, False, 0
        while node is not self.root and not node.has_value:
            parent = node.parent
            if not node.children:  # a bare leaf: remove it
                del parent.children[node.edge[0]]
                node = parent
                continue
            if len(node.children) == 1:  # a pass-through node: merge it into its only child
                (child,) = node.children.values()
                child.edge = node.edge + child.edge
                child.parent = parent
                parent.children[child.edge[0]] = child
            break
