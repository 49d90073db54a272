"""Tests of the batched sampler: each filter on hand-computed distributions, seeding, logprobs, bitmask."""

from __future__ import annotations

import math

import pytest
import torch
from xgrammar.testing import bool_mask_to_bitmask

from pagoda.sample import DraftSpan, Sampler, SamplingMetadata, SamplingRow, make_generator
from pagoda.sample.filters import apply_min_p, apply_top_k_top_p
from pagoda.sample.sampler import _inverse_cdf
from pagoda.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
NEG_INF = float("-inf")


def row(params: SamplingParams, output=(), prompt=(0,), seed: int | None = None, eos=()) -> SamplingRow:
    generator = make_generator(seed, "cpu") if seed is not None else None
    return SamplingRow(params, list(prompt), list(output), params.stop_token_set(eos), generator)


def run(logits, rows, *, bitmask=None, sampler=None):
    logits = torch.as_tensor(logits, dtype=torch.float32).clone()
    meta = SamplingMetadata.build(rows, logits.shape[1], "cpu")
    return (sampler or Sampler(generator=torch.Generator().manual_seed(0)))(logits, meta, bitmask)


def processed(logits, params: SamplingParams, output=(), prompt=(0,), eos=()) -> torch.Tensor:
    """The logits a greedy row would see after bias, penalties and bans (the greedy path is argmax)."""
    x = torch.tensor([logits], dtype=torch.float32)
    meta = SamplingMetadata.build([row(params, output, prompt, eos=eos)], x.shape[1], "cpu")
    Sampler()(x, meta)
    return x[0]


def filtered_probs(logits, *, top_k=None, top_p=None, min_p=None, candidates=1024) -> torch.Tensor:
    probs = torch.softmax(torch.tensor([logits], dtype=torch.float32), dim=-1)
    vocab = probs.shape[1]
    if top_k is not None or top_p is not None:
        k = torch.tensor([top_k if top_k else vocab])
        p = torch.tensor([top_p], dtype=torch.float32) if top_p is not None else None
        apply_top_k_top_p(probs, k if top_k else None, top_k or 0, p, candidates)
    if min_p is not None:
        apply_min_p(probs, torch.tensor([min_p], dtype=torch.float32))
    return (probs / probs.sum(dim=-1, keepdim=True))[0]


def log_probs(probs) -> list[float]:
    return [math.log(p) for p in probs]


def assert_probs(actual: torch.Tensor, expected) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float32), atol=1e-6, rtol=1e-5)


# --- filters on hand-computed distributions -------------------------------------------------


def test_top_k_keeps_k_best_and_renormalizes():
    probs = filtered_probs(log_probs([0.1, 0.4, 0.2, 0.3]), top_k=2)
    assert_probs(probs, [0.0, 4 / 7, 0.0, 3 / 7])


def test_top_k_keeps_ties_with_the_kth_token():
    probs = filtered_probs(log_probs([0.1, 0.3, 0.3, 0.3]), top_k=2)
    assert_probs(probs, [0.0, 1 / 3, 1 / 3, 1 / 3])


def test_top_k_larger_than_vocab_is_a_no_op():
    assert_probs(filtered_probs(log_probs([0.1, 0.6, 0.3]), top_k=10), [0.1, 0.6, 0.3])


def test_top_p_keeps_smallest_set_reaching_p():
    logits = log_probs([0.05, 0.5, 0.15, 0.3])
    assert_probs(filtered_probs(logits, top_p=0.7), [0.0, 0.5 / 0.8, 0.0, 0.3 / 0.8])
    assert_probs(filtered_probs(logits, top_p=0.85), [0.0, 0.5 / 0.95, 0.15 / 0.95, 0.3 / 0.95])


def test_top_p_always_keeps_the_top_token():
    assert_probs(filtered_probs(log_probs([0.2, 0.7, 0.1]), top_p=0.01), [0.0, 1.0, 0.0])


def test_top_p_keeps_ties_with_the_last_needed_token():
    # 0.4 + one 0.2 reaches 0.5; the other 0.2s are tied with it and stay.
    logits = log_probs([0.4, 0.2, 0.2, 0.2])
    assert_probs(filtered_probs(logits, top_p=0.5), [0.4, 0.2, 0.2, 0.2])
    assert_probs(filtered_probs(log_probs([0.5, 0.2, 0.2, 0.1]), top_p=0.6), [5 / 9, 2 / 9, 2 / 9, 0.0])


def test_top_p_applies_after_top_k():
    # After top-k=3 the distribution is 0.4/0.9, 0.3/0.9, 0.2/0.9; 0.4/0.9 + 0.3/0.9 = 0.78 >= 0.75.
    logits = log_probs([0.4, 0.3, 0.2, 0.1])
    assert_probs(filtered_probs(logits, top_k=3, top_p=0.75), [4 / 7, 3 / 7, 0.0, 0.0])
    # Without top-k, 0.4 + 0.3 = 0.7 < 0.75, so the third token stays.
    assert_probs(filtered_probs(logits, top_p=0.75), [4 / 9, 3 / 9, 2 / 9, 0.0])


def test_top_p_within_top_k_shortcut_matches_general_path():
    probs = torch.softmax(torch.randn(4, 300, generator=torch.Generator().manual_seed(9)) * 3, dim=-1)
    top_k = torch.tensor([5, 40, 300, 7])  # row 2: top-k disabled, and no top-p either
    top_p = torch.tensor([0.5, 0.9, 1.0, 0.99])
    expected = probs.clone()
    apply_top_k_top_p(expected, top_k, 40, top_p, num_candidates=300)
    actual = probs.clone()
    apply_top_k_top_p(actual, top_k, 40, top_p, num_candidates=300, top_p_within_top_k=True)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    assert torch.equal(actual[2], probs[2])
    kept = (actual > 0).sum(-1)
    assert (kept[[0, 1, 3]] <= top_k[[0, 1, 3]]).all() and kept[2] == 300


@pytest.mark.parametrize("candidates", [1, 2, 3, 64])
def test_top_p_full_sort_fallback_matches_candidate_path(candidates):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 50, generator=gen) * torch.tensor([[0.1], [0.5], [1.0], [2.0], [4.0], [8.0]])
    probs = torch.softmax(logits, dim=-1)
    top_p = torch.tensor([0.3, 0.5, 0.9, 0.95, 0.99, 1.0])
    expected = probs.clone()
    apply_top_k_top_p(expected, None, 0, top_p, num_candidates=50)
    actual = probs.clone()
    apply_top_k_top_p(actual, None, 0, top_p, num_candidates=candidates)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    assert torch.equal(actual[5], probs[5])  # top_p = 1 keeps everything
    assert (actual[0] == 0).sum() > 0


def test_min_p_drops_tokens_below_fraction_of_top():
    # threshold 0.25 * 0.5 = 0.125: keeps 0.15, drops 0.1 and 0.05.
    probs = filtered_probs(log_probs([0.5, 0.2, 0.15, 0.1, 0.05]), min_p=0.25)
    assert_probs(probs, [0.5 / 0.85, 0.2 / 0.85, 0.15 / 0.85, 0.0, 0.0])


def test_min_p_zero_keeps_everything():
    assert_probs(filtered_probs(log_probs([0.5, 0.5]), min_p=0.0), [0.5, 0.5])


def test_temperature_scales_logits():
    # Sampling at temperature T from logits l equals sampling from softmax(l / T): check with
    # a batch of identical rows against the hand-computed distribution.
    logits = torch.tensor([[0.0, math.log(2.0)]]).repeat(4000, 1)
    out = run(logits, [row(SamplingParams(temperature=0.5))] * 4000)
    freq = out.sampled_token_ids.bincount(minlength=2).float() / 4000
    expected = torch.tensor([1 / 5, 4 / 5])  # softmax([0, 2 ln 2]) = [1, 4] / 5
    assert (freq - expected).abs().max() < 4 * math.sqrt(0.2 * 0.8 / 4000)


# --- penalties, bias, bans ------------------------------------------------------------------


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = [2.0, -2.0, 2.0, -2.0, 1.0]
    got = processed(logits, SamplingParams(temperature=0.0, repetition_penalty=2.0), output=[1], prompt=[0])
    torch.testing.assert_close(got, torch.tensor([1.0, -4.0, 2.0, -2.0, 1.0]))


def test_repetition_penalty_applies_once_per_distinct_token():
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    got = processed([4.0, -4.0, 1.0], params, output=[0, 1, 1, 0], prompt=[0, 0, 1])
    torch.testing.assert_close(got, torch.tensor([2.0, -8.0, 1.0]))


def test_frequency_and_presence_penalties_count_output_only():
    logits = [1.0, 1.0, 1.0, 1.0]
    params = SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.25)
    got = processed(logits, params, output=[1, 1, 1, 2], prompt=[3, 3])
    torch.testing.assert_close(got, torch.tensor([1.0, 1.0 - 1.5 - 0.25, 1.0 - 0.5 - 0.25, 1.0]))


def test_negative_presence_penalty_rewards_seen_tokens():
    got = processed([0.0, 0.0], SamplingParams(temperature=0.0, presence_penalty=-1.0), output=[1])
    torch.testing.assert_close(got, torch.tensor([0.0, 1.0]))


def test_penalties_follow_logit_bias():
    # bias makes token 0 positive (+3 → 1.0), then repetition divides it.
    params = SamplingParams(temperature=0.0, logit_bias={0: 3.0}, repetition_penalty=2.0)
    got = processed([-2.0, 0.5], params, output=[0])
    torch.testing.assert_close(got, torch.tensor([0.5, 0.5]))


def test_logit_bias_adds_to_listed_tokens():
    got = processed([0.0, 1.0, 2.0], SamplingParams(temperature=0.0, logit_bias={0: 5.0, 2: -1.5}))
    torch.testing.assert_close(got, torch.tensor([5.0, 1.0, 0.5]))


def test_min_tokens_bans_stop_ids_until_reached():
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3])
    logits = [0.0, 9.0, 1.0, 8.0]
    banned = processed(logits, params, output=[2], eos=(1,))
    assert banned[1] == NEG_INF and banned[3] == NEG_INF
    torch.testing.assert_close(banned[[0, 2]], torch.tensor([0.0, 1.0]))
    assert run([logits], [row(params, output=[2], eos=(1,))]).sampled_token_ids.item() == 2
    assert run([logits], [row(params, output=[2, 2], eos=(1,))]).sampled_token_ids.item() == 1


def test_min_tokens_ignore_eos_bans_only_stop_token_ids():
    params = SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=[3], ignore_eos=True)
    got = processed([0.0, 9.0, 1.0, 8.0], params, eos=(1,))
    assert got[1] == 9.0 and got[3] == NEG_INF


def test_penalties_only_touch_their_rows():
    logits = torch.tensor([[1.0, 2.0, 3.0]] * 3)
    rows = [
        row(GREEDY, output=[2]),
        row(SamplingParams(temperature=0.0, frequency_penalty=2.0), output=[2]),
        row(GREEDY),
    ]
    meta = SamplingMetadata.build(rows, 3, "cpu")
    Sampler()(logits, meta)
    torch.testing.assert_close(logits, torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 1.0], [1.0, 2.0, 3.0]]))


# --- greedy and sampling --------------------------------------------------------------------


def test_greedy_is_argmax():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(1))
    out = run(logits, [row(GREEDY)] * 8)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.logprobs is None


def test_greedy_rows_in_mixed_batch_are_argmax_and_draw_nothing():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    seeded = SamplingParams(temperature=1.0, seed=7)
    rows = [row(GREEDY, seed=1), row(seeded, seed=7), row(GREEDY), row(SamplingParams(top_k=5))]
    out = run(logits, rows)
    assert out.sampled_token_ids[[0, 2]].tolist() == logits[[0, 2]].argmax(-1).tolist()
    untouched = make_generator(1, "cpu")
    assert torch.equal(rows[0].generator.get_state(), untouched.get_state())


def test_sampling_frequencies_match_target_distribution():
    target = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    n = 20000
    out = run(target.log().repeat(n, 1), [row(SamplingParams())] * n)
    freq = out.sampled_token_ids.bincount(minlength=5).float() / n
    sigma = (target * (1 - target) / n).sqrt()
    assert ((freq - target).abs() < 4 * sigma).all(), freq


def test_filtered_sampling_frequencies():
    # top_k=3 then top_p=0.8 on [0.4, 0.3, 0.2, 0.1]: after top-k 4/9, 3/9, 2/9; 7/9 < 0.8 so all 3 stay.
    target = torch.tensor([4 / 9, 3 / 9, 2 / 9, 0.0])
    n = 20000
    params = SamplingParams(top_k=3, top_p=0.8, min_p=0.3)  # min_p keeps >= 0.3 * 4/9: all three
    out = run(torch.tensor([0.4, 0.3, 0.2, 0.1]).log().repeat(n, 1), [row(params)] * n)
    freq = out.sampled_token_ids.bincount(minlength=4).float() / n
    sigma = (target * (1 - target) / n).sqrt()
    assert freq[3] == 0
    assert ((freq - target).abs()[:3] < 4 * sigma[:3]).all(), freq


def test_filters_act_on_the_tempered_distribution_in_order():
    n = 4000
    # T=0.5 turns [0.5, 0.3, 0.2] into [25, 9, 4] / 38; top_p=0.85 then drops the last token
    # (25/38 + 9/38 = 0.895), which it would keep untempered (0.5 + 0.3 = 0.8 < 0.85).
    out = run(
        torch.tensor([0.5, 0.3, 0.2]).log().repeat(n, 1),
        [row(SamplingParams(temperature=0.5, top_p=0.85))] * n,
    )
    counts = out.sampled_token_ids.bincount(minlength=3)
    assert counts[2] == 0
    assert abs(counts[0].item() / n - 25 / 34) < 4 * math.sqrt(25 / 34 * 9 / 34 / n)
    # top-p before min-p: top_p=0.75 keeps 0.4, 0.3, 0.2 and min_p=0.3 keeps them all; min-p first
    # would renormalize to [4, 3, 2] / 9, and top-p would then keep only two.
    out = run(
        torch.tensor([0.4, 0.3, 0.2, 0.1]).log().repeat(n, 1),
        [row(SamplingParams(top_p=0.75, min_p=0.3))] * n,
    )
    counts = out.sampled_token_ids.bincount(minlength=4)
    assert counts[3] == 0 and counts[2] > 0


def test_inverse_cdf_edges_skip_zero_probability_tokens():
    weights = torch.tensor([[0.0, 0.3, 0.0, 0.2, 0.0]] * 2)
    u = torch.tensor([0.0, torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)).item()])
    assert _inverse_cdf(weights, u).tolist() == [1, 3]


def test_masked_tokens_are_never_sampled():
    n = 2000
    logits = torch.zeros(n, 6)
    params = SamplingParams(logit_bias={2: -100.0})
    out = run(logits, [row(params)] * n)
    counts = out.sampled_token_ids.bincount(minlength=6)
    assert counts[2] == 0 and (counts[[0, 1, 3, 4, 5]] > 0).all()


def test_seeded_rows_reproduce_across_batches_and_positions():
    gen = torch.Generator().manual_seed(5)
    vocab, steps = 300, 6
    step_logits = [torch.randn(vocab, generator=gen) for _ in range(steps)]
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234)

    def tokens(batch: int, position: int, others: list[SamplingParams]) -> list[int]:
        me = row(params, seed=1234)
        out = []
        for logits in step_logits:
            rows = [row(p, seed=p.seed) for p in others]
            rows.insert(position, me)
            batch_logits = torch.randn(batch, vocab, generator=gen)
            batch_logits[position] = logits
            out.append(run(batch_logits, rows).sampled_token_ids[position].item())
        return out

    alone = tokens(1, 0, [])
    mixed = tokens(4, 2, [SamplingParams(), GREEDY, SamplingParams(seed=99, min_p=0.1)])
    other_sampler = tokens(3, 1, [SamplingParams(top_p=0.5), SamplingParams(seed=3)])
    assert alone == mixed == other_sampler
    assert len(set(alone)) > 1  # it really samples


def test_unseeded_rows_use_the_shared_generator():
    logits = torch.zeros(64, 1000)
    rows = [row(SamplingParams())] * 64
    a = run(logits, rows, sampler=Sampler(generator=torch.Generator().manual_seed(11))).sampled_token_ids
    b = run(logits, rows, sampler=Sampler(generator=torch.Generator().manual_seed(11))).sampled_token_ids
    c = run(logits, rows, sampler=Sampler(generator=torch.Generator().manual_seed(12))).sampled_token_ids
    assert torch.equal(a, b) and not torch.equal(a, c)


# --- logprobs -------------------------------------------------------------------------------


def test_logprobs_come_from_the_raw_distribution():
    raw = torch.tensor([[0.0, 2.0, 1.0, 3.0, -1.0], [1.0, 0.0, 0.0, 0.0, 0.0], [5.0, 4.0, 3.0, 2.0, 1.0]])
    params = SamplingParams(temperature=0.0, logprobs=3, logit_bias={0: 10.0}, repetition_penalty=1.5)
    rows = [row(params, output=[3]), row(GREEDY), row(SamplingParams(temperature=0.0, logprobs=1))]
    out = run(raw, rows)
    lp = out.logprobs
    assert lp is not None and lp.row_indices.tolist() == [0, 2] and lp.num_logprobs == (3, 1)
    expected = torch.log_softmax(raw, dim=-1)
    assert out.sampled_token_ids.tolist() == [0, 0, 0]  # row 0 chose token 0 because of the bias
    assert lp.token_ids[0].tolist() == [0, 3, 1, 2]
    torch.testing.assert_close(lp.logprobs[0], expected[0, [0, 3, 1, 2]])
    assert lp.sampled_token_ranks.tolist() == [4, 1]  # token 0 is 4th in the raw distribution
    dicts = lp.to_dicts()
    assert set(dicts) == {0, 2}
    assert list(dicts[0]) == [0, 3, 1, 2]
    assert [d.rank for d in dicts[0].values()] == [4, 1, 2, 3]
    assert dicts[2] == {0: dicts[2][0]} and dicts[2][0].rank == 1
    assert dicts[2][0].logprob == pytest.approx(expected[2, 0].item())


def test_logprobs_zero_gives_only_the_sampled_token():
    out = run([[0.0, 1.0, 2.0]], [row(SamplingParams(logprobs=0), seed=0)])
    lp = out.logprobs
    assert lp is not None and lp.token_ids.shape == (1, 1)
    token = out.sampled_token_ids.item()
    (only,) = lp.to_dicts()[0].items()
    assert only[0] == token
    assert only[1].logprob == pytest.approx(
        torch.log_softmax(torch.tensor([0.0, 1.0, 2.0]), -1)[token].item()
    )
    assert only[1].rank == 3 - token


def test_top_logprobs_are_sorted():
    logits = torch.randn(3, 200, generator=torch.Generator().manual_seed(8))
    out = run(logits, [row(SamplingParams(logprobs=20))] * 3)
    lp = out.logprobs
    assert lp is not None
    top = lp.logprobs[:, 1:]
    assert (top[:, :-1] >= top[:, 1:]).all()
    assert torch.equal(lp.token_ids[:, 1:], torch.log_softmax(logits, -1).topk(20).indices)
    ranks = (torch.log_softmax(logits, -1) > lp.logprobs[:, :1]).sum(-1) + 1
    assert torch.equal(lp.sampled_token_ranks, ranks)


# --- grammar bitmask ------------------------------------------------------------------------


def test_bitmask_masked_tokens_are_never_sampled():
    vocab, n = 70, 500  # not a multiple of 32
    allowed = torch.zeros(n, vocab, dtype=torch.bool)
    allowed[:, [3, 40, 69]] = True
    logits = torch.zeros(n, vocab)
    logits[:, 0] = 10.0  # the favourite is masked out
    out = run(
        logits, [row(SamplingParams())] * (n - 1) + [row(GREEDY)], bitmask=bool_mask_to_bitmask(allowed)
    )
    assert set(out.sampled_token_ids.tolist()) == {3, 40, 69}


def test_all_ones_bitmask_changes_nothing():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(4))
    rows = [row(SamplingParams(seed=i, top_p=0.9), seed=i) for i in range(4)]
    plain = run(logits, rows).sampled_token_ids
    rows = [row(SamplingParams(seed=i, top_p=0.9), seed=i) for i in range(4)]
    ones = torch.full((4, 4), -1, dtype=torch.int32)
    assert torch.equal(run(logits, rows, bitmask=ones).sampled_token_ids, plain)


def test_bitmask_and_greedy_rows_without_grammar():
    logits = torch.tensor([[5.0, 1.0, 0.0], [5.0, 1.0, 0.0]])
    allowed = torch.tensor([[False, True, True], [True, True, True]])
    out = run(logits, [row(GREEDY), row(GREEDY)], bitmask=bool_mask_to_bitmask(allowed))
    assert out.sampled_token_ids.tolist() == [1, 0]


# --- validation -----------------------------------------------------------------------------


def test_bad_inputs_raise_value_error():
    with pytest.raises(ValueError, match="logit_bias token id 5"):
        SamplingMetadata.build([row(SamplingParams(logit_bias={5: 1.0}))], 5, "cpu")
    with pytest.raises(ValueError, match="stop token id 9"):
        SamplingMetadata.build([row(SamplingParams(min_tokens=1, stop_token_ids=[9]))], 5, "cpu")
    with pytest.raises(ValueError, match="vocab_size"):
        SamplingMetadata.build([], 0, "cpu")
    meta = SamplingMetadata.build([row(GREEDY)], 5, "cpu")
    with pytest.raises(ValueError, match="logits must be float32"):
        Sampler()(torch.zeros(1, 6), meta)
    with pytest.raises(ValueError, match="logits must be float32"):
        Sampler()(torch.zeros(1, 5, dtype=torch.float16), meta)
    with pytest.raises(ValueError, match="token_bitmask"):
        Sampler()(torch.zeros(1, 5), meta, torch.zeros(1, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="top_p_candidates"):
        Sampler(top_p_candidates=0)


def test_empty_batch():
    out = run(torch.zeros(0, 10), [])
    assert out.sampled_token_ids.shape == (0,) and out.logprobs is None


def test_fully_masked_row_gives_an_in_vocabulary_token():
    allowed = torch.zeros(2, 8, dtype=torch.bool)
    out = run(torch.zeros(2, 8), [row(SamplingParams()), row(GREEDY)], bitmask=bool_mask_to_bitmask(allowed))
    assert ((out.sampled_token_ids >= 0) & (out.sampled_token_ids < 8)).all()


def test_make_generator_accepts_any_int_seed():
    a = torch.rand(3, generator=make_generator(-1, "cpu"))
    b = torch.rand(3, generator=make_generator(2**64 - 1, "cpu"))
    assert torch.equal(a, b)


def _draft_rows(params, prompt, history, drafts, generator):
    return [
        SamplingRow(params, prompt, history + drafts[:i], frozenset({0}), generator)
        for i in range(len(drafts) + 1)
    ]


@pytest.mark.parametrize("reject_at", [0, 2, None])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_draft_positions_in_one_call_match_one_token_per_step(reject_at, temperature) -> None:
    """Verifying k drafts in one call gives what sampling one token per step would: the same tokens,
    the same accepted count, and a seeded generator that drew the same uniforms (it ends where the
    step-by-step draws end, so every later token matches too)."""
    vocab, k = 40, 4
    torch.manual_seed(3)
    logits = torch.randn(k + 1, vocab) * 2
    params = SamplingParams(temperature=temperature, seed=11, repetition_penalty=1.3, top_k=20)
    prompt, history = [5, 6, 7], [8]
    sampler = Sampler(torch.Generator().manual_seed(0))
    seeded = temperature > 0

    def one_by_one(drafts):
        gen = make_generator(11, "cpu") if seeded else None
        tokens = []
        for i in range(k + 1):
            row = _draft_rows(params, prompt, history + drafts[:i], [], gen)
            meta = SamplingMetadata.build(row, vocab, "cpu")
            tokens.append(sampler(logits[i : i + 1].clone(), meta).sampled_token_ids.item())
            if i == k or tokens[-1] != drafts[i]:
                break
        return tokens, gen

    # Drafts that sampling confirms up to `reject_at` (found step by step), then wrong ones.
    drafts: list[int] = []
    for i in range(k):
        want, _ = one_by_one(drafts + [-1] * (k - len(drafts)))
        if len(want) <= len(drafts):  # rejected earlier: the rest is never looked at
            drafts.append(1)
            continue
        tok = want[len(drafts)]
        drafts.append((tok + 1) % vocab if i == reject_at else tok)
    expected, ref_gen = one_by_one(drafts)

    gen = make_generator(11, "cpu") if seeded else None
    meta = SamplingMetadata.build(_draft_rows(params, prompt, history, drafts, gen), vocab, "cpu")
    out = sampler(logits.clone(), meta, None, [DraftSpan(0, tuple(drafts), gen)])
    (accepted,) = out.num_accepted
    assert accepted == (k if reject_at is None else reject_at)
    assert out.sampled_token_ids.tolist()[: accepted + 1] == expected
    if seeded:
        assert torch.equal(gen.get_state(), ref_gen.get_state())
