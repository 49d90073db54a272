"""The radix prefix cache and the block pool, driven alone (no model)."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from pagoda.cache.block_pool import BlockPool
from pagoda.cache.radix import RadixCache

BS = 4


def _check(pool: BlockPool, tree: RadixCache, held: dict[int, list[int]]) -> None:
    """Every block's ref count equals its holders: the tree plus the simulated requests."""
    pool.check()
    tree.check()
    expected = [0] * pool.num_blocks
    for b in tree.cached_blocks():
        expected[b] += 1
    for blocks in held.values():
        for b in blocks:
            expected[b] += 1
    assert expected == pool.ref_cnt
    # Evictable size equals the blocks of unlocked nodes, all of which lie under unlocked leaves.
    unlocked = sum(len(n.blocks) for n in tree._nodes() if n.parent is not None and n.lock_ref == 0)
    assert unlocked == tree.evictable_blocks


def test_find_changes_nothing_and_claim_splits_as_match_does():
    pool = BlockPool(16)
    tree = RadixCache(pool, BS)
    a = list(range(12))
    blocks = pool.allocate(3)
    node = tree.insert(tree.root(None), a, blocks)
    stamp = node.last_access
    found = tree.find(a[:8] + [99] * 4)
    assert found.blocks == blocks[:2] and found.inside is node and found.inside_blocks == 2
    assert len(node.blocks) == 3 and node.last_access == stamp  # not split, not touched
    upper = tree.claim(found)
    assert upper is node.parent and upper.blocks == blocks[:2] and node.blocks == blocks[2:]
    assert upper.last_access > stamp
    assert tree.find(a).num_blocks == 3 and tree.find(a, "other salt").node is None
    assert tree.claim(tree.find([1], "new salt")) is tree.root("new salt")
    _check(pool, tree, {0: blocks})


def test_match_insert_split_and_evict():
    pool = BlockPool(16)
    tree = RadixCache(pool, BS)
    a = list(range(12))  # three blocks
    blocks = pool.allocate(3)
    node = tree.insert(tree.root(None), a, blocks)
    pool.decref(blocks)  # the "request" is done: only the tree holds them
    assert pool.num_free == 13
    n2, hit = tree.match(a[:8] + [99] * 4)
    assert hit == blocks[:2]
    assert n2 is not node and len(n2.blocks) == 2  # split at the block boundary
    assert tree.match_len(a + [1, 2]) == 12
    assert tree.match_len([5] * 8) == 0
    tree.lock(n2)
    assert tree.evict(10) == 1  # only the unlocked tail block can go
    assert tree.match_len(a) == 8
    tree.unlock(n2)
    assert tree.evict(10) == 2
    assert pool.num_free == 16
    tree.check()


def test_salts_never_share():
    pool = BlockPool(8)
    tree = RadixCache(pool, BS)
    tokens = list(range(8))
    blocks = pool.allocate(2)
    tree.insert(tree.root("tenant-a"), tokens, blocks)
    assert tree.match_len(tokens, "tenant-a") == 8
    assert tree.match_len(tokens, None) == 0
    assert tree.match_len(tokens, "tenant-b") == 0


def test_roots_of_salts_with_nothing_cached_are_dropped():
    pool = BlockPool(8)
    tree = RadixCache(pool, BS)
    for salt in ("a", "b", "c"):
        blocks = pool.allocate(1)
        tree.insert(tree.root(salt), list(range(BS)), blocks)
        pool.decref(blocks)  # the request is done; only the tree holds them
    node, _ = tree.match(list(range(BS)) + [0], "b")
    tree.lock(node)  # a running request of salt "b"
    assert tree.evict(8) == 2
    assert set(tree._roots) == {"b"}  # "a" and "c" had nothing left; "b" is in use
    tree.unlock(node)
    tree.evict(8)
    assert tree._roots == {} and pool.num_free == 8
    tree.check()


def test_insert_keeps_existing_blocks():
    pool = BlockPool(8)
    tree = RadixCache(pool, BS)
    tokens = list(range(8))
    first = pool.allocate(2)
    second = pool.allocate(2)
    tree.insert(tree.root(None), tokens, first)
    tree.insert(tree.root(None), tokens, second)  # same tokens computed twice
    assert tree.match(tokens)[1] == first
    assert [pool.ref_cnt[b] for b in second] == [1, 1]  # the tree took no reference on duplicates


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["insert", "match", "tail", "unlock", "evict"]), st.integers(0, 2**16)),
        max_size=40,
    )
)
def test_random_operations_keep_invariants(ops):
    pool = BlockPool(24)
    tree = RadixCache(pool, BS)
    held: dict[int, list[int]] = {}  # simulated requests: id -> blocks they hold
    locks: dict[int, object] = {}
    next_id = 0
    for op, arg in ops:
        rng = random.Random(arg)
        if op == "insert":
            n_blocks = rng.randint(1, 4)
            # few distinct tokens, so prefixes are often shared
            tokens = [rng.randint(0, 1) for _ in range(n_blocks * BS)]
            if pool.num_free < n_blocks:
                tree.evict(n_blocks - pool.num_free)
            if pool.num_free < n_blocks:
                continue
            blocks = pool.allocate(n_blocks)
            node = tree.insert(tree.root(None), tokens, blocks)
            tree.lock(node)
            held[next_id], locks[next_id] = blocks, node
            next_id += 1
        elif op == "match":
            tokens = [rng.randint(0, 1) for _ in range(rng.randint(0, 5) * BS)]
            node, blocks = tree.match(tokens)
            assert tree.match_len(tokens) == len(blocks) * BS
            tree.lock(node)
            pool.incref(blocks)
            held[next_id], locks[next_id] = blocks, node
            next_id += 1
        elif op == "tail":
            # A finished request's partly filled block, cached after some whole-block prefix.
            prefix = [rng.randint(0, 1) for _ in range(rng.randint(0, 2) * BS)]
            tail = [rng.randint(0, 1) for _ in range(rng.randint(1, BS - 1))]
            node, _ = tree.match(prefix)
            if pool.num_free == 0:
                tree.evict(1)
            if pool.num_free == 0 or tree.match_len(prefix) != len(prefix):
                continue
            (block,) = pool.allocate(1)
            tree.insert_tail(node, tail, block)
            pool.decref([block])  # the request is done: only the tree may hold it
            part = tree.match_partial(node, tail + [0])
            assert part is not None and part[1] >= len(tail) and part[1] < BS
            assert part[0] in tree.cached_blocks()
        elif op == "unlock" and held:
            rid = rng.choice(sorted(held))
            tree.unlock(locks.pop(rid))
            pool.decref(held.pop(rid))
        elif op == "evict":
            locked_blocks = {b for blocks in held.values() for b in blocks}
            before = set(tree.cached_blocks())
            tree.evict(rng.randint(1, 6))
            evicted = before - set(tree.cached_blocks())
            assert not evicted & locked_blocks, "a block in use was evicted"
        _check(pool, tree, held)
    for rid in list(held):
        tree.unlock(locks.pop(rid))
        pool.decref(held.pop(rid))
    tree.reset()
    _check(pool, tree, held)
    assert pool.num_free == pool.num_blocks
