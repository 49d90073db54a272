"""The typed messages of one engine step: what the scheduler hands the model runner
(`SchedulerOutput`), the grammar masks the core builds for it before the forward pass
(`GrammarMasks`), and what comes back to the scheduler (`SampledTokens`).

They live below both, so that the model runner never imports the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagoda.request import Request

if TYPE_CHECKING:
    import torch


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    block_ids: list[int]  # its block table, from the KV manager (read-only here)

    @property
    def completes(self) -> bool:
        """True if this step computes the request's last known token."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_tokens

    @property
    def samples(self) -> bool:
        """True if this step computes the request's last known token, so a new one is sampled
        (never for a prompt-only request: its last token's logits are not needed)."""
        return self.completes and not self.request.prompt_only


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
class GrammarMasks:
    """The step's grammar bitmasks, built before the forward pass and handed to the runner.
    `rows[request_id]` is the first of a constrained request's rows: one per token it samples, so
    with k draft tokens k + 1 rows, row i masking the token after its i-th draft. `free_row` is
    all-allowed, for requests without a grammar."""

    bitmask: torch.Tensor  # int32 [rows, ceil(vocab_size / 32)], on the runner's device
    rows: dict[str, int]
    free_row: int


@dataclass
class SampledTokens:
    """What one step produced for a request: verified tokens (the first `num_accepted_drafts` of
    them are draft tokens that sampling confirmed), then new unverified drafts.

    The verification result of a request with k drafts is `tokens` (accepted drafts, then the
    token sampled where sampling first disagreed, or after the last draft) and
    `num_accepted_drafts`; a proposer then sets `drafts` for the next step."""

    tokens: list[int]
    num_accepted_drafts: int = 0
    drafts: list[int] = field(default_factory=list)
