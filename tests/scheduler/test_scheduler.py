"""The scheduler and KV cache manager with a fake model: a token is a function of the sequence."""

from __future__ import annotations

import pytest

from pagoda.cache.kv_manager import KVCacheManager
from pagoda.config import SchedulerConfig
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams
from pagoda.scheduler.scheduler import Scheduler
from pagoda.step import SampledTokens


def fake_token(tokens: list[int]) -> int:
    return (sum(tokens) * 31 + len(tokens)) % 97


class FakeKV:
    """Stands in for the model's KV: records which token each slot holds, so the test can check
    that every computed position reads exactly its own sequence's tokens."""

    def __init__(self, num_blocks: int, bs: int) -> None:
        self.slots: dict[int, int] = {}
        self.bs = bs

    def run(self, sched, scheduler: Scheduler) -> dict[str, SampledTokens]:
        # All of a step's copies at once, as the runner makes them (read every source, then write).
        copied = {
            dst * self.bs + off: self.slots.get(src * self.bs + off)
            for src, dst in sched.block_copies
            for off in range(self.bs)
        }
        for slot, token in copied.items():
            if token is None:
                self.slots.pop(slot, None)
            else:
                self.slots[slot] = token
        sampled = {}
        for s in sched.scheduled:
            req = s.request
            start = req.num_computed_tokens
            for pos in range(start, start + s.num_new_tokens):
                block = s.block_ids[pos // self.bs]
                self.slots[block * self.bs + pos % self.bs] = req.token_ids[pos]
            if s.samples:
                end = start + s.num_new_tokens
                # "attention": read the whole context back through the block table
                ctx = [self.slots[s.block_ids[p // self.bs] * self.bs + p % self.bs] for p in range(end)]
                assert ctx == req.token_ids[:end], f"{req.request_id} read a wrong KV slot"
                sampled[req.request_id] = SampledTokens([fake_token(ctx)])
        return sampled


def reference(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(fake_token(seq))
    return seq[len(prompt) :]


def run_all(scheduler: Scheduler, kv: FakeKV, reqs: list[Request], max_steps: int = 10_000) -> int:
    for r in reqs:
        scheduler.add_request(r)
    steps = 0
    while scheduler.num_unfinished:
        sched = scheduler.schedule()
        assert not sched.is_empty, "no progress"
        assert sched.num_tokens <= scheduler.config.max_num_batched_tokens
        assert len(scheduler.running) <= scheduler.config.max_num_seqs
        scheduler.update_from_output(sched, kv.run(sched, scheduler))
        scheduler.check()
        steps += 1
        assert steps < max_steps
    return steps


def make(num_blocks=64, bs=4, budget=32, max_seqs=8, caching=True, policy="fcfs"):
    kvm = KVCacheManager(num_blocks, bs, caching)
    sched = Scheduler(SchedulerConfig(max_seqs, budget, 512, policy), kvm)
    return sched, FakeKV(num_blocks, bs), kvm


def req(rid: str, prompt: list[int], max_tokens: int, **kw) -> Request:
    return Request(
        rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens), max_tokens=max_tokens, **kw
    )


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("budget,num_blocks", [(8, 64), (32, 64), (32, 14), (5, 12)])
def test_outputs_match_reference(caching, budget, num_blocks):
    sched, kv, kvm = make(num_blocks=num_blocks, budget=budget, caching=caching)
    prompts = [[(i * 7 + j) % 50 for j in range(3 + i * 3)] for i in range(10)]
    prompts += [prompts[0] + [1, 2, 3], prompts[0][:8]]  # shared prefixes
    prompts += [prompts[4], prompts[4], prompts[1]]  # same prompts (shared, then preempted)
    reqs = [req(f"r{i}", p, 12) for i, p in enumerate(prompts)]
    run_all(sched, kv, reqs)
    for r, p in zip(reqs, prompts, strict=True):
        assert r.output_token_ids == reference(p, 12), r.request_id
        assert r.finish_reason == "length"
    if num_blocks < 20:
        assert sched.stats.num_preemptions > 0
    kvm.reset_prefix_cache()
    assert kvm.pool.num_free == num_blocks


def test_prefix_hit_computes_only_the_tail():
    sched, kv, kvm = make()
    system = list(range(20))
    run_all(sched, kv, [req("a", system + [1, 2], 4)])
    b = req("b", system + [3, 4, 5], 4)
    run_all(sched, kv, [b])
    assert b.num_cached_tokens == 20  # five whole blocks of 4
    assert b.output_token_ids == reference(system + [3, 4, 5], 4)
    assert kvm.stats.hit_tokens >= 20


def test_full_hit_recomputes_the_last_token_only_in_a_private_block():
    sched, kv, _kvm = make()
    prompt = list(range(16))
    run_all(sched, kv, [req("a", prompt, 3)])
    b = req("b", prompt, 3)
    run_all(sched, kv, [b])
    # The last block's first three tokens come from a copy (never written in place); the last
    # token is recomputed for its logits.
    assert b.num_cached_tokens == 15
    assert b.output_token_ids == reference(prompt, 3)


def test_a_finished_requests_tail_serves_the_next_token_by_token():
    sched, kv, kvm = make()
    system = list(range(10))  # two whole blocks of 4, then 8 and 9
    run_all(sched, kv, [req("a", system + [40], 2)])
    b = req("b", system + [41, 42], 2)
    run_all(sched, kv, [b])
    assert b.num_cached_tokens == 10  # the whole blocks and the two tokens of the tail
    assert b.output_token_ids == reference(system + [41, 42], 2)
    others = [req(f"c{i}", system + [50 + i, 1, 2], 3) for i in range(6)]
    run_all(sched, kv, others)
    for r in others:
        assert r.output_token_ids == reference(r.prompt_token_ids, 3)
    kvm.reset_prefix_cache()
    assert kvm.pool.num_free == kvm.num_blocks


def test_n_samples_fork_the_prompt_once():
    sched, kv, _kvm = make(caching=False)
    prompt = list(range(10))
    first = req("p-0", prompt, 5)
    others = [req(f"p-{i}", prompt, 5, fork_source=first) for i in range(1, 4)]
    computed = _count_computed(kv)
    run_all(sched, kv, [first, *others])
    for r in [first, *others]:
        assert r.output_token_ids == reference(prompt, 5)
        assert r.finish_reason == "length"
    # prompt once (10) + one recomputed prompt token per fork (3) + 4 tokens of decode each after the first
    assert sum(computed) == 10 + 3 + 4 * 4
    assert [r.num_cached_tokens for r in others] == [9, 9, 9]


def test_forks_of_a_request_admitted_from_a_tail_copy_its_source():
    # "f-0" is admitted from the cached tail of "a" (a pending copy), and its forks in the same
    # step copy f-0's partly filled block: they must copy the tail itself, since the runner makes
    # a step's copies all at once.
    sched, kv, _kvm = make()
    prompt = list(range(10))
    run_all(sched, kv, [req("a", prompt, 1)])
    first = req("f-0", prompt + [77], 5)
    forks = [req(f"f-{i}", prompt + [77], 5, fork_source=first) for i in (1, 2)]
    run_all(sched, kv, [first, *forks])
    for r in [first, *forks]:
        assert r.output_token_ids == reference(prompt + [77], 5), r.request_id
    assert first.num_cached_tokens == 10


def _count_computed(kv: FakeKV) -> list[int]:
    computed: list[int] = []
    orig = kv.run

    def counting_run(s, scheduler):
        computed.append(s.num_tokens)
        return orig(s, scheduler)

    kv.run = counting_run
    return computed


def test_requests_arriving_together_compute_a_shared_prefix_once():
    # In-batch prefix caching: of four requests sharing 40 uncached tokens, one computes them
    # while the others wait a step and then find them cached.
    sched, kv, _kvm = make(budget=256)
    shared = [(7 * j) % 50 for j in range(40)]
    reqs = [req(f"r{i}", shared + [60 + i, 1, 2], 4) for i in range(4)]
    computed = _count_computed(kv)
    run_all(sched, kv, reqs)
    for r in reqs:
        assert r.output_token_ids == reference(r.prompt_token_ids, 4), r.request_id
    assert [r.num_cached_tokens for r in reqs] == [0, 40, 40, 40]
    assert computed[0] == 43  # the first alone; then its decode and the others' own 3 tokens
    assert sum(computed) == 43 + 3 * 3 + 4 * 3


def test_a_short_shared_prefix_does_not_hold_requests_back():
    sched, kv, _kvm = make(budget=256)
    reqs = [req(f"r{i}", [5, 6, 7, 8, 9, 10, 11, 12] + [60 + i] * 30, 2) for i in range(3)]
    computed = _count_computed(kv)
    run_all(sched, kv, reqs)
    assert computed[0] == 3 * 38  # all admitted in the first step
    for r in reqs:
        assert r.output_token_ids == reference(r.prompt_token_ids, 2)


def test_same_prompts_arriving_together_compute_it_once_however_short():
    # The branches of a fork sent without a commit: identical 10-token prompts (under the 32
    # tokens of whole blocks the block hold-back needs). One computes the prompt; the others wait
    # a step, share its prompt KV (its partly filled last block copied) and compute only their
    # last token, as n > 1 samples do; the shared tokens count as prefix-cache hits.
    sched, kv, kvm = make(budget=256)
    prompt = [(5 * j) % 50 for j in range(10)]
    reqs = [req(f"b{i}", prompt, 4) for i in range(3)]
    computed = _count_computed(kv)
    run_all(sched, kv, reqs)
    for r in reqs:
        assert r.output_token_ids == reference(prompt, 4), r.request_id
        assert r.prompt_source is None
    assert [r.num_cached_tokens for r in reqs] == [0, 9, 9]
    assert computed[:2] == [10, 1 + 2]  # the prompt; then b0's decode and b1, b2's last tokens
    assert sum(computed) == 10 + 2 + 3 * 3
    assert kvm.stats.hit_tokens == 18
    kvm.reset_prefix_cache()
    assert kvm.pool.num_free == kvm.num_blocks


def test_a_commit_sent_with_its_branches_serves_them_its_whole_prompt():
    # fork's commit (prompt-only) and the branches in one step: the branches wait a step and
    # then find the finished commit's prompt cached to its last token (its tail included).
    sched, kv, _kvm = make(budget=256)
    prompt = [(3 * j) % 50 for j in range(14)]
    commit = Request("c", prompt, SamplingParams(max_tokens=0), max_tokens=0)
    branches = [req(f"b{i}", prompt, 3) for i in range(2)]
    computed = _count_computed(kv)
    run_all(sched, kv, [commit, *branches])
    assert commit.finish_reason == "length"
    for r in branches:
        assert r.output_token_ids == reference(prompt, 3), r.request_id
    assert [r.num_cached_tokens for r in branches] == [13, 13]
    assert computed[0] == 14
    assert sum(computed) == 14 + 2 * 3


def test_a_same_prompt_arriving_later_shares_the_running_requests_prompt():
    # b1 arrives once b0 has computed the prompt and is decoding: it takes b0's prompt KV (its
    # partly filled block copied) and computes only its last token.
    sched, kv, kvm = make(budget=256)
    prompt = [(5 * j) % 50 for j in range(10)]
    b0, b1 = req("b0", prompt, 4), req("b1", prompt, 4)
    sched.add_request(b0)
    first = sched.schedule()
    sched.update_from_output(first, kv.run(first, sched))
    sched.add_request(b1)
    second = sched.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in second.scheduled] == [("b0", 1), ("b1", 1)]
    sched.update_from_output(second, kv.run(second, sched))
    run_all(sched, kv, [])
    assert b1.num_cached_tokens == 9
    assert b0.output_token_ids == b1.output_token_ids == reference(prompt, 4)
    kvm.reset_prefix_cache()
    assert kvm.pool.num_free == kvm.num_blocks


def test_branches_after_their_commit_start_together():
    # The commit has finished: both branches find its prompt cached (the tail too), so neither
    # waits for the other's recomputed last token.
    sched, kv, _kvm = make(budget=256)
    prompt = [(3 * j) % 50 for j in range(14)]
    run_all(sched, kv, [Request("c", prompt, SamplingParams(max_tokens=0), max_tokens=0)])
    branches = [req(f"b{i}", prompt, 3) for i in range(2)]
    computed = _count_computed(kv)
    run_all(sched, kv, branches)
    assert computed[0] == 2
    assert [r.num_cached_tokens for r in branches] == [13, 13]


def test_a_request_owed_prompt_logprobs_is_not_held_for_a_same_prompt():
    # Its scored rows must be its own: it computes them beside the other request.
    sched, _kv, _kvm = make(budget=256)
    prompt = [(3 * j) % 50 for j in range(10)]
    plain = req("a", prompt, 2)
    scored = Request(
        "s",
        prompt,
        SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0),
        max_tokens=2,
    )
    for r in (plain, scored):
        sched.add_request(r)
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["a", "s"]
    assert scored.prompt_source is None


def test_a_waiting_request_is_looked_up_once_for_hold_back_and_admission():
    # r0 is admitted first; the others share only 8 tokens with it, so the hold-back check finds
    # them free to start, and their admission reuses the check's lookup of their cached prefix.
    sched, _kv, kvm = make(budget=256)
    finds = []
    find = kvm.radix.find
    kvm.radix.find = lambda tokens, salt=None: finds.append(tuple(tokens)) or find(tokens, salt)
    reqs = [req(f"r{i}", [5, 6, 7, 8, 9, 10, 11, 12] + [60 + i] * 30, 2) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["r0", "r1", "r2"]
    assert finds == [tuple(r.token_ids[: r.num_cacheable_tokens]) for r in reqs]


def test_salted_requests_do_not_share():
    sched, kv, _kvm = make()
    prompt = list(range(20))
    run_all(sched, kv, [req("a", prompt, 2, cache_salt="x")])
    b = req("b", prompt, 2, cache_salt="y")
    c = req("c", prompt, 2, cache_salt="x")
    run_all(sched, kv, [b])
    run_all(sched, kv, [c])
    assert b.num_cached_tokens == 0
    assert c.num_cached_tokens == 19


def test_preempted_request_finds_its_prefix_again():
    # Two requests grow to 5 blocks each in a pool of 9: the newer one is preempted once, and the
    # blocks it had computed are still cached when it comes back.
    sched, kv, kvm = make(num_blocks=9, budget=64)
    reqs = [req(f"r{i}", [i] * 9, 10) for i in range(2)]
    run_all(sched, kv, reqs)
    assert sched.stats.num_preemptions == 1
    assert kvm.stats.hit_tokens == 16
    for r in reqs:
        assert r.output_token_ids == reference(r.prompt_token_ids, 10)


def test_longest_prefix_match_first_without_starvation():
    sched, kv, _kvm = make(budget=64, max_seqs=1, policy="lpm")
    shared = list(range(40))
    run_all(sched, kv, [req("warm", shared, 1)])
    cold = req("cold", [90] * 20, 1)
    hot = [req(f"hot{i}", shared + [i], 1) for i in range(12)]
    for r in [cold, *hot]:
        sched.add_request(r)
    order = []
    while sched.num_unfinished:
        s = sched.schedule()
        order += [
            x.request.request_id for x in s.scheduled if x.request.num_computed_tokens == 0 or x.samples
        ]
        sched.update_from_output(s, kv.run(s, sched))
    first_seen = list(dict.fromkeys(order))
    assert first_seen[0].startswith("hot")
    assert first_seen.index("cold") <= sched.config.max_skips + 1  # bounded waiting


def test_abort_frees_blocks():
    sched, kv, kvm = make(caching=False)
    r = req("a", list(range(10)), 50)
    sched.add_request(r)
    s = sched.schedule()
    sched.update_from_output(s, kv.run(s, sched))
    assert kvm.block_ids("a")
    sched.finish_requests(["a"], "abort")
    assert r.finish_reason == "abort" and not kvm.holds("a") and not kvm.block_ids("a")
    assert kvm.pool.num_free == kvm.num_blocks
    sched.check()
