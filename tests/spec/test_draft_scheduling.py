"""Drafts through the scheduler and the KV manager with a fake model: drafts are budgeted like any
other tokens, rejected ones free their slots and blocks, and the accounting invariant holds after
every step."""

from __future__ import annotations

import random

import pytest

from pagoda.cache.kv_manager import KVCacheManager
from pagoda.config import SchedulerConfig
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams
from pagoda.scheduler.scheduler import Scheduler
from pagoda.step import SampledTokens


def fake_token(tokens: list[int]) -> int:
    return (sum(tokens) * 31 + len(tokens)) % 97


def reference(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(fake_token(seq))
    return seq[len(prompt) :]


class DraftingFakeModel:
    """Samples fake_token at every draft position (as the sampler verifies in one call), and
    proposes drafts that are right for a random number of tokens and then wrong."""

    def __init__(self, bs: int, num_drafts: int, seed: int = 0) -> None:
        self.bs = bs
        self.slots: dict[int, int] = {}
        self.num_drafts = num_drafts
        self.rng = random.Random(seed)

    def run(self, sched) -> dict[str, SampledTokens]:
        for src, dst in sched.block_copies:
            for off in range(self.bs):
                if src * self.bs + off in self.slots:
                    self.slots[dst * self.bs + off] = self.slots[src * self.bs + off]
        sampled = {}
        for s in sched.scheduled:
            req = s.request
            start = req.num_computed_tokens
            for pos in range(start, start + s.num_new_tokens):
                self.slots[s.block_ids[pos // self.bs] * self.bs + pos % self.bs] = req.token_ids[pos]
            if not s.samples:
                continue
            end = start + s.num_new_tokens
            ctx = [self.slots[s.block_ids[p // self.bs] * self.bs + p % self.bs] for p in range(end)]
            assert ctx == req.token_ids[:end], f"{req.request_id} read a wrong KV slot"
            k = req.num_draft_tokens
            verified = ctx[: end - k]
            tokens = []
            for i in range(k + 1):
                tok = fake_token(verified + tokens)
                tokens.append(tok)
                if i == k or tok != ctx[end - k + i]:
                    break
            res = SampledTokens(tokens, num_accepted_drafts=len(tokens) - 1)
            # Next drafts: the true continuation up to a random point, then a wrong token.
            seq = verified + tokens
            right = self.rng.randint(0, self.num_drafts)
            drafts = []
            for i in range(self.num_drafts):
                tok = fake_token(seq + drafts)
                drafts.append(tok if i < right else (tok + 1) % 97)
            res.drafts = drafts
            sampled[req.request_id] = res
        return sampled


def _req(rid: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens), max_tokens=max_tokens)


@pytest.mark.parametrize(
    "budget,num_blocks,preempts", [(64, 64, False), (8, 64, False), (32, 16, True), (6, 12, False)]
)
def test_rejected_drafts_free_their_blocks(budget, num_blocks, preempts):
    bs = 4
    kv = KVCacheManager(num_blocks, bs, True)
    scheduler = Scheduler(SchedulerConfig(8, budget, 512, "fcfs"), kv)
    model = DraftingFakeModel(bs, num_drafts=5)
    prompts = [[(i * 7 + j) % 50 for j in range(3 + i * 2)] for i in range(6)]
    prompts.append(prompts[0] + [1, 2])  # a shared prefix
    reqs = [_req(f"r{i}", p, 20) for i, p in enumerate(prompts)]
    for r in reqs:
        scheduler.add_request(r)
    steps = rejected = 0
    while scheduler.num_unfinished:
        sched = scheduler.schedule()
        assert not sched.is_empty
        assert sched.num_tokens <= budget  # drafts count against the token budget
        scheduler.update_from_output(sched, model.run(sched))
        scheduler.check()
        for r in scheduler.running:
            # Exactly the blocks of its computed tokens: rejected drafts gave theirs back.
            assert len(kv.block_ids(r.request_id)) == kv.blocks_needed(r.num_computed_tokens), r
        steps += 1
        assert steps < 2000
    rejected = scheduler.stats.num_rejected_draft_tokens
    for r, p in zip(reqs, prompts, strict=True):
        assert r.output_token_ids == reference(p, 20), r.request_id
        assert r.finish_reason == "length"  # max_tokens reached, also inside accepted drafts
    assert rejected > 0
    assert (scheduler.stats.num_preemptions > 0) == preempts
    kv.reset_prefix_cache()
    assert kv.pool.num_free == num_blocks
