"""Token-budget scheduler: running requests first, then waiting ones; chunked prefill; recompute
preemption. One rule for everything: each step, num_computed_tokens catches up with num_tokens as
far as the token budget, max_num_seqs and the KV pool allow (a waiting request whose next
prompt blocks, or whose whole uncached prompt, others compute in this step waits for them:
in-batch prefix caching).

The scheduler is the only writer of a request's `num_computed_tokens` and status; the KV manager
owns its blocks (the scheduler sees them only as the block table it hands the runner)."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from pagoda.cache.kv_manager import KVCacheManager
from pagoda.config import SchedulerConfig
from pagoda.request import Request, RequestStatus
from pagoda.step import SampledTokens, ScheduledRequest, SchedulerOutput

# Above this many waiting requests, longest-prefix-match ordering costs more than it saves.
_LPM_MAX_QUEUE = 128

# In-batch prefix caching (as SGLang's): a waiting request whose next this many uncached prompt
# tokens (rounded up to whole blocks) are all computed by other requests in this step waits a
# step, then finds them cached, instead of computing them side by side.
# Same prompts, however short (the branches of a fork sent together): a waiting request whose
# prompt a running request has too shares that request's prompt KV as an n > 1 sample shares
# its sibling's (the partly filled last block copied), at once if it is computed, after a step
# if that request computes it in this one.
IN_BATCH_MIN_SHARED_TOKENS = 32

# A block a step computes, as the key a waiting request sharing it would look up: the cache salt,
# the block's start, and its tokens with the block's before them (two requests with equal keys but
# different earlier tokens are possible, and harmless: one of them waits a step for nothing).
_BlockKey = tuple


@dataclass
class _InBatch:
    """What this step computes, for the waiting requests' hold-back: the keys of the whole prompt
    blocks, and how far into its prompt each request computing prompt tokens gets."""

    blocks: set[_BlockKey]
    prompt_ends: dict[str, int]  # request id -> prompt tokens computed after this step

    def __bool__(self) -> bool:
        return bool(self.blocks)


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_finished: int = 0
    num_computed_tokens: int = 0  # tokens run through the model (prompt, recompute and decode)
    num_steps: int = 0  # forward passes
    num_sequence_steps: int = 0  # forward passes summed over the sequences in them
    num_rejected_draft_tokens: int = 0  # draft tokens computed and then thrown away


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        # Same prompts: each request's prompt key (cache salt, length, hash of the tokens), and a
        # running request for each key, whose prompt KV a waiting request with that prompt shares.
        self._prompt_keys: dict[str, tuple] = {}
        self._running_prompts: dict[tuple, Request] = {}

    # ---- queue management ------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        n = request.num_prompt_tokens
        self._prompt_keys[request.request_id] = (request.cache_salt, n, hash(tuple(request.token_ids[:n])))
        self.waiting.append(request)

    def finish_requests(
        self, request_ids: list[str], reason: str, stop_reasons: Mapping[str, str] | None = None
    ) -> list[Request]:
        """Finish requests from outside the step (abort, stop string, error); frees their blocks
        now. Unknown and finished ids are skipped."""
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            if req.status is RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            req.finish_reason = reason
            req.stop_reason = stop_reasons.get(rid) if stop_reasons else None
            self._finish(req)
            done.append(req)
        return done

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- schedule --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled_ids: set[str] = set()

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if req.num_draft_tokens and num_new < req.num_tokens - req.num_computed_tokens:
                self._drop_drafts(req)  # drafts are verified in one go or not at all
                num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate_more(req, num_new):
                victim = self.running.pop()  # the newest running request yields its blocks
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, num_new, self.kv.block_ids(req.request_id)))
                scheduled_ids.add(req.request_id)
                budget -= num_new
                i += 1
                continue
            break

        if not out.preempted and self.waiting:
            computing = _InBatch(set(), {})
            for s in out.scheduled:
                self._note_computing(computing, s.request, s.num_new_tokens)
            self._schedule_waiting(out, budget, scheduled_ids, computing)
        out.block_copies = self.kv.take_copies()
        self.stats.num_computed_tokens += out.num_tokens
        self.stats.num_steps += not out.is_empty
        self.stats.num_sequence_steps += len(out.scheduled)
        return out

    def _schedule_waiting(
        self, out: SchedulerOutput, budget: int, scheduled_ids: set[str], computing: _InBatch
    ) -> None:
        queue = self._waiting_order()
        started: list[Request] = []
        for req in queue:
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            src = req.fork_source
            found = None  # its cached prefix, looked up once for the hold-back and the allocation
            if src is not None:
                if src.is_finished:
                    req.fork_source = None
                elif src.status is not RequestStatus.RUNNING or src.num_computed_tokens < req.num_tokens - 1:
                    continue  # n > 1: wait until the sibling has computed the shared prompt
            else:
                src = req.prompt_source = self._same_prompt(req)
                if src is not None and src.num_computed_tokens < req.num_tokens - 1:
                    if computing.prompt_ends.get(src.request_id, 0) >= req.num_tokens - 1:
                        continue  # it computes the prompt in this step: share it after
                    src = req.prompt_source = None
            if src is None and computing:
                found = self.kv.lookup(req)
                if self._held_back(req, found.num_blocks * self.kv.block_size, computing.blocks):
                    # In-batch prefix caching: others compute this one's next prompt blocks in
                    # this step, so it waits a step and then finds them in the cache.
                    continue
            alloc = self.kv.allocate_first(req, budget, found)
            if alloc is None:
                break  # the pool is full: later requests would not fit either
            num_new = alloc.num_new
            req.num_computed_tokens = alloc.num_computed
            if req.num_cached_tokens < 0:  # first admission (not a resume after preemption)
                req.num_cached_tokens = alloc.num_computed
            req.fork_source = req.prompt_source = None
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._running_prompts.setdefault(self._prompt_keys[req.request_id], req)
            started.append(req)
            out.scheduled.append(ScheduledRequest(req, num_new, self.kv.block_ids(req.request_id)))
            scheduled_ids.add(req.request_id)
            budget -= num_new
            self._note_computing(computing, req, num_new)
        for req in started:
            self.waiting.remove(req)
        if started and self.config.policy == "lpm":
            last_arrival = max(r.arrival_time for r in started)
            for req in self.waiting:
                if req.arrival_time < last_arrival:
                    req.skips += 1

    def _note_computing(self, computing: _InBatch, req: Request, num_new: int) -> None:
        """Note the whole prompt blocks that `req` computes (part of) this step, and how far into
        its prompt it gets."""
        if self.kv.radix is None:
            return
        bs = self.kv.block_size
        start = req.num_computed_tokens
        end = min(start + num_new, req.num_prompt_tokens)
        if end <= start:
            return
        for b in range(start // bs, -(-end // bs)):
            if (b + 1) * bs <= req.num_prompt_tokens:
                computing.blocks.add(self._block_key(req, b * bs, bs))
        computing.prompt_ends[req.request_id] = end

    def _same_prompt(self, req: Request) -> Request | None:
        """A running request with the same prompt (and cache salt), whose prompt KV this one can
        share: None if there is none, or if this one is owed prompt logprobs (it computes its
        scored rows itself) or resumes after a preemption."""
        if self.kv.radix is None or req.num_tokens != req.num_prompt_tokens:
            return None
        if req.num_cacheable_tokens != req.num_tokens - 1:
            return None
        other = self._running_prompts.get(self._prompt_keys[req.request_id])
        n = req.num_prompt_tokens
        if other is None or other.token_ids[:n] != req.token_ids[:n]:
            return None
        return other

    def _held_back(self, req: Request, cached: int, computing: set[_BlockKey]) -> bool:
        """Whether the blocks after the request's `cached` tokens (its cached whole blocks),
        IN_BATCH_MIN_SHARED_TOKENS of them at least, are all being computed by others in this step."""
        bs = self.kv.block_size
        blocks = -(-IN_BATCH_MIN_SHARED_TOKENS // bs)
        if cached + blocks * bs > req.num_cacheable_tokens:
            return False
        return all(self._block_key(req, cached + i * bs, bs) in computing for i in range(blocks))

    @staticmethod
    def _block_key(req: Request, start: int, bs: int) -> _BlockKey:
        return (req.cache_salt, start, tuple(req.token_ids[max(0, start - bs) : start + bs]))

    def _waiting_order(self) -> list[Request]:
        """FCFS, or longest cached prefix first (with starving requests served first)."""
        if (
            self.config.policy == "fcfs"
            or self.kv.radix is None
            or not 1 < len(self.waiting) <= _LPM_MAX_QUEUE
        ):
            return list(self.waiting)
        starving = [r for r in self.waiting if r.skips >= self.config.max_skips]
        rest = [r for r in self.waiting if r.skips < self.config.max_skips]
        rest.sort(key=lambda r: -self.kv.cached_prefix_len(r))  # stable: FCFS among equals
        return starving + rest

    # ---- update ----------------------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, SampledTokens]) -> list[Request]:
        """Advance computed tokens, settle jump-forward drafts, append sampled tokens, finish
        requests. Returns the requests that got new tokens or finished."""
        changed = []
        max_len = self.config.max_model_len
        for s in out.scheduled:
            req = s.request
            req.num_computed_tokens += s.num_new_tokens
            result = sampled.get(req.request_id)
            if result is None:
                if req.prompt_only and req.num_computed_tokens == req.num_tokens:
                    req.finish_reason = "length"  # the prompt is in the cache; nothing to sample
                    self.running.remove(req)
                    self._finish(req)
                    changed.append(req)
                else:
                    self.kv.cache(req)
                continue
            k = req.num_draft_tokens
            if k:
                # The KV of rejected drafts is stale; accepted ones come back as verified tokens.
                req.num_computed_tokens -= k - result.num_accepted_drafts
                del req.token_ids[-k:]
                req.num_draft_tokens = 0
                self.stats.num_rejected_draft_tokens += k - result.num_accepted_drafts
            for tok in result.tokens:
                req.append_token(tok)
                if req.check_stop(max_len):
                    # Stopped inside accepted drafts: the KV past the last kept token is not its own.
                    req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens)
                    break
            if req.finish_reason is not None:
                self.running.remove(req)
                self._finish(req)
            else:
                self.kv.cache(req)
                if k:
                    # Blocks that held only rejected drafts go back to the pool now.
                    self.kv.trim(req)
                req.token_ids.extend(result.drafts)
                req.num_draft_tokens = len(result.drafts)
            changed.append(req)
        return changed

    # ---- internals -------------------------------------------------------------------------------
    def _drop_drafts(self, req: Request) -> None:
        req.drop_drafts()
        # Their KV, if computed, is simply overwritten; the last known token is computed again.
        req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)

    def _release(self, req: Request) -> None:
        """Give up the request's KV; its computed full blocks stay cached, so that it (after a
        preemption), a sibling or the next turn of a conversation finds them; so does its partly
        filled last block, which it writes no more."""
        self.kv.cache(req, final=True)
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0

    def _preempt(self, req: Request) -> None:
        self._drop_drafts(req)
        self._release(req)
        self._stop_sharing(req)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(req)

    def _finish(self, req: Request) -> None:
        self._release(req)
        self._stop_sharing(req)
        req.status = RequestStatus.FINISHED
        self.stats.num_finished += 1
        del self.requests[req.request_id]
        del self._prompt_keys[req.request_id]

    def _stop_sharing(self, req: Request) -> None:
        """The request holds no KV now: no waiting request may share its prompt's."""
        key = self._prompt_keys[req.request_id]
        if self._running_prompts.get(key) is req:
            del self._running_prompts[key]

    def check(self) -> None:
        """Invariants: block accounting, and only running requests hold KV blocks."""
        self.kv.check(r.request_id for r in self.running)
