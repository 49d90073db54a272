"""The typed messages of one engine step: what the scheduler hands the model runner
(`SchedulerOutput`) and what the engine core hands back to the scheduler (`SampledTokens`).

They live below both, so that the model runner never imports the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.request import Request


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True if this step computes the request's last known token, so a new one is sampled."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), before the forward
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SampledTokens:
    """What one step produced for a request: verified tokens (the first `num_accepted_drafts` of
    them are jump-forward drafts that sampling confirmed), then new unverified drafts."""

    tokens: list[int]
    num_accepted_drafts: int = 0
    drafts: list[int] = field(default_factory=list)
