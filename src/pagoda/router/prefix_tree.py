"""Approximate character-level radix tree of the prompts the router sent to each backend.

The router cannot see a backend's KV cache, so it remembers what it sent where: every node records
which backends ("tenants") were sent a prompt passing through it, and when. A backend listed on a
node is listed on all of that node's ancestors (insert marks the whole path, eviction removes whole
leaves, `remove_tenant` prunes top-down), so walking a prompt down the tree gives each backend's
longest matched prefix. Memory is bounded by `max_chars`, the total length of all edge labels: when
an insert goes over it, least-recently-used leaves are evicted until the tree is back under the
low-water mark (90% of `max_chars`), so eviction work is amortised over many inserts.
"""

from __future__ import annotations

import heapq

_LOW_WATER_FRACTION = 0.9


class _Node:
    __slots__ = ("children", "key", "last_used", "parent", "tenants")

    def __init__(self, key: str, parent: _Node | None) -> None:
        self.key = key  # edge label from the parent; empty only at the root
        self.parent = parent
        self.children: dict[str, _Node] = {}  # first character of the child's key -> child
        self.tenants: dict[str, int] = {}  # tenant -> tick of its latest insert through this node
        self.last_used = 0


def _common_prefix_len(key: str, text: str, start: int) -> int:
    """Length of the common prefix of `key` and `text[start:]` (binary search on C-level startswith)."""
    if text.startswith(key, start):
        return len(key)
    lo, hi = 0, min(len(key), len(text) - start)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if text.startswith(key[:mid], start):
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixTree:
    """Which tenants (backends) were sent which text prefixes, bounded to `max_chars` characters."""

    def __init__(self, max_chars: int) -> None:
        if not isinstance(max_chars, int) or isinstance(max_chars, bool) or max_chars < 1:
            raise ValueError(f"max_chars must be an integer >= 1, got {max_chars!r}")
        self.max_chars = max_chars
        # Inserts are truncated to the low-water mark so that an insert never evicts its own path.
        self._low_water = max(1, int(max_chars * _LOW_WATER_FRACTION))
        self._root = _Node("", None)
        self._tick = 0
        self.total_chars = 0

    def insert(self, text: str, tenant: str) -> None:
        """Record that `tenant` was sent `text` (only its first `0.9 * max_chars` characters are kept)."""
        text = text[: self._low_water]
        self._tick += 1
        tick = self._tick
        node = self._root
        node.tenants[tenant] = tick
        node.last_used = tick
        i = 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                child = _Node(text[i:], node)
                node.children[text[i]] = child
                self.total_chars += len(text) - i
                n = len(text) - i
            else:
                n = _common_prefix_len(child.key, text, i)
                if n < len(child.key):
                    child = self._split(child, n)
            child.tenants[tenant] = tick
            child.last_used = tick
            node = child
            i += n
        if self.total_chars > self.max_chars:
            self._evict(self._low_water)

    def match(self, text: str) -> dict[str, int]:
        """For every tenant sharing a prefix with `text`: the length of its longest matched prefix."""
        matched: dict[str, int] = {}
        node = self._root
        i = 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                break
            n = _common_prefix_len(child.key, text, i)
            i += n
            # Deeper nodes list a subset of their ancestors' tenants, so overwriting keeps the deepest.
            for tenant in child.tenants:
                matched[tenant] = i
            if n < len(child.key):
                break
            node = child
        return matched

    def remove_tenant(self, tenant: str) -> None:
        """Forget everything sent to `tenant`; nodes left without tenants are dropped."""
        self._root.tenants.pop(tenant, None)
        stack = [self._root]
        while stack:
            node = stack.pop()
            for first, child in list(node.children.items()):
                if child.tenants.pop(tenant, None) is None:
                    continue  # tenant absent here, hence absent from the whole subtree
                if child.tenants:
                    stack.append(child)
                else:
                    del node.children[first]
                    self.total_chars -= self._subtree_chars(child)

    def tenants(self) -> set[str]:
        return set(self._root.tenants)

    def check_invariants(self) -> None:
        """Raise RuntimeError if the character count, bound, links or tenant nesting are broken."""
        total = 0
        stack = [self._root]
        while stack:
            node = stack.pop()
            for first, child in node.children.items():
                if not child.key or child.key[0] != first or child.parent is not node:
                    raise RuntimeError(f"prefix tree: bad child link under key {node.key[:20]!r}")
                if not child.tenants or not child.tenants.keys() <= node.tenants.keys():
                    raise RuntimeError(
                        "prefix tree: a node's tenants are not a non-empty subset of its parent's"
                    )
                total += len(child.key)
                stack.append(child)
        if total != self.total_chars:
            raise RuntimeError(f"prefix tree: total_chars is {self.total_chars}, nodes hold {total}")
        if self.total_chars > self.max_chars:
            raise RuntimeError(f"prefix tree: {self.total_chars} chars exceed the bound {self.max_chars}")

    def _split(self, child: _Node, n: int) -> _Node:
        """Cut `child`'s edge after `n` characters; return the new middle node (same tenants)."""
        parent = self._parent(child)
        mid = _Node(child.key[:n], parent)
        mid.tenants = dict(child.tenants)
        mid.last_used = child.last_used
        parent.children[mid.key[0]] = mid
        child.key = child.key[n:]
        child.parent = mid
        mid.children[child.key[0]] = child
        return mid

    def _parent(self, node: _Node) -> _Node:
        if node.parent is None:
            raise RuntimeError("prefix tree: the root has no parent")
        return node.parent

    def _subtree_chars(self, node: _Node) -> int:
        total = 0
        stack = [node]
        while stack:
            current = stack.pop()
            total += len(current.key)
            stack.extend(current.children.values())
        return total

    def _evict(self, target: int) -> None:
        """Drop least-recently-used leaves until at most `target` characters remain."""
        heap: list[tuple[int, int, _Node]] = []
        stack = [self._root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self._root:
                heap.append((node.last_used, id(node), node))
        heapq.heapify(heap)
        while self.total_chars > target and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = self._parent(leaf)
            del parent.children[leaf.key[0]]
            self.total_chars -= len(leaf.key)
            if parent is not self._root and not parent.children:
                heapq.heappush(heap, (parent.last_used, id(parent), parent))
