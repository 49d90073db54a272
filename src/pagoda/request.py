"""A request as the engine core sees it: one sequence of token ids and how far its KV is computed."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from pagoda.sampling_params import SamplingParams

if TYPE_CHECKING:  # annotations only: the scheduler and the KV cache load neither torch nor a grammar library
    import torch

    from pagoda.structured.interface import GrammarMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """One sequence. A prompt with n > 1 becomes n Requests that share its prompt blocks.

    The scheduling currency is `num_computed_tokens`: every step the scheduler lets it catch up
    with `num_tokens`. Prefill, chunked prefill, a prefix-cache hit, a fork of a sibling and a
    recompute after preemption are all the same rule.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        max_tokens: int,
        eos_token_ids: Iterable[int] = (),
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        fork_source: Request | None = None,
    ) -> None:
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt, then generated tokens
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.max_tokens = max_tokens
        self.cache_salt = cache_salt
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        # The model's end-of-sequence ids (engine state, not the user's), and every id that ends this sequence.
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stop_token_ids = params.stop_token_set(self.eos_token_ids)
        self.generator: torch.Generator | None = None  # set by the engine core for seeded requests

        self.status = RequestStatus.WAITING
        # Tokens whose KV is computed; written by the scheduler only. The blocks holding that KV
        # are the KV manager's record of this request, not the request's.
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prompt tokens served by the prefix cache, set on first schedule
        self.num_preemptions = 0
        self.skips = 0  # times passed over by the longest-prefix-match policy
        # n > 1: a sibling whose prompt KV this request copies instead of computing it again.
        self.fork_source = fork_source
        # In-batch prefix caching: a request that computed all of this one's uncached prompt
        # while it waited a step; it shares that prompt KV as a fork does. Set by the scheduler.
        self.prompt_source: Request | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.grammar: GrammarMatcher | None = None  # structured-output state, advanced by the engine core
        # Drafts (spec/drafter.py): trailing tokens appended unverified. They are computed with the
        # next step and kept only as far as sampling would have picked them too. What the
        # proposers keep about a request (prediction, n-gram index, q) is the drafter's record.
        self.num_draft_tokens = 0
        # Prompt logprobs (SamplingParams.prompt_logprobs): entries filled by the engine core
        # position by position as prompt chunks are computed; `prompt_logprobs_next` is the next
        # position still owed (None once all are in, or when none were asked). The samples of an
        # n > 1 prompt share one set, computed by the first (the others copy its prompt KV).
        self.prompt_logprobs: list[dict | None] | None = None
        self.prompt_logprobs_next: int | None = None
        # SamplingParams.next_token_ids: their entries, set by the engine core with the last row.
        self.next_token_logprobs: dict | None = None
        if params.prompt_logprobs is not None and fork_source is None:
            start = max(1, params.logprob_start_len or 0)
            self.prompt_logprobs = [None] * self.num_prompt_tokens
            self.prompt_logprobs_next = start if start < self.num_prompt_tokens else None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens, verified ones only."""
        return len(self.token_ids) - self.num_prompt_tokens - self.num_draft_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        """Generated tokens, verified ones only."""
        return self.token_ids[self.num_prompt_tokens : len(self.token_ids) - self.num_draft_tokens]

    @property
    def num_cacheable_tokens(self) -> int:
        """How many leading tokens a prefix-cache lookup may serve: never the last (its logits are
        needed), and none from the one before the next prompt position whose logprob is owed
        (the cache holds KV, not the hidden states those logprobs come from)."""
        limit = self.num_tokens - 1
        if self.prompt_logprobs_next is not None:
            limit = min(limit, self.prompt_logprobs_next - 1)
        return limit

    @property
    def prompt_only(self) -> bool:
        """max_tokens 0: finished once the prompt is computed; nothing is sampled."""
        return self.max_tokens == 0

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def drop_drafts(self) -> None:
        """Forget the unverified draft tokens (the scheduler rewinds num_computed_tokens)."""
        k = self.num_draft_tokens
        if k:
            del self.token_ids[-k:]
            if self.grammar is not None:
                self.grammar.rollback(k)
            self.num_draft_tokens = 0

    def check_stop(self, max_model_len: int) -> bool:
        """After a token was appended: set the finish reason if generation must end here."""
        last = self.token_ids[-1]
        if self.num_output_tokens >= self.params.min_tokens and last in self.stop_token_ids:
            self.finish_reason, self.stop_reason = "stop", last
        elif self.grammar is not None and last in self.eos_token_ids:
            # The grammar ended (it only ends on EOS), even under ignore_eos.
            self.finish_reason, self.stop_reason = "stop", last
        elif self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            self.finish_reason = "length"
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
