"""The batched sampler: one call per engine step on the logits of the rows to sample."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagoda.sample.filters import apply_min_p, apply_top_k_top_p
from pagoda.sample.logprobs import LogprobsTensors, gather_logprobs
from pagoda.sample.metadata import RandomRows, SamplingMetadata
from pagoda.sample.processors import apply_bitmask, apply_penalties, apply_token_update


@dataclass(frozen=True)
class DraftSpan:
    """Rows [first_row, first_row + len(draft_token_ids)] of one request: row i samples the token
    after its i-th draft token (row 0 the token after the last verified one). Each row's metadata
    (penalties, bans) and grammar mask are those of the sequence with the drafts before it."""

    first_row: int
    draft_token_ids: tuple[int, ...]
    generator: torch.Generator | None = None  # the request's own (seeded), rewound after verifying
    # float32 [len(draft_token_ids), vocab]: row i is the normalised distribution q_i the draft model
    # sampled draft token i from. None: a deterministic proposer (n-gram, prediction, grammar), whose
    # drafts are verified by an exact-match check (seeded rows: the generator is rewound so that the
    # stream equals sampling one token per step). Given, a random row (temperature > 0) verifies by
    # speculative (rejection) sampling: accept draft i with probability min(1, p_i(d_i) / q_i(d_i)),
    # where p_i is the row's final distribution (after bias, penalties, bans, grammar mask,
    # temperature, top-k, top-p, min-p); at the first rejection the row's token is drawn from the
    # normalised residual max(0, p_i - q_i) (p_i where that is all zero); with every draft accepted
    # the bonus row draws from p_k. The emitted tokens then follow the target distribution exactly
    # (Leviathan et al. 2023; Chen et al. 2023); a seeded request stays deterministic for its seed.
    # Greedy rows keep the argmax check, whatever q.
    draft_probs: torch.Tensor | None = None


@dataclass(frozen=True, eq=False)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None  # None when no row asked for logprobs
    # Per DraftSpan: how many of its drafts the samples confirmed (the sample at the first row that
    # disagrees, or at the last row, is the request's next token).
    num_accepted: tuple[int, ...] = ()


class Sampler:
    """logit_bias → penalties → min_tokens bans → grammar mask → greedy argmax | temperature →
    top-k → top-p → min-p → draw.

    A random row draws one uniform number u from its own generator (or, for unseeded rows, from
    the shared one) and takes the token where the cumulative distribution passes u (inverse CDF):
    a seeded request gets the same tokens whatever else is in the batch and wherever its row is.
    Greedy rows draw nothing.

    generator: the shared generator of unseeded rows (None: torch's default one for the device).
    top_p_candidates: how many top tokens the top-p search looks at before falling back to a full
    sort of that row.
    """

    def __init__(self, generator: torch.Generator | None = None, top_p_candidates: int = 1024) -> None:
        if not isinstance(top_p_candidates, int) or top_p_candidates < 1:
            raise ValueError(f"top_p_candidates must be a positive integer, got {top_p_candidates!r}")
        self.generator = generator
        self.top_p_candidates = top_p_candidates

    def __call__(
        self,
        logits: torch.Tensor,
        meta: SamplingMetadata,
        token_bitmask: torch.Tensor | None = None,
        drafts: Sequence[DraftSpan] = (),
    ) -> SamplerOutput:
        """logits: [B, V] float32, overwritten in place. token_bitmask: int32 [B, ceil(V / 32)].

        `drafts`: rows that verify draft tokens, all in this one call. The result is exactly that of
        sampling one token per step: a seeded request's generator ends as if it had drawn only for
        the rows up to the first rejection."""
        expected = (meta.num_rows, meta.vocab_size)
        if logits.dtype != torch.float32 or tuple(logits.shape) != expected:
            raise ValueError(
                f"logits must be float32 of shape {expected}, got {logits.dtype} of shape {tuple(logits.shape)}"
            )
        if logits.device != meta.device:
            raise ValueError(f"logits are on {logits.device}, but the metadata was built for {meta.device}")

        raw_logprobs = None
        if meta.logprob_rows is not None:
            asking = logits if len(meta.num_logprobs) == meta.num_rows else logits[meta.logprob_rows]
            raw_logprobs = torch.log_softmax(asking, dim=-1)

        if meta.logit_bias is not None:
            apply_token_update(logits, meta.logit_bias, accumulate=True)
        if meta.penalties is not None:
            apply_penalties(logits, meta.penalties)
        if meta.banned is not None:
            apply_token_update(logits, meta.banned, accumulate=False)
        if token_bitmask is not None:
            apply_bitmask(logits, token_bitmask)

        random = meta.random
        # Where each seeded span's generator starts, to rewind it past the rows that count.
        starts = [
            d.generator.get_state() if d.generator is not None and random is not None else None
            for d in drafts
        ]
        if random is None:
            sampled = logits.argmax(dim=-1)
        elif random.is_whole_batch:
            sampled = self._sample_random(logits, random)
        else:
            sampled = logits.argmax(dim=-1)
            random_logits = logits.index_select(0, random.rows)
            sampled.index_copy_(0, random.rows, self._sample_random(random_logits, random))

        logprobs = None
        if raw_logprobs is not None and meta.logprob_rows is not None:
            logprobs = gather_logprobs(
                raw_logprobs, sampled.index_select(0, meta.logprob_rows), meta.logprob_rows, meta.num_logprobs
            )
        num_accepted: tuple[int, ...] = ()
        if drafts:
            tokens = sampled.tolist()
            num_accepted = tuple(_num_accepted(tokens, d) for d in drafts)
            for d, state, accepted in zip(drafts, starts, num_accepted, strict=True):
                if state is not None:
                    d.generator.set_state(state)
                    for _ in range(accepted + 1):  # the draws sampling one step at a time makes
                        _draw(torch.empty(1, device=logits.device), d.generator)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs, num_accepted=num_accepted)

    def _sample_random(self, logits: torch.Tensor, random: RandomRows) -> torch.Tensor:
        """Filter and draw from the random rows' logits (modified in place)."""
        if random.temperature is not None:
            logits.div_(random.temperature)
        probs = torch.softmax(logits, dim=-1)
        if random.top_k is not None or random.top_p is not None:
            apply_top_k_top_p(
                probs,
                random.top_k,
                random.max_top_k,
                random.top_p,
                self.top_p_candidates,
                top_p_within_top_k=random.top_p_within_top_k,
            )
        if random.min_p is not None:
            apply_min_p(probs, random.min_p)
        return _inverse_cdf(probs, self._uniforms(probs.shape[0], random, probs.device))

    def _uniforms(self, num_rows: int, random: RandomRows, device: torch.device) -> torch.Tensor:
        """One U[0, 1) number per random row, each from that row's generator."""
        if not random.seeded:
            return torch.rand(num_rows, generator=self.generator, device=device)
        u = torch.empty(num_rows, device=device)
        if random.shared_positions is not None:
            shared = torch.rand(random.shared_positions.shape[0], generator=self.generator, device=device)
            u.index_copy_(0, random.shared_positions, shared)
        for position, generator in random.seeded:
            _draw(u[position : position + 1], generator)
        return u


def _draw(out: torch.Tensor, generator: torch.Generator) -> None:
    """One seeded row's uniform number (the same call when a draft span's generator is rewound)."""
    out.uniform_(generator=generator)


def _num_accepted(tokens: list[int], span: DraftSpan) -> int:
    drafts = span.draft_token_ids
    for i, draft in enumerate(drafts):
        if tokens[span.first_row + i] != draft:
            return i
    return len(drafts)


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token whose cumulative interval holds u (of the row's total, so weights [B, V] need not be
    normalized; they are overwritten). Zero-weight tokens have empty intervals and are never chosen.
    A row with no valid weight (every token masked) gets the last token id, not an out-of-range one."""
    cdf = weights.cumsum_(dim=-1)
    total = cdf[:, -1:]
    # Keep the target strictly below the total so that rounding cannot step past the last token.
    target = torch.minimum(u.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=weights.shape[-1] - 1)
