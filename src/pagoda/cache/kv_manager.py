"""The scheduler's only view of the KV cache: which blocks a request holds and whether more fit.

Ownership: `request.block_ids` lists the blocks holding the request's tokens in order; the request
owns one pool reference on each. The radix cache owns one more reference on every block it caches.
A request with cached blocks locks the deepest radix node of its cached prefix (`_nodes`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pagoda.cache.block_pool import BlockPool
from pagoda.cache.radix import Node, RadixCache
from pagoda.request import Request


@dataclass
class CacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.radix = RadixCache(self.pool, block_size) if enable_prefix_caching else None
        self.stats = CacheStats()
        self._nodes: dict[str, Node] = {}  # request id -> locked radix node
        self._num_cached_blocks: dict[str, int] = {}  # request id -> leading blocks inserted in the tree
        self._copies: list[tuple[int, int]] = []  # (src, dst) block copies the runner must do first

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-idle blocks count as free)."""
        idle = self.radix.evictable_blocks if self.radix else 0
        return 1.0 - (self.pool.num_free + idle) / self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- the scheduler's interface ---------------------------------------------------------------
    def cached_prefix_len(self, request: Request) -> int:
        """Tokens of the request a cache lookup would serve now; read-only."""
        if self.radix is None:
            return 0
        return self.radix.match_len(request.token_ids[: request.num_cacheable_tokens], request.cache_salt)

    def allocate_first(self, request: Request, max_new_tokens: int) -> int:
        """Give a waiting request (num_computed_tokens == 0) its blocks: its longest cached prefix,
        a sibling's prompt KV (n > 1), then room for up to `max_new_tokens` more. Returns the number
        of tokens to compute now (0: they do not fit, and the request is left untouched)."""
        bs = self.block_size
        total = request.num_tokens
        node, shared = None, []
        if self.radix is not None:
            # The last token is always computed (its logits are needed), so look up one less; a
            # request owed prompt logprobs looks up only the tokens before the first it scores.
            node, shared = self.radix.match(
                request.token_ids[: request.num_cacheable_tokens], request.cache_salt
            )
        num_cached_blocks = len(shared)
        num_computed = len(shared) * bs
        source = request.fork_source
        if source is not None and num_computed < total - 1:
            # n > 1: share the sibling's KV of all tokens but the last prompt token, which each
            # sample recomputes to draw its own first token. Past the cached prefix these blocks
            # are the sibling's own, so no radix lock is needed for them.
            num_computed = total - 1
            shared = shared + source.block_ids[len(shared) : -(-num_computed // bs)]
        num_new = min(max_new_tokens, total - num_computed)
        # The sibling's last block is partly filled and will be written: copy it first.
        cow = num_computed % bs != 0
        need = self.blocks_needed(num_computed + num_new) - len(shared) + cow
        if node is not None:
            self.radix.lock(node)  # before evicting, so the hit cannot be evicted
        if not self._reserve(need):
            if node is not None:
                self.radix.unlock(node)
            return 0
        if self.radix is not None:  # counted once the request is admitted, not per attempt
            self.stats.queried_tokens += total
            self.stats.hit_tokens += num_cached_blocks * bs
        self.pool.incref(shared)
        new_blocks = self.pool.allocate(need)
        if cow:
            src = shared.pop()
            self.pool.decref([src])
            self._copies.append((src, new_blocks[0]))
        request.block_ids = shared + new_blocks
        request.num_computed_tokens = num_computed
        if node is not None:
            self._nodes[request.request_id] = node
            self._num_cached_blocks[request.request_id] = num_cached_blocks
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_computed
        return num_new

    def allocate_more(self, request: Request, num_new_tokens: int) -> bool:
        """Room for `num_new_tokens` more tokens of a running request; False if they don't fit."""
        need = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - len(request.block_ids)
        if need <= 0:
            return True
        if not self._reserve(need):
            return False
        request.block_ids.extend(self.pool.allocate(need))
        return True

    def cache_computed(self, request: Request) -> None:
        """Insert the request's newly completed blocks into the prefix cache, so the next turn of a
        conversation, a sibling, or the request itself after preemption finds them."""
        if self.radix is None:
            return
        rid = request.request_id
        done = self._num_cached_blocks.get(rid, 0)
        full = request.num_computed_tokens // self.block_size
        if full <= done:
            return
        bs = self.block_size
        parent = self._nodes.get(rid) or self.radix.root(request.cache_salt)
        node = self.radix.insert(
            parent, request.token_ids[done * bs : full * bs], request.block_ids[done:full]
        )
        self.radix.lock(node)
        if rid in self._nodes:
            self.radix.unlock(self._nodes[rid])
        self._nodes[rid] = node
        self._num_cached_blocks[rid] = full

    def free(self, request: Request) -> None:
        """Release the request's blocks (cached ones stay in the tree, unlocked)."""
        self.cache_computed(request)
        rid = request.request_id
        node = self._nodes.pop(rid, None)
        if node is not None:
            self.radix.unlock(node)
        self._num_cached_blocks.pop(rid, None)
        self.pool.decref(request.block_ids)
        request.block_ids = []
        request.num_computed_tokens = 0

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self._copies = self._copies, []
        return copies

    def reset_prefix_cache(self) -> int:
        return self.radix.reset() if self.radix else 0

    @property
    def num_evicted_blocks(self) -> int:
        return self.radix.num_evicted_blocks if self.radix else 0

    # ---- internals -------------------------------------------------------------------------------
    def _reserve(self, need: int) -> bool:
        """Make `need` blocks free, evicting cached prefixes if that is enough."""
        short = need - self.pool.num_free
        if short <= 0:
            return True
        if self.radix is None or self.radix.evictable_blocks < short:
            return False
        self.radix.evict(short)
        return self.pool.num_free >= need

    def check(self, requests: Iterable[Request] = ()) -> None:
        """Block accounting: each block's reference count equals the number of its holders."""
        self.pool.check()
        expected = [0] * self.pool.num_blocks
        if self.radix is not None:
            self.radix.check()
            for b in self.radix.cached_blocks():
                expected[b] += 1
        for req in requests:
            for b in req.block_ids:
                expected[b] += 1
        if expected != self.pool.ref_cnt:
            bad = [b for b in range(self.pool.num_blocks) if expected[b] != self.pool.ref_cnt[b]]
            raise AssertionError(f"KV block ref counts disagree with holders at blocks {bad[:10]}")
