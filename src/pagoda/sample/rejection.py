"""Speculative (rejection) sampling: verify a draft model's sampled tokens against the target.

For a span of k drafts d_0..d_{k-1}, each sampled by the draft model from q_i, and the target's
final distributions p_0..p_k at the span's k + 1 rows: draft i is accepted with probability
min(1, p_i(d_i) / q_i(d_i)); at the first rejection the row's token is drawn from the normalised
residual max(0, p_i - q_i); with all k accepted the bonus row draws from p_k. Every emitted token
then follows the target's distribution exactly, whatever q is (Leviathan et al. 2023, "Fast
Inference from Transformers via Speculative Decoding"; Chen et al. 2023, "Accelerating Large
Language Model Decoding with Speculative Sampling").

All spans' draft rows are handled in one batch of tensor operations; only the accepted counts
come back to the host (one flag per draft token, not per vocabulary entry).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class RejectionRows:
    """The draft rows of every span verified by rejection sampling, flattened, as positions into the
    random rows' probabilities (spans in order, each span's drafts in order)."""

    positions: torch.Tensor  # [N] int64: row of draft i among the rows the probabilities cover
    draft_token_ids: torch.Tensor  # [N] int64
    draft_probs: torch.Tensor  # [N, V] float32: q_i, normalised
    accept_uniforms: torch.Tensor  # [N] float32 in [0, 1): the acceptance test's draws
    span_lengths: tuple[int, ...]  # drafts per span (they sum to N)


def prepare_residual(probs: torch.Tensor, rows: RejectionRows) -> torch.Tensor:
    """Decide each draft's acceptance, and replace its row of `probs` ([R, V] unnormalised target
    weights, modified in place) by the residual max(0, p - q) (p itself where that is all zero), so
    that one draw over `probs` gives each rejected row its resampled token and each bonus row its
    sample from p. Returns [N] bool: draft i passed its own acceptance test (the span's accepted
    count is the number passed before the first failure: see `accepted_counts`)."""
    weights = probs.index_select(0, rows.positions)
    # A fully masked row has total 0: its p is all zeros (every draft is rejected, as for any
    # token the target cannot emit), never NaN.
    total = weights.sum(dim=-1, keepdim=True).clamp_(min=torch.finfo(weights.dtype).tiny)
    index = rows.draft_token_ids.unsqueeze(1)
    p_draft = (weights.gather(1, index) / total).squeeze(1)
    q_draft = rows.draft_probs.gather(1, index).squeeze(1)
    # u < p / q, without the division; q = 0 (the draft claims it could not have sampled d) rejects.
    accepted = (q_draft > 0) & (rows.accept_uniforms * q_draft < p_draft)
    residual = weights.div_(total).sub_(rows.draft_probs).clamp_(min=0.0)  # in place: one pass each
    empty = residual.sum(dim=-1) <= 0  # p <= q everywhere, so p = q: draw from p
    if bool(empty.any()):
        residual[empty] = probs[rows.positions[empty]]
    probs.index_copy_(0, rows.positions, residual)
    return accepted


def accepted_counts(accepted: torch.Tensor, span_lengths: Sequence[int]) -> tuple[int, ...]:
    """For each span: how many of its drafts pass before the first that fails."""
    flags = accepted.tolist()
    counts = []
    start = 0
    for length in span_lengths:
        n = 0
        while n < length and flags[start + n]:
            n += 1
        counts.append(n)
        start += length
    return tuple(counts)
