"""Rejection sampling of draft-model drafts (DraftSpan.draft_probs): the emitted tokens follow the
target's distribution exactly, whatever the draft's.

The statistical tests generate many continuations of a tiny "model" whose next-token distribution
depends on the previous token only (a bigram table: p(. | prev) for the target, q(. | prev) for a
deliberately bad draft that puts its mass where the target has little), the way the engine does:
each step proposes k drafts from q, verifies them in one sampler call (thousands of spans at once)
and appends the accepted drafts plus the next token. The counts are compared with the exact target
distribution by Pearson's chi-square test. Each assertion fails a correct sampler with probability
ALPHA = 1e-4 (the seeds are fixed, so a run is reproducible); a sampler that skips the residual
correction is shown to fail the same tests.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from xgrammar.testing import bool_mask_to_bitmask

import pagoda.sample.sampler as sampler_module
from pagoda.sample import DraftSpan, Sampler, SamplingMetadata, SamplingRow, make_generator
from pagoda.sample.rejection import RejectionRows, accepted_counts, prepare_residual
from pagoda.sampling_params import SamplingParams
from stats import chi_square, chi_square_pvalue, pvalue

ALPHA = 1e-4  # false-failure rate of each chi-square assertion
VOCAB = 8
START = 0  # the token before the first generated one
TRIALS = 20_000


def _tables() -> tuple[torch.Tensor, torch.Tensor]:
    """Target logits [V, V] (row: previous token) and a bad draft's probabilities [V, V]: the draft
    prefers exactly the tokens the target finds least likely."""
    g = torch.Generator().manual_seed(1234)
    target = torch.randn(VOCAB, VOCAB, generator=g) * 1.2
    p = torch.softmax(target, dim=-1)
    ranks = p.argsort(dim=-1).argsort(dim=-1)  # 0: the least likely token
    draft_logits = -1.5 * ranks.float() + 0.3 * torch.randn(VOCAB, VOCAB, generator=g)
    return target, torch.softmax(draft_logits, dim=-1)


TARGET_LOGITS, DRAFT_PROBS = _tables()


# ---- statistics ---------------------------------------------------------------------------------
def transition_pvalue(seqs: torch.Tensor, p: torch.Tensor) -> float:
    """Goodness of fit of a Markov chain's observed transitions (prev -> next, pooled over the
    positions of `seqs` [N, L], START before each) to p [V, V] (Anderson and Goodman 1957): the sum
    over previous tokens of Pearson's statistics, each with its own degrees of freedom."""
    prev = torch.cat([torch.full((seqs.shape[0], 1), START), seqs[:, :-1]], dim=1).flatten()
    counts = torch.zeros(VOCAB * VOCAB, dtype=torch.float64)
    counts.index_add_(0, prev * VOCAB + seqs.flatten(), torch.ones(prev.numel(), dtype=torch.float64))
    counts = counts.view(VOCAB, VOCAB)
    total_stat, total_df = 0.0, 0
    for s in range(VOCAB):
        if counts[s].sum() == 0:
            continue
        stat, df = chi_square(counts[s], p[s])
        total_stat, total_df = total_stat + stat, total_df + df
    return pvalue(total_stat, total_df)


def first_two_probs(p: torch.Tensor) -> torch.Tensor:
    """The exact joint distribution [V, V] of the first two generated tokens."""
    return p[START].unsqueeze(1) * p


# ---- an engine-like loop ------------------------------------------------------------------------
def generate(
    k: int,
    length: int,
    params: SamplingParams,
    *,
    trials: int = TRIALS,
    seed: int = 0,
    draft_probs: torch.Tensor = DRAFT_PROBS,
    mask: torch.Tensor | None = None,
    sampler: Sampler | None = None,
) -> tuple[torch.Tensor, list[int]]:
    """`trials` continuations of START, `length` tokens each, drafting k tokens a step from
    draft_probs[prev] and verifying them against TARGET_LOGITS[prev] (banned where mask[prev] is
    False: a grammar). Returns the sequences [trials, length] and every step's accepted counts."""
    g = torch.Generator().manual_seed(seed)
    cdf = draft_probs.double().cumsum(dim=-1)  # the drafts are drawn by inverse CDF
    sampler = sampler or Sampler(torch.Generator().manual_seed(seed + 1))
    seqs: list[list[int]] = [[] for _ in range(trials)]
    active = list(range(trials))
    accepted: list[int] = []
    while active:
        prev = torch.tensor([seqs[t][-1] if seqs[t] else START for t in active])
        drafts = torch.empty(len(active), k, dtype=torch.int64)
        cur = prev
        for i in range(k):
            u = torch.rand(len(active), 1, generator=g)
            cur = torch.searchsorted(cdf[cur], u).squeeze(1).clamp_(max=VOCAB - 1)
            drafts[:, i] = cur
        row_prev = torch.cat([prev.unsqueeze(1), drafts], dim=1)  # [A, k + 1]: each row's previous token
        logits = TARGET_LOGITS[row_prev.flatten()].clone()
        q = draft_probs[row_prev[:, :k]]  # [A, k, V]
        # No penalties here, so every row's history can be left empty (one shared row object).
        row = SamplingRow(params, (START,), (), frozenset())
        rows = [row] * (len(active) * (k + 1))
        spans = [
            DraftSpan(j * (k + 1), tuple(ids), None, qj)
            for j, (ids, qj) in enumerate(zip(drafts.tolist(), q.unbind(0), strict=True))
        ]
        bitmask = None
        if mask is not None:
            bitmask = bool_mask_to_bitmask(mask[row_prev.flatten()])
        meta = SamplingMetadata.build(rows, VOCAB, "cpu")
        out = sampler(logits, meta, bitmask, spans)
        tokens = out.sampled_token_ids.view(len(active), k + 1).tolist()
        for j, n in enumerate(out.num_accepted):
            seqs[active[j]].extend(tokens[j][: n + 1])
        accepted.extend(out.num_accepted)
        active = [t for t in active if len(seqs[t]) < length]
    return torch.tensor([s[:length] for s in seqs]), accepted


def reference_probs(
    temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The target's final distribution [V, V] after mask, temperature, top-k and top-p, computed
    here independently of the sampler (a full sort per row)."""
    logits = TARGET_LOGITS.clone()
    if mask is not None:
        logits.masked_fill_(~mask, -math.inf)
    probs = torch.softmax(logits / temperature, dim=-1)
    out = torch.zeros_like(probs)
    for s in range(VOCAB):
        values, order = probs[s].sort(descending=True)
        keep = (values > 0).sum().item()
        if top_k:
            keep = min(keep, top_k)
        values = values[:keep]
        if top_p < 1.0:
            before = values.cumsum(0) - values
            keep = int((before < top_p * values.sum()).sum())
        out[s, order[:keep]] = probs[s, order[:keep]]
    return out / out.sum(dim=-1, keepdim=True)


# ---- the distribution is the target's -----------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 3])
def test_emitted_tokens_follow_the_target_distribution(k: int) -> None:
    """First token, joint of the first two, and every transition of 4-token continuations match p,
    although the draft is bad (acceptance well below 1)."""
    p = torch.softmax(TARGET_LOGITS, dim=-1)
    seqs, accepted = generate(k, 4, SamplingParams(temperature=1.0), seed=k)
    first = torch.bincount(seqs[:, 0], minlength=VOCAB)
    assert chi_square_pvalue(first, p[START]) > ALPHA
    pairs = torch.bincount(seqs[:, 0] * VOCAB + seqs[:, 1], minlength=VOCAB * VOCAB)
    assert chi_square_pvalue(pairs, first_two_probs(p)) > ALPHA
    assert transition_pvalue(seqs, p) > ALPHA
    # Drafts were accepted and rejected at every length: the test exercised all the paths.
    assert set(accepted) == set(range(k + 1))


def step_outcome_probs(k: int, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The exact law of one verification step from START: cell (n, t_0..t_n), laid out n = 0 first,
    tokens in base V, for n accepted drafts t_0..t_{n-1} and the row-n token t_n. Accepting t_i
    has probability min(p, q)(t_i) (q proposes it, min(1, p / q) keeps it); the rejected row's
    token has max(0, p - q), the bonus row's p."""
    accept = torch.minimum(p, q).double()
    residual = (p - q).clamp(min=0).double()
    cells = []
    prefix = torch.ones(1, dtype=torch.float64)  # the accepted prefixes so far, their last tokens:
    last = torch.tensor([START])
    for n in range(k + 1):
        final = residual if n < k else p.double()
        cells.append((prefix.unsqueeze(1) * final[last]).flatten())
        prefix = (prefix.unsqueeze(1) * accept[last]).flatten()
        last = torch.arange(VOCAB).repeat(last.numel())
    return torch.cat(cells)


@pytest.mark.parametrize("k", [1, 2])
def test_each_accepted_length_has_its_exact_probability(k: int) -> None:
    """Finer than the emitted tokens' law: the joint law of how many drafts a step accepts and
    which tokens it emits (the rejected row's residual, the bonus row's p) is the exact one."""
    p = torch.softmax(TARGET_LOGITS, dim=-1)
    law = step_outcome_probs(k, p, DRAFT_PROBS)
    torch.testing.assert_close(law.sum(), torch.tensor(1.0, dtype=torch.float64))
    seqs, accepted = generate(k, k + 1, SamplingParams(temperature=1.0), seed=20 + k)
    offsets = [sum(VOCAB ** (j + 1) for j in range(n)) for n in range(k + 1)]
    cells = []
    for tokens, n in zip(seqs.tolist(), accepted[:TRIALS], strict=True):
        cell = 0
        for t in tokens[: n + 1]:
            cell = cell * VOCAB + t
        cells.append(offsets[n] + cell)
    counts = torch.bincount(torch.tensor(cells), minlength=law.numel())
    assert chi_square_pvalue(counts, law) > ALPHA


def test_acceptance_rate_is_one_minus_the_total_variation_distance() -> None:
    """The first draft is accepted with probability sum_x min(p(x), q(x)) (Leviathan et al.)."""
    p = torch.softmax(TARGET_LOGITS, dim=-1)[START]
    q = DRAFT_PROBS[START]
    rate = float(torch.minimum(p, q).sum())
    assert 0.1 < rate < 0.5  # a bad draft: rejections are common
    n = TRIALS
    _, accepted = generate(1, 1, SamplingParams(temperature=1.0), trials=n, seed=7)
    observed = sum(a > 0 for a in accepted[:n]) / n
    # |z| < 3.9 fails a correct sampler with probability < ALPHA.
    assert abs(observed - rate) < 3.9 * math.sqrt(rate * (1 - rate) / n)


def test_filtered_and_masked_rows_follow_the_filtered_distribution() -> None:
    """p is what the sampler would draw from: a grammar mask, temperature, top-k and top-p applied.
    The draft puts mass on masked and filtered-out tokens too: none is ever emitted."""
    allowed = torch.ones(VOCAB, VOCAB, dtype=torch.bool)
    allowed[torch.arange(VOCAB), (torch.arange(VOCAB) * 3 + 1) % VOCAB] = False  # one banned token per prev
    params = SamplingParams(temperature=0.7, top_k=6, top_p=0.9)
    p = reference_probs(0.7, 6, 0.9, allowed)
    assert ((p == 0) & (DRAFT_PROBS > 0.05)).any()  # the draft proposes tokens p cannot emit
    seqs, accepted = generate(2, 3, params, seed=11, mask=allowed)
    assert chi_square_pvalue(torch.bincount(seqs[:, 0], minlength=VOCAB), p[START]) > ALPHA
    pairs = torch.bincount(seqs[:, 0] * VOCAB + seqs[:, 1], minlength=VOCAB * VOCAB)
    assert chi_square_pvalue(pairs, first_two_probs(p)) > ALPHA
    assert transition_pvalue(seqs, p) > ALPHA
    assert set(accepted) == {0, 1, 2}


def test_a_good_draft_is_accepted_almost_always() -> None:
    """q = p: every draft's ratio is 1, so every draft is accepted; the output still follows p."""
    p = torch.softmax(TARGET_LOGITS, dim=-1)
    seqs, accepted = generate(3, 4, SamplingParams(temperature=1.0), trials=5_000, seed=5, draft_probs=p)
    assert set(accepted) == {3}
    assert transition_pvalue(seqs, p) > ALPHA


# ---- the tests can fail -------------------------------------------------------------------------
def _without_residual(probs: torch.Tensor, rows: RejectionRows) -> torch.Tensor:
    """A wrong verifier: the acceptance test right, but a rejected row draws from p, not from the
    residual max(0, p - q)."""
    saved = probs.clone()
    accepted = prepare_residual(probs, rows)
    probs.copy_(saved)
    return accepted


def _accept_all(probs: torch.Tensor, rows: RejectionRows) -> torch.Tensor:
    """A wrong verifier: every draft accepted (the output follows q, not p)."""
    prepare_residual(probs, rows)
    return torch.ones_like(rows.draft_token_ids, dtype=torch.bool)


@pytest.mark.parametrize("wrong", [_without_residual, _accept_all], ids=["no-residual", "accept-all"])
def test_the_chi_square_tests_detect_a_wrong_verifier(
    monkeypatch: pytest.MonkeyPatch, wrong: Callable[[torch.Tensor, RejectionRows], torch.Tensor]
) -> None:
    monkeypatch.setattr(sampler_module, "prepare_residual", wrong)
    p = torch.softmax(TARGET_LOGITS, dim=-1)
    # A quarter of the trials already rejects these far below ALPHA.
    seqs, _ = generate(2, 4, SamplingParams(temperature=1.0), trials=TRIALS // 4, seed=2)
    pairs = torch.bincount(seqs[:, 0] * VOCAB + seqs[:, 1], minlength=VOCAB * VOCAB)
    assert chi_square_pvalue(torch.bincount(seqs[:, 0], minlength=VOCAB), p[START]) < ALPHA
    assert chi_square_pvalue(pairs, first_two_probs(p)) < ALPHA
    assert transition_pvalue(seqs, p) < ALPHA


# ---- hand-computed cases ------------------------------------------------------------------------
def test_prepare_residual_by_hand() -> None:
    """p = (.5, .3, .2), q = (.1, .6, .3), draft 1: accepted with probability .3 / .6 = .5; the
    residual is max(0, p - q) = (.4, 0, 0). Draft 0 (q < p) is always accepted."""
    probs = torch.tensor([[5.0, 3.0, 2.0], [5.0, 3.0, 2.0], [5.0, 3.0, 2.0], [1.0, 1.0, 1.0]])
    q = torch.tensor([[0.1, 0.6, 0.3]]).expand(3, 3)
    rows = RejectionRows(
        positions=torch.tensor([0, 1, 2]),
        draft_token_ids=torch.tensor([1, 1, 0]),
        draft_probs=q.contiguous(),
        accept_uniforms=torch.tensor([0.49, 0.51, 0.999]),
        span_lengths=(1, 2),
    )
    accepted = prepare_residual(probs, rows)
    assert accepted.tolist() == [True, False, True]
    torch.testing.assert_close(probs[:3], torch.tensor([[0.4, 0.0, 0.0]] * 3))
    assert probs[3].tolist() == [1.0, 1.0, 1.0]  # a bonus row is left as it was
    assert accepted_counts(accepted, rows.span_lengths) == (1, 0)


def test_residual_of_identical_distributions_falls_back_to_p() -> None:
    p = torch.tensor([[0.25, 0.25, 0.5]])
    rows = RejectionRows(torch.tensor([0]), torch.tensor([2]), p.clone(), torch.tensor([0.5]), (1,))
    probs = p.clone()
    assert prepare_residual(probs, rows).tolist() == [True]
    torch.testing.assert_close(probs, p)


def _span_call(logits, params, drafts, q, *, generator=None, bitmask=None, sampler=None):
    k = len(drafts)
    rows = [SamplingRow(params, [START], list(drafts[:i]), frozenset(), generator) for i in range(k + 1)]
    meta = SamplingMetadata.build(rows, logits.shape[1], "cpu")
    sampler = sampler or Sampler(torch.Generator().manual_seed(0))
    return sampler(logits.clone(), meta, bitmask, [DraftSpan(0, tuple(drafts), generator, q)])


def test_a_draft_the_draft_model_gave_probability_zero_is_rejected() -> None:
    logits = torch.zeros(2, VOCAB)
    q = torch.zeros(1, VOCAB)
    q[0, 5] = 1.0
    for seed in range(20):
        out = _span_call(
            logits,
            SamplingParams(temperature=1.0),
            [3],
            q,
            sampler=Sampler(torch.Generator().manual_seed(seed)),
        )
        assert out.num_accepted == (0,)
        assert out.sampled_token_ids[0].item() != 5  # the residual gives q's only token no mass


def test_a_banned_draft_is_rejected_and_never_resampled() -> None:
    logits = torch.zeros(3, VOCAB)
    allowed = torch.ones(3, VOCAB, dtype=torch.bool)
    allowed[0, 4] = False
    q = torch.full((2, VOCAB), 1.0 / VOCAB)
    for seed in range(20):
        out = _span_call(
            logits,
            SamplingParams(temperature=1.0),
            [4, 1],
            q,
            bitmask=bool_mask_to_bitmask(allowed),
            sampler=Sampler(torch.Generator().manual_seed(seed)),
        )
        assert out.num_accepted == (0,)
        assert out.sampled_token_ids[0].item() != 4


def test_greedy_rows_keep_the_argmax_check() -> None:
    """draft_probs are irrelevant to greedy rows: the drafts that equal the argmax are accepted."""
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3))
    best = logits.argmax(dim=-1).tolist()
    q = torch.full((3, VOCAB), 1.0 / VOCAB)
    wrong = (best[1] + 1) % VOCAB
    out = _span_call(logits, SamplingParams(temperature=0.0), [best[0], wrong, best[2]], q)
    assert out.num_accepted == (1,)
    assert out.sampled_token_ids.tolist() == best


def test_seeded_requests_repeat_and_ignore_the_rest_of_the_batch() -> None:
    """The same seed gives the same tokens and accepted counts, alone or among unseeded spans."""
    k = 3
    params = SamplingParams(temperature=1.0, seed=42)
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(k + 1, VOCAB, generator=g)
    q = torch.softmax(torch.randn(k, VOCAB, generator=g), dim=-1)
    drafts = torch.multinomial(q, 1, generator=g).squeeze(1).tolist()

    def alone(seed: int) -> tuple[list[int], int]:
        results = []
        gen = make_generator(seed, "cpu")
        for _ in range(5):  # five steps from one generator
            out = _span_call(logits, params, drafts, q, generator=gen)
            (n,) = out.num_accepted
            results.append((out.sampled_token_ids[: n + 1].tolist(), n))
        return results

    first = alone(42)
    assert alone(42) == first
    assert len({tuple(t) for t, _ in first}) > 1  # the generator moves on between steps

    # Among unseeded spans (before and after), the seeded one draws the same.
    gen = make_generator(42, "cpu")
    unseeded = SamplingParams(temperature=1.0)
    rows, spans, blocks = [], [], []
    for j, (p_, generator) in enumerate([(unseeded, None), (params, gen), (unseeded, None)]):
        spans.append(DraftSpan(len(rows), tuple(drafts), generator, q))
        rows.extend(SamplingRow(p_, [START], drafts[:i], frozenset(), generator) for i in range(k + 1))
        blocks.append(logits if j == 1 else torch.randn(k + 1, VOCAB, generator=g))
    meta = SamplingMetadata.build(rows, VOCAB, "cpu")
    out = Sampler(torch.Generator().manual_seed(1))(torch.cat(blocks), meta, None, spans)
    n = out.num_accepted[1]
    assert (out.sampled_token_ids[k + 1 : k + 2 + n].tolist(), n) == first[0]


def test_exact_match_spans_are_unchanged_beside_rejection_spans() -> None:
    """A deterministic proposer's span (draft_probs None) in the same call as draft-model spans
    verifies exactly as it would alone, its seeded generator rewound as before."""
    k = 2
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2 * (k + 1), VOCAB, generator=g)
    params = SamplingParams(temperature=0.8, seed=5)
    q = torch.softmax(torch.randn(k, VOCAB, generator=g), dim=-1)

    def exact_alone() -> tuple[list[int], int, torch.Tensor]:
        gen = make_generator(5, "cpu")
        rows = [SamplingRow(params, [START], [1, 2][:i], frozenset(), gen) for i in range(k + 1)]
        out = Sampler(torch.Generator().manual_seed(0))(
            logits[: k + 1].clone(),
            SamplingMetadata.build(rows, VOCAB, "cpu"),
            None,
            [DraftSpan(0, (1, 2), gen)],
        )
        return out.sampled_token_ids.tolist(), out.num_accepted[0], gen.get_state()

    gen = make_generator(5, "cpu")
    rows = [SamplingRow(params, [START], [1, 2][:i], frozenset(), gen) for i in range(k + 1)]
    rows += [
        SamplingRow(SamplingParams(temperature=1.0), [START], [3, 4][:i], frozenset()) for i in range(k + 1)
    ]
    spans = [DraftSpan(0, (1, 2), gen), DraftSpan(k + 1, (3, 4), None, q)]
    out = Sampler(torch.Generator().manual_seed(0))(
        logits.clone(), SamplingMetadata.build(rows, VOCAB, "cpu"), None, spans
    )
    tokens, n, state = exact_alone()
    assert out.num_accepted[0] == n
    assert out.sampled_token_ids[: k + 1].tolist() == tokens
    assert torch.equal(gen.get_state(), state)


def test_logprobs_are_those_of_the_emitted_tokens() -> None:
    k = 2
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(k + 1, VOCAB, generator=g)
    q = torch.softmax(torch.randn(k, VOCAB, generator=g), dim=-1)
    params = SamplingParams(temperature=1.0, logprobs=2)
    out = _span_call(logits, params, [1, 2], q)
    raw = torch.log_softmax(logits, dim=-1)
    entries = out.logprobs.to_dicts()
    for r, token in enumerate(out.sampled_token_ids.tolist()):
        assert entries[r][token].logprob == pytest.approx(raw[r, token].item())


def test_bad_draft_probs_raise_value_error() -> None:
    logits = torch.zeros(3, VOCAB)
    params = SamplingParams(temperature=1.0)
    good = torch.full((2, VOCAB), 1.0 / VOCAB)
    for q, match in [
        (good[:1], "shape"),
        (good.double(), "float32"),
        (torch.full((2, VOCAB + 1), 0.1), "shape"),
    ]:
        with pytest.raises(ValueError, match=match):
            _span_call(logits, params, [1, 2], q)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        _span_call(logits, params, [1, VOCAB], good)
