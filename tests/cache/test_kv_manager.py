"""The KV cache manager on its own: each request's KV record (blocks, locked node, cached count),
forks with copy-on-write, cache() apart from free(), preemption and drafts."""

from __future__ import annotations

import pytest

from pagoda.cache.kv_manager import Allocation, KVCacheManager
from pagoda.config import SchedulerConfig
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams
from pagoda.scheduler.scheduler import Scheduler
from pagoda.step import SampledTokens

BS = 4


def req(rid: str, prompt: list[int], **kw) -> Request:
    return Request(rid, prompt, SamplingParams(temperature=0, max_tokens=8), max_tokens=8, **kw)


def admit(kv: KVCacheManager, r: Request, budget: int = 64) -> Allocation:
    """What the scheduler does: allocate, then it (not the KV manager) records the computed count."""
    alloc = kv.allocate_first(r, budget)
    assert alloc is not None
    r.num_computed_tokens = alloc.num_computed + alloc.num_new  # as if the step ran
    return alloc


def test_a_fork_shares_the_prompt_and_copies_the_partly_filled_block() -> None:
    kv = KVCacheManager(16, BS, enable_prefix_caching=False)
    prompt = list(range(10))  # blocks: [0-3] [4-7] [8, 9]
    first = req("p-0", prompt)
    assert admit(kv, first) == Allocation(0, 10)
    parent = list(kv.block_ids("p-0"))
    assert len(parent) == 3 and kv.take_copies() == []
    second = req("p-1", prompt, fork_source=first)
    # All but the last prompt token come from the sibling; the last is computed to draw its own token.
    assert admit(kv, second) == Allocation(9, 1)
    child = kv.block_ids("p-1")
    assert child[:2] == parent[:2]  # full blocks shared, one reference each
    assert child[2] not in parent  # the partly filled block is written, so it is copied first
    assert kv.take_copies() == [(parent[2], child[2])]
    assert [kv.pool.ref_cnt[b] for b in parent] == [2, 2, 1]
    kv.check(["p-0", "p-1"])
    kv.free("p-0")
    assert [kv.pool.ref_cnt[b] for b in child] == [1, 1, 1]  # the fork keeps what it shares
    kv.free("p-1")
    assert kv.pool.num_free == 16
    kv.check([])


def test_free_does_not_cache_and_cache_keeps_blocks_past_free() -> None:
    kv = KVCacheManager(16, BS)
    prompt = list(range(13))
    a = req("a", prompt)
    admit(kv, a)
    kv.free("a")  # without cache(): nothing enters the tree
    assert kv.cached_prefix_len(req("x", prompt)) == 0 and kv.pool.num_free == 16
    b = req("b", prompt)
    admit(kv, b)
    kv.cache(b)  # three full blocks go into the tree, locked by b's record
    assert kv.radix.evictable_blocks == 0
    kv.check(["b"])
    kv.free("b")
    assert kv.radix.evictable_blocks == 3 and kv.pool.num_free == 16 - 3
    c = req("c", prompt + [99])
    assert admit(kv, c).num_computed == 12  # the hit
    kv.check(["c"])
    with pytest.raises(AssertionError, match="not running"):
        kv.check([])  # c's record is live: the check names what holds blocks without running


def test_preemption_releases_the_record_and_resumes_from_the_cache() -> None:
    """Two requests in a pool that fits one: the newer is preempted (recompute), its full blocks stay
    cached, and on resume it computes only the uncached tail."""
    kv = KVCacheManager(6, BS)
    sched = Scheduler(SchedulerConfig(4, 64, 64, "fcfs"), kv)
    a, b = req("a", list(range(11))), req("b", list(range(50, 61)))
    for r in (a, b):
        sched.add_request(r)
    s = sched.schedule()
    assert [x.request.request_id for x in s.scheduled] == ["a", "b"]
    sched.update_from_output(s, {x.request.request_id: SampledTokens([1]) for x in s.scheduled})
    sched.check()
    for _ in range(2):  # decode until a needs a fourth block and b must yield
        s = sched.schedule()
        sched.update_from_output(s, {x.request.request_id: SampledTokens([1]) for x in s.scheduled})
        sched.check()
        if s.preempted:
            break
    assert [r.request_id for r in s.preempted] == ["b"]
    assert not kv.holds("b") and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert kv.cached_prefix_len(b) >= 8  # its two full blocks stay in the tree
    sched.finish_requests(["a"], "abort")
    s = sched.schedule()
    (resumed,) = s.scheduled
    assert resumed.request is b and b.num_computed_tokens >= 8
    assert resumed.num_new_tokens == b.num_tokens - b.num_computed_tokens
    sched.check()


def test_drafts_get_blocks_and_rejected_ones_are_rewound_by_the_scheduler() -> None:
    kv = KVCacheManager(16, BS)
    sched = Scheduler(SchedulerConfig(4, 64, 64, "fcfs"), kv)
    r = req("r", list(range(7)))
    sched.add_request(r)
    s = sched.schedule()
    # The first token and four drafts (as jump-forward proposes them).
    sched.update_from_output(s, {"r": SampledTokens([100], drafts=[101, 102, 103, 104])})
    assert r.num_tokens == 12 and r.num_draft_tokens == 4 and r.num_computed_tokens == 7
    s = sched.schedule()
    (x,) = s.scheduled
    assert x.num_new_tokens == 5 and len(x.block_ids) == 3  # room for every draft position
    # Sampling kept two drafts and then chose its own token.
    sched.update_from_output(s, {"r": SampledTokens([101, 102, 200], num_accepted_drafts=2)})
    assert r.output_token_ids == [100, 101, 102, 200] and r.num_draft_tokens == 0
    assert r.num_computed_tokens == 10  # the rejected drafts' KV is stale; 200 is computed next
    sched.check()
    sched.finish_requests(["r"], "abort")
    sched.check()
    # Its two full computed blocks stay cached, and its partly filled third (tokens 8 and 9) as a tail.
    assert kv.radix.evictable_blocks == 3


def test_a_cached_tail_is_copied_and_only_the_rest_computed() -> None:
    """Token-granular hits: a finished request's partly filled last block stays cached as a tail;
    a later request sharing part of it copies it and computes only its own tokens."""
    kv = KVCacheManager(16, BS)
    sched = Scheduler(SchedulerConfig(4, 64, 64, "fcfs"), kv)
    a = req("a", list(range(10)))  # blocks [0-3] [4-7] [8, 9]
    sched.add_request(a)
    sched.update_from_output(sched.schedule(), {"a": SampledTokens([99])})
    sched.finish_requests(["a"], "abort")  # computed 10 of its tokens; the tail holds 8 and 9
    kv.check([])
    assert kv.radix.evictable_blocks == 3
    b = req("b", list(range(9)) + [50, 51])  # shares tokens 0-8 with a
    alloc = kv.allocate_first(b, 64)
    assert alloc == Allocation(9, 2)
    blocks = kv.block_ids("b")
    (copy,) = kv.take_copies()
    assert copy[1] == blocks[2] and copy[0] not in blocks  # the tail is copied, never written
    assert kv.stats.hit_tokens == 9
    kv.check(["b"])
    kv.free("b")
    kv.check([])
    # A tail never serves a request's last token, nor the positions whose prompt logprobs it owes.
    c = req("c", list(range(10)))
    assert kv.allocate_first(c, 64) == Allocation(9, 1)
    kv.take_copies()
    kv.free("c")
    d = Request(
        "d",
        list(range(10)),
        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, logprob_start_len=6),
        max_tokens=1,
    )
    assert kv.allocate_first(d, 64) == Allocation(5, 5)
    kv.take_copies()
    kv.free("d")
    kv.check([])


def test_a_copy_source_evicted_while_allocating_is_never_handed_out() -> None:
    kv = KVCacheManager(4, BS)
    sched = Scheduler(SchedulerConfig(4, 64, 64, "fcfs"), kv)
    a = req("a", list(range(6)))  # a whole block [0-3] and the tail [4, 5], both cached
    sched.add_request(a)
    sched.update_from_output(sched.schedule(), {"a": SampledTokens([99])})
    sched.finish_requests(["a"], "abort")
    assert kv.pool.num_free == 2 and kv.radix.evictable_blocks == 2
    # b would copy the tail and needs 3 new blocks: evicting the tail (its copy source, held
    # meanwhile) frees nothing, so b does not fit, and nothing leaks.
    b = req("b", [0, 1, 2, 3, 4] + [9] * 11)
    assert kv.allocate_first(b, 64) is None
    assert kv.take_copies() == []
    kv.check([])
    assert kv.pool.num_free == 3 and kv.radix.evictable_blocks == 1
