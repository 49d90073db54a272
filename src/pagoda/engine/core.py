"""The engine core: a scheduler, a KV cache and a model runner, stepped in one loop.

It speaks only messages (engine/messages.py): `EngineCoreRequest` in, `EngineCoreOutput` out, an
`EngineStats` snapshot on request. Every way a request ends early (a stop string the front end
found, a client that went away, a user abort, shutdown) goes through `abort_requests`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping

from pagoda.cache.kv_manager import KVCacheManager
from pagoda.config import EngineConfig
from pagoda.engine.messages import EngineCoreOutput, EngineCoreRequest, EngineStats, FinishReason
from pagoda.engine.step_log import StepLog, StepShape
from pagoda.outputs import Logprob, PromptLogprobs
from pagoda.request import Request
from pagoda.sample.metadata import make_generator
from pagoda.scheduler.scheduler import Scheduler
from pagoda.spec import Drafter
from pagoda.spec.draft_model import DraftModelProposer
from pagoda.step import GrammarMasks, SchedulerOutput
from pagoda.structured import GrammarManager
from pagoda.worker.executor import make_executor
from pagoda.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class _GrammarViolation(Exception):
    """A sampled token its grammar rejects: that request fails, the engine serves on."""


class EngineCore:
    def __init__(
        self, config: EngineConfig, grammar_factory: Callable[[], GrammarManager] | None = None
    ) -> None:
        self.config = config
        # --step-log: one JSON line per step (the loop thread writes it; closed by shutdown).
        # Opened first, so that a path it cannot write fails before the model loads.
        self.step_log = StepLog(config.step_log) if config.step_log is not None else None
        self.device = config.model.device
        # One rank in this process, or rank 0 of a tensor-parallel group (the others spawned here
        # or on other nodes); either way this process schedules and samples.
        self.executor = make_executor(config.model, config.cache, config.parallel)
        self.runner = ModelRunner(config.model, config.cache, self.executor)
        cache = config.cache
        self.kv = KVCacheManager(cache.num_blocks, cache.block_size, cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv)
        # The core owns the grammar compiler and masker; it is made on the first structured request
        # (its setup takes seconds) by `grammar_factory`, which holds the tokenizer the core lacks.
        self._grammar_factory = grammar_factory
        self._grammars: GrammarManager | None = None
        self._grammar_lock = threading.Lock()  # front ends compile off the engine loop
        # The draft model (speculative method draft_model), its KV pool and KV manager: rank 0's,
        # owned by the proposer, beside the target's.
        draft_model = None
        if config.draft_model is not None:
            draft_model = DraftModelProposer(
                config.draft_model, config.draft_cache, config.scheduler.max_num_batched_tokens
            )
        self.drafter = Drafter(
            config.speculative,
            config.structured,
            config.max_model_len,
            config.prediction_max_running,
            draft_model,
        )

    # ---- requests --------------------------------------------------------------------------------
    def add_request(self, msg: EngineCoreRequest) -> None:
        if msg.request_id in self.scheduler.requests:
            raise ValueError(f"request id {msg.request_id!r} is already in use")
        request = Request(
            msg.request_id,
            msg.prompt_token_ids,
            msg.params,
            max_tokens=msg.max_tokens,
            eos_token_ids=msg.eos_token_ids,
            cache_salt=msg.cache_salt,
            arrival_time=msg.arrival_time,
            fork_source=self.scheduler.requests.get(msg.fork_of) if msg.fork_of else None,
        )
        if msg.grammar is not None:
            request.grammar = msg.grammar.new_matcher()
        if msg.params.seed is not None and not msg.params.greedy:
            request.generator = make_generator(msg.params.seed, self.device)
        self.scheduler.add_request(request)
        self.drafter.add(msg.request_id, msg.prediction_token_ids)

    def abort_requests(
        self,
        request_ids: Iterable[str],
        reason: FinishReason = "abort",
        stop_reasons: Mapping[str, str] | None = None,
        error: str | None = None,
    ) -> list[EngineCoreOutput]:
        """Finish requests from outside the step (unknown or finished ids are skipped) and free
        their blocks now. Returns their final outputs."""
        finished = self.scheduler.finish_requests(list(request_ids), reason, stop_reasons)
        outputs = [
            EngineCoreOutput(
                r.request_id,
                [],
                None,
                r.finish_reason,
                r.stop_reason,
                max(r.num_cached_tokens, 0),
                error if r.finish_reason == "error" else None,
                prediction_tokens=self.drafter.prediction_tokens(r.request_id),
            )
            for r in finished
        ]
        self.drafter.release(r.request_id for r in finished)
        if finished:
            self._after_change()
        return outputs

    @property
    def grammars(self) -> GrammarManager | None:
        """The grammar compiler and masker once a structured request has made it; None before."""
        return self._grammars

    def grammar_manager(self) -> GrammarManager:
        """The grammar compiler and masker, made on first use (thread-safe)."""
        with self._grammar_lock:
            if self._grammars is None:
                if self._grammar_factory is None:
                    raise ValueError("this engine core has no tokenizer to build grammars from")
                self._grammars = self._grammar_factory()
            return self._grammars

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def stats(self) -> EngineStats:
        s, kv = self.scheduler.stats, self.kv
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_usage=kv.usage,
            num_free_blocks=kv.pool.num_free,
            num_blocks=kv.num_blocks,
            num_preemptions=s.num_preemptions,
            num_finished=s.num_finished,
            num_computed_tokens=s.num_computed_tokens,
            num_steps=s.num_steps,
            num_sequence_steps=s.num_sequence_steps,
            prefix_cache_queries=kv.stats.queried_tokens,
            prefix_cache_hits=kv.stats.hit_tokens,
            num_evicted_blocks=kv.num_evicted_blocks,
            jump_forward_drafts=self.drafter.stats.num_jump_forward_tokens,
            jump_forward_accepted=self.drafter.stats.num_jump_forward_accepted,
            spec_num_drafts=self.drafter.stats.num_drafts,
            spec_num_draft_tokens=self.drafter.stats.num_draft_tokens,
            spec_num_accepted_tokens=self.drafter.stats.num_accepted_tokens,
        )

    # ---- the loop --------------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        began, clock = time.time(), time.perf_counter()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if self.scheduler.waiting and not self.scheduler.running:
                raise RuntimeError(
                    f"the scheduler cannot start {self.scheduler.waiting[0]} with an idle engine"
                )
            return []
        shape = StepShape.of(sched) if self.step_log is not None else None
        result = self.runner.execute(
            sched, self._grammar_masks(sched), self.drafter.draft_probs(sched.scheduled)
        )
        requests = self.scheduler.requests
        for rid, (pos, entries) in result.prompt_logprobs.items():
            _store_prompt_logprobs(requests[rid], pos, entries)
        for rid, entry in result.next_token_logprobs.items():
            requests[rid].next_token_logprobs = entry
        sampled = result.sampled
        failed: dict[str, str] = {}  # request id -> why it fails
        num_running = len(self.scheduler.running)
        for rid, res in list(sampled.items()):
            req = requests[rid]
            self.drafter.record_verified(req, res.num_accepted_drafts)
            if req.grammar is not None:
                try:
                    # The masks left the grammar past every draft: keep the accepted ones, then
                    # the token sampling chose.
                    req.grammar.rollback(req.num_draft_tokens - res.num_accepted_drafts)
                    self._accept(req, res.tokens[-1])
                except _GrammarViolation as exc:
                    failed[rid] = str(exc)
                    del sampled[rid]
                    continue
            res.drafts = self.drafter.propose(req, res.tokens, num_running, self.grammars)
        self.drafter.flush(sampled)  # the draft model's drafts, for every queued request at once
        verified = {rid: requests[rid].num_tokens - requests[rid].num_draft_tokens for rid in sampled}
        changed = self.scheduler.update_from_output(sched, sampled)
        self.drafter.end_step(r.request_id for r in self.scheduler.running)
        outputs = []
        for req in changed:
            # A prompt-only request that finished sampled nothing: no new tokens.
            start = verified.get(req.request_id, req.num_tokens)
            new = req.token_ids[start : req.num_tokens - req.num_draft_tokens]
            lp = result.logprobs.get(req.request_id)
            outputs.append(
                EngineCoreOutput(
                    req.request_id,
                    new,
                    lp[: len(new)] if lp else None,
                    req.finish_reason,
                    req.stop_reason,
                    max(req.num_cached_tokens, 0),
                    prompt_logprobs=_take_prompt_logprobs(req, new),
                    next_token_logprobs=req.next_token_logprobs if req.is_finished else None,
                    prediction_tokens=self.drafter.prediction_tokens(req.request_id),
                )
            )
        self.drafter.release(r.request_id for r in changed if r.is_finished)
        for rid, why in failed.items():
            logger.warning("request %s failed: %s", rid, why)
            outputs.extend(self.abort_requests([rid], "error", error=why))
        self._after_change()
        if self.step_log is not None:
            self.step_log.record(
                began,
                time.perf_counter() - clock,
                shape,
                len(self.scheduler.running),
                len(self.scheduler.waiting),
            )
        return outputs

    def _after_change(self) -> None:
        """The KV accounting invariant, whenever the engine goes idle (and after every step and
        abort with the debug switch on)."""
        if self.config.check_invariants or not self.has_unfinished():
            self.check_invariants()

    # ---- structured output -----------------------------------------------------------------------
    def _grammar_masks(self, sched: SchedulerOutput) -> GrammarMasks | None:
        """The bitmasks of every constrained row this step samples, built before the forward pass:
        one row per plain request, and k + 1 rows for a request with k drafts (row i from its
        grammar after drafts[:i])."""
        reqs = [s.request for s in sched.scheduled if s.samples and s.request.grammar is not None]
        if not reqs:
            return None
        plain = [r for r in reqs if not r.num_draft_tokens]
        drafted = [r for r in reqs if r.num_draft_tokens]
        bitmask = self.grammars.allocate_bitmask(
            len(plain) + 1 + sum(r.num_draft_tokens + 1 for r in drafted)
        )
        rows = {r.request_id: i for i, r in enumerate(plain)}
        free_row = len(plain)  # all-allowed, as allocated
        if plain:
            self.grammars.fill_bitmask(bitmask, [r.grammar for r in plain])
        row = free_row + 1
        one = self.grammars.allocate_bitmask(1) if drafted else None
        for r in drafted:
            # The grammar accepted the drafts when they were proposed: walk it back through them.
            k = r.num_draft_tokens
            drafts = r.token_ids[r.num_tokens - k :]
            r.grammar.rollback(k)
            rows[r.request_id] = row
            for i in range(k + 1):
                self.grammars.fill_bitmask(one, [r.grammar])
                bitmask[row + i].copy_(one[0])
                if i < k and not r.grammar.accept_token(drafts[i]):
                    raise RuntimeError(f"{r.request_id}: its grammar no longer accepts its own draft")
            row += k + 1
        return GrammarMasks(bitmask.to(self.device, non_blocking=True), rows, free_row)

    def _accept(self, req: Request, token: int) -> None:
        if not req.grammar.accept_token(token):
            raise _GrammarViolation(
                f"sampled token {token} is not allowed by the request's grammar (a dead end of the "
                "grammar over this vocabulary); generation stopped"
            )

    def reset_prefix_cache(self) -> int:
        """Drop the unused cached prefixes (the draft model's too); returns the target's count."""
        self.drafter.reset_prefix_cache()
        return self.kv.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks, if any, and close the step log (idempotent)."""
        self.executor.shutdown()
        if self.step_log is not None:
            self.step_log.close()
            self.step_log = None

    def check_invariants(self) -> None:
        self.scheduler.check()
        self.drafter.check(self.scheduler.requests, [r.request_id for r in self.scheduler.running])


def _store_prompt_logprobs(req: Request, pos: int, entries: list[dict[int, Logprob]]) -> None:
    """Record the prompt logprobs of positions pos.. (a recompute after preemption may repeat
    some: the same values). `prompt_logprobs_next` becomes None once every position is in."""
    req.prompt_logprobs[pos : pos + len(entries)] = entries
    end = pos + len(entries)
    req.prompt_logprobs_next = None if end >= req.num_prompt_tokens else max(req.prompt_logprobs_next, end)


def _take_prompt_logprobs(req: Request, new: list[int]) -> PromptLogprobs | None:
    """The request's prompt logprobs, handed over once: with its first tokens, or its final output
    for a prompt-only request (every position is in by then); None on every other output."""
    if req.prompt_logprobs is None or req.prompt_logprobs_next is not None:
        return None
    if not new and not req.is_finished:
        return None
    entries, req.prompt_logprobs = req.prompt_logprobs, None
    return entries
