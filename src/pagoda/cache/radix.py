"""A radix tree of cached prefixes (RadixAttention), at KV-block granularity, with partly filled
tail blocks as leaves.

Each node owns a run of whole blocks: `key` holds their token ids (a multiple of block_size) and
`blocks` their ids. A *tail* node is a leaf holding one partly filled block: the KV of the first
len(key) < block_size tokens after its parent's path, left by a request that stopped writing it
(it finished or was preempted). Children are keyed by their first block's tokens, so a tail's
shorter key never collides with a whole block's. A lookup walks whole blocks (`find`, read-only;
`claim` then cuts the node it ends inside and marks the path used); `match_partial`
then finds the child block (a tail, or the first block of a whole child) sharing the most
leading tokens with what follows, which the caller copies before writing (copy-on-write), so a
hit is token-granular. The tree holds one pool reference on every block it caches. A running
request locks the deepest node of its cached prefix; a lock counts on that node and all its
ancestors, so a node with lock_ref == 0 has an unlocked subtree and only unlocked leaves are
evicted (LRU). Tails are never locked. Requests with different cache salts live under different
roots and never share blocks.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from pagoda.cache.block_pool import BlockPool


class Node:
    __slots__ = ("blocks", "children", "key", "last_access", "lock_ref", "parent")

    def __init__(self, key: tuple[int, ...], blocks: list[int], parent: Node | None) -> None:
        self.key = key
        self.blocks = blocks
        self.parent = parent
        self.children: dict[tuple[int, ...], Node] = {}
        self.lock_ref = 0
        self.last_access = 0

    def __lt__(self, other: Node) -> bool:  # heap order: least recently used first
        return self.last_access < other.last_access


@dataclass(frozen=True, eq=False)
class PrefixMatch:
    """A lookup's result: `blocks`, the whole cached blocks of a prefix, end `inside_blocks` blocks
    into `inside` (a child of `node`), or, when `inside` is None, at `node` (None: the salt has
    no tree yet). Valid until the tree changes."""

    node: Node | None
    blocks: list[int]
    inside: Node | None = None
    inside_blocks: int = 0
    salt: Hashable = None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


class RadixCache:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self._roots: dict[Hashable, Node] = {}
        self._clock = itertools.count(1)
        self.evictable_blocks = 0  # blocks in nodes with lock_ref == 0
        self.protected_blocks = 0  # blocks in locked nodes
        self.num_evicted_blocks = 0

    # ---- lookups -------------------------------------------------------------------------------
    def root(self, salt: Hashable) -> Node:
        node = self._roots.get(salt)
        if node is None:
            node = self._roots[salt] = Node((), [], None)
            node.lock_ref = 1  # roots are never evicted
        return node

    def _block_key(self, tokens: Sequence[int], i: int) -> tuple[int, ...]:
        return tuple(tokens[i * self.block_size : (i + 1) * self.block_size])

    def _walk(self, node: Node, tokens: Sequence[int], salt: Hashable = None) -> PrefixMatch:
        """Follow whole blocks of `tokens` down from `node`, changing nothing."""
        bs = self.block_size
        n_blocks = len(tokens) // bs
        matched: list[int] = []
        i = 0
        while i < n_blocks:
            child = node.children.get(self._block_key(tokens, i))
            if child is None:
                break
            k = 1  # blocks of child.key matched; the first matched by the dict lookup
            n_child = len(child.blocks)
            while (
                k < n_child
                and i + k < n_blocks
                and child.key[k * bs : (k + 1) * bs] == self._block_key(tokens, i + k)
            ):
                k += 1
            if k < n_child:
                matched.extend(child.blocks[:k])
                return PrefixMatch(node, matched, child, k, salt)
            matched.extend(child.blocks)
            node = child
            i += k
        return PrefixMatch(node, matched, salt=salt)

    def find(self, tokens: Sequence[int], salt: Hashable = None) -> PrefixMatch:
        """The longest cached whole-block prefix of `tokens`, without touching the tree (for
        scheduling decisions; `claim` it to use it before the tree changes)."""
        if salt not in self._roots:
            return PrefixMatch(None, [], salt=salt)
        return self._walk(self._roots[salt], tokens, salt)

    def claim(self, found: PrefixMatch) -> Node:
        """The deepest node of a prefix `find` returned (the tree unchanged since), cut so that it
        ends exactly at the prefix's end, and marked as used now. Not locked."""
        node = self._end(found) if found.node is not None else self.root(found.salt)
        self._touch(node)
        return node

    def match_len(self, tokens: Sequence[int], salt: Hashable = None) -> int:
        """Number of leading tokens cached, without touching the tree (for scheduling decisions)."""
        return self.find(tokens, salt).num_blocks * self.block_size

    def match(self, tokens: Sequence[int], salt: Hashable = None) -> tuple[Node, list[int]]:
        """Longest cached whole-block prefix: its deepest node (not locked) and its block ids."""
        found = self.find(tokens, salt)
        return self.claim(found), found.blocks

    def match_partial(self, node: Node, tokens: Sequence[int]) -> tuple[int, int] | None:
        """After a whole-block match ending at `node`: the block among its children whose leading
        tokens agree longest with `tokens` (a tail's, or a whole child's first block), as
        (block id, tokens matched), fewer than a block; None if none agrees on its first token.
        The block is shared: copy it before writing."""
        want = tuple(tokens[: self.block_size])
        if not want:
            return None
        first = want[0]
        best, best_len = None, 0
        # (A node can hold hundreds of tails, a select's for instance: the first token rules out
        # most of them without the call.)
        for key, child in node.children.items():
            if key[0] != first:
                continue
            n = _common_len(key, want)
            if n > best_len:
                best, best_len = child, n
        if best is None:
            return None
        self._touch(best)
        return best.blocks[0], min(best_len, self.block_size - 1)

    # ---- updates -------------------------------------------------------------------------------
    def insert(self, node: Node, tokens: Sequence[int], blocks: Sequence[int]) -> Node:
        """Cache `blocks` (holding whole blocks of `tokens`) as the continuation of `node`'s path.
        Where the tree already caches those tokens it keeps its own blocks; new ones get a tree
        reference. Returns the node that ends exactly at the end of `tokens`."""
        bs = self.block_size
        if len(tokens) != len(blocks) * bs:
            raise ValueError("insert needs exactly one block of tokens per block id")
        found = self._walk(node, tokens)
        node, i = self._end(found), found.num_blocks
        if i < len(blocks):
            new = Node(tuple(tokens[i * bs :]), list(blocks[i:]), node)
            self._drop_tails_covered_by(node, new.key[:bs])
            node.children[new.key[:bs]] = new
            self.pool.incref(new.blocks)
            self.evictable_blocks += len(new.blocks)
            # A new node under a locked parent starts unlocked; its lock count is its own.
            node = new
        self._touch(node)
        return node

    def insert_tail(self, node: Node, tokens: Sequence[int], block: int) -> None:
        """Cache `block`, holding the KV of `tokens` (fewer than a block) after `node`'s path, as a
        tail leaf. Nothing changes where a cached block already starts with these tokens; a
        shorter tail that this one extends is replaced."""
        key = tuple(tokens)
        if not 0 < len(key) < self.block_size:
            raise ValueError(f"a tail holds 1 to {self.block_size - 1} tokens, got {len(key)}")
        for child_key, child in node.children.items():
            if child_key[0] == key[0] and child_key[: len(key)] == key:
                self._touch(child)
                return
        self._drop_tails_covered_by(node, key)
        tail = Node(key, [block], node)
        node.children[key] = tail
        self.pool.incref([block])
        self.evictable_blocks += 1
        self._touch(tail)

    def lock(self, node: Node) -> None:
        while node is not None:
            if node.lock_ref == 0 and node.parent is not None:
                self.evictable_blocks -= len(node.blocks)
                self.protected_blocks += len(node.blocks)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not None:
            node.lock_ref -= 1
            if node.lock_ref < 0:
                raise RuntimeError("radix node unlocked more often than locked")
            if node.lock_ref == 0 and node.parent is not None:
                self.evictable_blocks += len(node.blocks)
                self.protected_blocks -= len(node.blocks)
            node = node.parent

    def evict(self, num_blocks: int) -> int:
        """Free at least `num_blocks` blocks from least recently used unlocked leaves, if there
        are that many. Returns the number of blocks released."""
        heap = [n for n in self._nodes() if not n.children and n.lock_ref == 0 and n.parent is not None]
        heapq.heapify(heap)
        freed = 0
        while freed < num_blocks and heap:
            leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[leaf.key[: self.block_size]]
            self.pool.decref(leaf.blocks)
            freed += len(leaf.blocks)
            self.evictable_blocks -= len(leaf.blocks)
            if not parent.children and parent.lock_ref == 0 and parent.parent is not None:
                heapq.heappush(heap, parent)
        self.num_evicted_blocks += freed
        self._drop_empty_roots()
        return freed

    def _drop_empty_roots(self) -> None:
        """Forget the root of a cache salt once nothing is cached or locked under it (only its own
        base lock is left), so that many distinct salts do not pile up roots."""
        for salt, root in list(self._roots.items()):
            if salt is not None and not root.children and root.lock_ref == 1:
                del self._roots[salt]

    def reset(self) -> int:
        """Drop every unlocked entry (locked ones are in use and stay)."""
        return self.evict(self.evictable_blocks)

    # ---- internals -----------------------------------------------------------------------------
    def _drop_tails_covered_by(self, node: Node, key: tuple[int, ...]) -> None:
        """Forget `node`'s tails whose tokens `key` starts with: a block cached under `key` holds
        their KV too."""
        first = key[0]
        covered = [
            k for k in node.children if k[0] == first and len(k) < self.block_size and key[: len(k)] == k
        ]
        for tail_key in covered:
            tail = node.children.pop(tail_key)
            self.pool.decref(tail.blocks)
            self.evictable_blocks -= 1

    def _end(self, found: PrefixMatch) -> Node:
        """The node at which a walk's match ends, splitting the one it ends inside."""
        return found.node if found.inside is None else self._split(found.inside, found.inside_blocks)

    def _split(self, child: Node, k: int) -> Node:
        """Cut `child` after k blocks. The lower half keeps the object's identity, so locks held
        on it stay valid; the new upper node inherits its lock count."""
        bs = self.block_size
        parent = child.parent
        upper = Node(child.key[: k * bs], child.blocks[:k], parent)
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        parent.children[upper.key[:bs]] = upper
        child.key = child.key[k * bs :]
        child.blocks = child.blocks[k:]
        child.parent = upper
        upper.children[child.key[:bs]] = child
        return upper

    def _touch(self, node: Node) -> None:
        now = next(self._clock)
        while node is not None:
            node.last_access = now
            node = node.parent

    def _nodes(self):
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def cached_blocks(self) -> list[int]:
        return [b for n in self._nodes() for b in n.blocks]

    def check(self) -> None:
        evictable = protected = 0
        for node in self._nodes():
            if node.parent is None:
                continue
            is_tail = len(node.key) < self.block_size
            if is_tail and (len(node.blocks) != 1 or node.children or node.lock_ref or not node.key):
                raise AssertionError("radix tail is not an unlocked leaf of one block")
            if not is_tail and (len(node.key) != len(node.blocks) * self.block_size or not node.blocks):
                raise AssertionError("radix node key and blocks disagree")
            if node.parent.children.get(node.key[: self.block_size]) is not node:
                raise AssertionError("radix node not reachable from its parent")
            child_locks = sum(c.lock_ref for c in node.children.values())
            if node.lock_ref < child_locks:
                raise AssertionError("radix node locked less than its children")
            if node.lock_ref == 0:
                evictable += len(node.blocks)
            else:
                protected += len(node.blocks)
        if (evictable, protected) != (self.evictable_blocks, self.protected_blocks):
            raise AssertionError(
                f"radix sizes drifted: counted evictable={evictable} protected={protected}, "
                f"kept {self.evictable_blocks}/{self.protected_blocks}"
            )


def _common_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
