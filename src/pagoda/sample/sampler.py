"""The batched sampler: one call per engine step on the logits of the rows to sample."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagoda.sample.filters import apply_min_p, apply_top_k_top_p
from pagoda.sample.logprobs import LogprobsTensors, gather_logprobs
from pagoda.sample.metadata import RandomRows, SamplingMetadata
from pagoda.sample.processors import apply_bitmask, apply_penalties, apply_token_update
from pagoda.sample.rejection import RejectionRows, accepted_counts, prepare_residual


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
    # Per DraftSpan: how many of its drafts were kept (by exact match, or by rejection sampling for
    # a span with draft_probs); row first_row + num_accepted holds the request's next token.
    num_accepted: tuple[int, ...] = ()


class Sampler:
    """logit_bias → penalties → min_tokens bans → grammar mask → greedy argmax | temperature →
    top-k → top-p → min-p → draw.

    A random row draws one uniform number u from its own generator (or, for unseeded rows, from
    the shared one) and takes the token where the cumulative distribution passes u (inverse CDF):
    a seeded request gets the same tokens whatever else is in the batch and wherever its row is.
    Greedy rows draw nothing.

    Draft spans are verified in the same call: by exact match (deterministic proposers), or, for a
    span with `draft_probs` on random rows, by rejection sampling (sample/rejection.py), which
    draws one more uniform per draft token, after the rows' own.

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

        `drafts`: rows that verify draft tokens, all in this one call. Without draft_probs the
        result is exactly that of sampling one token per step: a seeded request's generator ends as
        if it had drawn only for the rows up to the first rejection. With draft_probs (random rows)
        the emitted tokens follow the target distribution exactly (see DraftSpan)."""
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
        rejecting = _rejection_spans(drafts, random, meta)
        # Where each exact-match seeded span's generator starts, to rewind it past the rows that count.
        starts = [
            d.generator.get_state()
            if d.generator is not None and random is not None and i not in rejecting
            else None
            for i, d in enumerate(drafts)
        ]
        accepted_by_span: dict[int, int] = {}  # the rejection-sampled spans' counts
        if random is None:
            sampled = logits.argmax(dim=-1)
        elif random.is_whole_batch:
            sampled, accepted_by_span = self._sample_random(logits, random, drafts, rejecting)
        else:
            sampled = logits.argmax(dim=-1)
            random_logits = logits.index_select(0, random.rows)
            random_sampled, accepted_by_span = self._sample_random(random_logits, random, drafts, rejecting)
            sampled.index_copy_(0, random.rows, random_sampled)

        logprobs = None
        if raw_logprobs is not None and meta.logprob_rows is not None:
            logprobs = gather_logprobs(
                raw_logprobs, sampled.index_select(0, meta.logprob_rows), meta.logprob_rows, meta.num_logprobs
            )
        num_accepted: tuple[int, ...] = ()
        if drafts:
            tokens = sampled.tolist()
            num_accepted = tuple(
                accepted_by_span[i] if i in accepted_by_span else _num_accepted(tokens, d)
                for i, d in enumerate(drafts)
            )
            for d, state, accepted in zip(drafts, starts, num_accepted, strict=True):
                if state is not None:
                    d.generator.set_state(state)
                    for _ in range(accepted + 1):  # the draws sampling one step at a time makes
                        _draw(torch.empty(1, device=logits.device), d.generator)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs, num_accepted=num_accepted)

    def _sample_random(
        self, logits: torch.Tensor, random: RandomRows, drafts: Sequence[DraftSpan], rejecting: dict[int, int]
    ) -> tuple[torch.Tensor, dict[int, int]]:
        """Filter and draw from the random rows' logits (modified in place). The spans in
        `rejecting` (span index -> position of its first row among the random rows) are verified by
        rejection sampling; returns the tokens and those spans' accepted counts."""
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
        u = self._uniforms(probs.shape[0], random, probs.device)
        if not rejecting:
            return _inverse_cdf(probs, u), {}
        spans = [drafts[i] for i in rejecting]
        rows = RejectionRows(
            positions=torch.tensor(
                [pos + j for i, pos in rejecting.items() for j in range(len(drafts[i].draft_token_ids))],
                dtype=torch.int64,
                device=probs.device,
            ),
            draft_token_ids=torch.tensor(
                [t for d in spans for t in d.draft_token_ids], dtype=torch.int64, device=probs.device
            ),
            draft_probs=_concat([d.draft_probs for d in spans if d.draft_probs is not None]),
            accept_uniforms=self._accept_uniforms(spans, probs.device),
            span_lengths=tuple(len(d.draft_token_ids) for d in spans),
        )
        accepted = prepare_residual(probs, rows)
        sampled = _inverse_cdf(probs, u)
        resampled = sampled.index_select(0, rows.positions)
        sampled.index_copy_(0, rows.positions, torch.where(accepted, rows.draft_token_ids, resampled))
        return sampled, dict(zip(rejecting, accepted_counts(accepted, rows.span_lengths), strict=True))

    def _accept_uniforms(self, spans: Sequence[DraftSpan], device: torch.device) -> torch.Tensor:
        """One U[0, 1) number per draft token, drawn after the rows' own: from the span's generator
        (seeded) or, for all unseeded spans at once, from the shared one."""
        lengths = [len(d.draft_token_ids) for d in spans]
        seeded = [d.generator is not None for d in spans]
        if not any(seeded):
            return torch.rand(sum(lengths), generator=self.generator, device=device)
        u = torch.empty(sum(lengths), device=device)
        num_shared = sum(n for n, s in zip(lengths, seeded, strict=True) if not s)
        if num_shared:
            shared = torch.rand(num_shared, generator=self.generator, device=device)
            is_shared = torch.tensor([not s for s in seeded], device=device).repeat_interleave(
                torch.tensor(lengths, device=device)
            )
            u.masked_scatter_(is_shared, shared)
        start = 0
        for d, n in zip(spans, lengths, strict=True):
            if d.generator is not None:
                u[start : start + n].uniform_(generator=d.generator)
            start += n
        return u

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


def _rejection_spans(
    drafts: Sequence[DraftSpan], random: RandomRows | None, meta: SamplingMetadata
) -> dict[int, int]:
    """The spans verified by rejection sampling (they carry draft_probs and their rows are random),
    each mapped to the position of its first row among the random rows. Checks every draft_probs."""
    rejecting: dict[int, int] = {}
    random_positions: dict[int, int] | None = None
    for i, d in enumerate(drafts):
        q = d.draft_probs
        if q is None:
            continue
        expected = (len(d.draft_token_ids), meta.vocab_size)
        if q.dtype != torch.float32 or tuple(q.shape) != expected:
            raise ValueError(
                f"draft span {i}: draft_probs must be float32 of shape {expected}, "
                f"got {q.dtype} of shape {tuple(q.shape)}"
            )
        if q.device != meta.device:
            raise ValueError(
                f"draft span {i}: draft_probs are on {q.device}, but sampling runs on {meta.device}"
            )
        if d.draft_token_ids and not 0 <= min(d.draft_token_ids) <= max(d.draft_token_ids) < meta.vocab_size:
            raise ValueError(
                f"draft span {i}: a draft token id is outside the vocabulary (size {meta.vocab_size})"
            )
        if random is None or not d.draft_token_ids:
            continue
        if random_positions is None:
            rows = range(meta.num_rows) if random.is_whole_batch else random.rows.tolist()
            random_positions = {row: pos for pos, row in enumerate(rows)}
        first, last = d.first_row, d.first_row + len(d.draft_token_ids)
        if first not in random_positions and last not in random_positions:
            continue  # greedy: the argmax check
        position = random_positions.get(first)
        if position is None or random_positions.get(last) != position + len(d.draft_token_ids):
            raise ValueError(f"draft span {i}: its rows mix greedy and random sampling")
        rejecting[i] = position
    return rejecting


def _concat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


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
