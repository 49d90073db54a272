"""The KV cache manager: the one owner of each request's KV record, and the scheduler's only view
of the KV cache (which blocks a request holds, whether more fit, the block table to run with).

It never writes a request's `num_computed_tokens` (the scheduler does, from what this returns) and
reads of a request only its token ids, salt, KV source (an n > 1 sibling, or the request that
computed its prompt in-batch), computed count and `num_cacheable_tokens` (how many leading tokens
a lookup may serve: never the last, nor, for a request owed prompt logprobs, its scored
positions, whose hidden states the cache does not hold).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pagoda.cache.block_pool import BlockPool
from pagoda.cache.radix import Node, PrefixMatch, RadixCache
from pagoda.request import Request


@dataclass
class CacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@dataclass
class KVRecord:
    """One running request's KV. Block i holds tokens [i * block_size, (i + 1) * block_size).

    | blocks                        | what they are                        | the request's part          |
    |-------------------------------|--------------------------------------|-----------------------------|
    | [0, num_cached_blocks)        | in the radix tree (a hit, or its own | one reference each; `node`  |
    |                               | blocks that cache() inserted)        | locks them against eviction |
    | next, n > 1 forks only        | the first sample's prompt blocks,    | one reference each          |
    |                               | shared, not (yet) in the tree        |                             |
    | the rest                      | its own, freshly allocated; the first| the only reference          |
    |                               | may be a copy of a partly matching   |                             |
    |                               | block (a cached tail, a whole cached |                             |
    |                               | block, or an n > 1 sibling's last)   |                             |
    `free()` gives back one reference on every block and unlocks `node`: what the tree or a sibling
    also holds stays, the rest returns to the pool.
    """

    blocks: list[int]
    node: Node | None = None  # the deepest locked radix node of its cached prefix
    num_cached_blocks: int = 0


@dataclass(frozen=True)
class Allocation:
    num_computed: int  # tokens whose KV the request already has (cache hit, sibling's prompt)
    num_new: int  # tokens to compute now


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.radix = RadixCache(self.pool, block_size) if enable_prefix_caching else None
        self.stats = CacheStats()
        self._records: dict[str, KVRecord] = {}  # request id -> its KV, while it holds blocks
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

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (empty if it holds no blocks). Read-only for the caller."""
        record = self._records.get(request_id)
        return record.blocks if record is not None else []

    def holds(self, request_id: str) -> bool:
        return request_id in self._records

    # ---- the scheduler's interface ---------------------------------------------------------------
    def lookup(self, request: Request) -> PrefixMatch | None:
        """The request's cached whole-block prefix now, read-only (None without a prefix cache);
        `allocate_first` takes it, so that a request is looked up once (valid until the next
        allocation or cache change)."""
        if self.radix is None:
            return None
        return self.radix.find(request.token_ids[: request.num_cacheable_tokens], request.cache_salt)

    def cached_prefix_len(self, request: Request) -> int:
        """Tokens of the request a cache lookup would serve now; read-only."""
        found = self.lookup(request)
        return 0 if found is None else found.num_blocks * self.block_size

    def allocate_first(
        self, request: Request, max_new_tokens: int, found: PrefixMatch | None = None
    ) -> Allocation | None:
        """Give a request that holds no blocks its KV record: its longest cached prefix (whole
        blocks, then the cached block that shares the most of what follows, copied), or a
        sibling's prompt KV (n > 1), then room for up to `max_new_tokens` more. None: they do
        not fit, and nothing changed. `found`: its `lookup`, if just made."""
        if request.request_id in self._records:
            raise RuntimeError(f"{request.request_id} already holds KV blocks")
        bs = self.block_size
        total = request.num_tokens
        node, shared = None, []
        copy_src: int | None = None  # a shared block holding the first tokens of the last one
        # The last token is always computed (its logits are needed), so look up one less; a
        # request owed prompt logprobs looks up only the tokens before the first it scores.
        limit = request.num_cacheable_tokens
        if self.radix is not None:
            if found is None:
                found = self.lookup(request)
            node, shared = self.radix.claim(found), list(found.blocks)
        num_cached_blocks = len(shared)
        num_computed = len(shared) * bs
        source = request.fork_source or request.prompt_source
        if source is not None and num_computed < total - 1:
            # n > 1 (or a request whose prompt the source computed, in-batch): share the
            # source's KV of all tokens but the last prompt token, which each sample recomputes
            # to draw its own first token. Past the cached prefix these blocks are the source's
            # own, so no radix lock is needed for them.
            num_computed = total - 1
            shared = shared + self.block_ids(source.request_id)[len(shared) : -(-num_computed // bs)]
            if num_computed % bs:
                copy_src = shared.pop()  # the source's partly filled block, written by it too
        elif node is not None and num_computed < limit:
            part = self.radix.match_partial(node, request.token_ids[num_computed:limit])
            if part is not None:
                copy_src, matched = part
                num_computed += matched
        # An n > 1 sample's shared prompt is the same request's, not a hit; in-batch it is.
        num_hit = num_computed if request.fork_source is None else num_cached_blocks * bs
        num_new = min(max_new_tokens, total - num_computed)
        cow = copy_src is not None
        if cow:
            # The runner makes a step's copies all at once: a block that is itself being filled
            # by a copy this step (a fork of a request admitted from the cache in the same
            # step) is copied from that copy's source instead.
            copy_src = next((src for src, dst in self._copies if dst == copy_src), copy_src)
        need = self.blocks_needed(num_computed + num_new) - len(shared)
        if node is not None:
            self.radix.lock(node)  # before evicting, so the hit cannot be evicted
        if cow:
            self.pool.incref([copy_src])  # nor the block to copy, until the copy is handed out
        if not self._reserve(need):
            if node is not None:
                self.radix.unlock(node)
            if cow:
                self.pool.decref([copy_src])
            return None
        if self.radix is not None:  # counted once the request is admitted, not per attempt
            self.stats.queried_tokens += total
            self.stats.hit_tokens += num_hit
        self.pool.incref(shared)
        new_blocks = self.pool.allocate(need)
        if cow:
            # Copy-on-write: the request's first own block starts as a copy of the shared one.
            self._copies.append((copy_src, new_blocks[0]))
        self._records[request.request_id] = KVRecord(
            shared + new_blocks, node, num_cached_blocks if node is not None else 0
        )
        return Allocation(num_computed, num_new)

    def allocate_more(self, request: Request, num_new_tokens: int) -> bool:
        """Room for `num_new_tokens` more tokens of a running request; False if they don't fit."""
        record = self._records[request.request_id]
        need = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - len(record.blocks)
        if need <= 0:
            return True
        if not self._reserve(need):
            return False
        record.blocks.extend(self.pool.allocate(need))
        return True

    def cache(self, request: Request, *, final: bool = False) -> None:
        """Insert the request's newly completed blocks into the prefix cache, so the next turn of a
        conversation, a sibling, or the request itself after preemption finds them. `final`: the
        request writes no more KV (it finishes or is preempted; free() follows), so its partly
        filled last block is cached too, as a tail."""
        record = self._records.get(request.request_id)
        if self.radix is None or record is None:
            return
        done = record.num_cached_blocks
        bs = self.block_size
        full = request.num_computed_tokens // bs
        if full > done:
            parent = record.node or self.radix.root(request.cache_salt)
            node = self.radix.insert(
                parent, request.token_ids[done * bs : full * bs], record.blocks[done:full]
            )
            self.radix.lock(node)
            if record.node is not None:
                self.radix.unlock(record.node)
            record.node, record.num_cached_blocks = node, full
        if final and request.num_computed_tokens % bs and full == record.num_cached_blocks:
            parent = record.node or self.radix.root(request.cache_salt)
            tokens = request.token_ids[full * bs : request.num_computed_tokens]
            self.radix.insert_tail(parent, tokens, record.blocks[full])

    def trim(self, request: Request) -> None:
        """Give back the blocks past the request's computed tokens (after its rejected drafts were
        dropped). They are its own: cached and shared blocks hold computed tokens only."""
        record = self._records[request.request_id]
        keep = max(self.blocks_needed(request.num_computed_tokens), record.num_cached_blocks)
        if len(record.blocks) > keep:
            self.pool.decref(record.blocks[keep:])
            del record.blocks[keep:]

    def free(self, request_id: str) -> None:
        """Release the request's KV record (blocks in the tree stay there, unlocked). Call cache()
        first to keep its computed blocks for later."""
        record = self._records.pop(request_id, None)
        if record is None:
            return
        if record.node is not None:
            self.radix.unlock(record.node)
        self.pool.decref(record.blocks)

    def take_copies(self) -> list[tuple[int, int]]:
        """The block copies the runner must make before this step's forward pass. Each source
        was held since its allocation; it is let go now, as nothing writes a block before the
        runner has made the step's copies."""
        copies, self._copies = self._copies, []
        self.pool.decref(src for src, _ in copies)
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

    def check(self, live_request_ids: Iterable[str] | None = None) -> None:
        """Block accounting: each block's reference count equals the number of its holders (the
        tree, and each record), and, given the ids of the requests that may hold blocks, no one
        else holds any."""
        self.pool.check()
        expected = [0] * self.pool.num_blocks
        if self.radix is not None:
            self.radix.check()
            for b in self.radix.cached_blocks():
                expected[b] += 1
        for record in self._records.values():
            for b in record.blocks:
                expected[b] += 1
        for src, _ in self._copies:  # held until the copy is handed out
            expected[src] += 1
        if expected != self.pool.ref_cnt:
            bad = [b for b in range(self.pool.num_blocks) if expected[b] != self.pool.ref_cnt[b]]
            raise AssertionError(f"KV block ref counts disagree with holders at blocks {bad[:10]}")
        if live_request_ids is not None:
            stray = set(self._records) - set(live_request_ids)
            if stray:
                raise AssertionError(f"requests that are not running hold KV blocks: {sorted(stray)[:10]}")
