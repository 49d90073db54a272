"""select's decision rules on hand-made logprobs, and where a choice's scored tokens start."""

from __future__ import annotations

import math

import pytest

import pagoda.lang as pl
from pagoda.tokenizer.spans import choice_spans

from .lang_fakes import FakeBackend


def tokens(*logprobs: float) -> list[tuple[float, int, None]]:
    return [(lp, i, None) for i, lp in enumerate(logprobs)]


def decide(method, choices, cond, uncond=None):
    normalized = [math.fsum(t[0] for t in c) / len(c) for c in cond]
    return method(
        choices=choices,
        normalized_prompt_logprobs=normalized,
        input_token_logprobs=cond,
        output_token_logprobs=[[] for _ in choices],
        unconditional_token_logprobs=uncond,
    )


def test_token_length_normalized_takes_the_best_mean_and_the_first_of_ties() -> None:
    cond = [tokens(-1.0, -3.0), tokens(-1.5), tokens(-2.5, -0.5, -0.5)]  # means -2, -1.5, -1.1667
    assert decide(pl.token_length_normalized, ["a", "b", "c"], cond).decision == "c"
    tie = [tokens(-1.0), tokens(-0.5, -1.5)]
    assert decide(pl.token_length_normalized, ["a", "b"], tie).decision == "a"


def test_greedy_token_selection_walks_position_by_position() -> None:
    # "a" and "b" tie on the first token; at the second "b" wins although "c" has the best mean.
    cond = [tokens(-0.5, -3.0), tokens(-0.5, -1.0), tokens(-0.9)]
    result = decide(pl.greedy_token_selection, ["a", "b", "c"], cond)
    assert result.decision == "b"
    # A choice that ends early continues at its mean: "c" (-0.9 then -0.9) beats "d" (-0.9 then -2).
    cond = [tokens(-0.9), tokens(-0.9, -2.0)]
    result = decide(pl.greedy_token_selection, ["c", "d"], cond)
    assert result.decision == "c"
    assert result.meta_info["greedy_logprob_matrix"] == [[-0.9, -0.9], [-0.9, -2.0]]


def test_unconditional_likelihood_normalized_rewards_what_the_prompt_adds() -> None:
    cond = [tokens(-1.0, -1.0), tokens(-2.0, -0.5)]
    # "a" is likely anyway; "b"'s second token gains 3 nats from the prompt.
    uncond = [[(None, 0, None), (-1.1, 1, None)], [(None, 0, None), (-3.5, 1, None)]]
    result = decide(pl.unconditional_likelihood_normalized, ["a", "b"], cond, uncond)
    assert result.decision == "b"
    assert result.meta_info["normalized_unconditional_prompt_logprobs"] == pytest.approx([-0.45, 0.5])
    assert decide(pl.token_length_normalized, ["a", "b"], cond).decision == "a"
    with pytest.raises(ValueError, match="needs unconditional"):
        decide(pl.unconditional_likelihood_normalized, ["a", "b"], cond)


def test_choice_spans_start_after_the_shared_tokens() -> None:
    prompt = [1, 2, 3]
    # plain continuation; a choice that merged with the prompt's last token; one that rewrote all
    # of it (never position 0); one that adds a single token.
    assert choice_spans(prompt, [[1, 2, 3, 7, 8], [1, 2, 9, 8], [5, 6], [1, 2, 3, 4]]) == [3, 2, 1, 3]


def test_select_uses_the_unconditional_pass_only_when_the_method_needs_it() -> None:
    fake = FakeBackend(logprob=lambda before, tok: -0.1 * len(before) - (tok == ord("b")))

    @pl.function
    def prog(s, method):
        s += "Q: " + pl.select("v", choices=["ab", "ba", "c"], choices_method=method)

    prog.run(pl.token_length_normalized, backend=fake)
    assert len(fake.of_kind("score")) == 1
    state = prog.run(pl.unconditional_likelihood_normalized, backend=fake)
    _, unconditional = fake.of_kind("score")[1:]
    assert unconditional == ([[ord("a"), ord("b")], [ord("b"), ord("a")], [ord("c")]], [1, 1, 1])
    assert state["v"] in ("ab", "ba", "c")
    meta = state.get_meta_info("v")
    assert [u[0][0] for u in meta["unconditional_token_logprobs"]] == [None, None, None]
    assert repr(pl.greedy_token_selection) == "pl.greedy_token_selection"
