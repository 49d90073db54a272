"""How `select` turns each choice's token logprobs into a decision (SGLang's three methods and names).

Every method gets, per choice, the logprobs of the choice's own tokens given the prompt before
them (`input_token_logprobs`: a list of (logprob, token_id, token_text) per choice) and their
means (`normalized_prompt_logprobs`); `unconditional_likelihood_normalized` also gets each choice's
tokens scored with no prompt at all. Ties go to the earliest choice.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# One scored token: (logprob, token id, token text); the logprob is None for a first token (no
# context), the id or text None where the backend does not know them.
TokenLogprob = tuple[float | None, int | None, str | None]


@dataclass
class ChoicesDecision:
    decision: str
    meta_info: dict[str, Any] = field(default_factory=dict)


def _argmax(values: Sequence[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))


class ChoicesSamplingMethod(ABC):
    @property
    def requires_unconditional_logprobs(self) -> bool:
        return False

    @abstractmethod
    def __call__(
        self,
        *,
        choices: list[str],
        normalized_prompt_logprobs: list[float],
        input_token_logprobs: list[list[TokenLogprob]],
        output_token_logprobs: list[list[TokenLogprob]],
        unconditional_token_logprobs: list[list[TokenLogprob]] | None = None,
    ) -> ChoicesDecision: ...

    def __repr__(self) -> str:
        return f"pl.{_NAMES.get(type(self), type(self).__name__)}"

    @staticmethod
    def _meta(**kwargs: Any) -> dict[str, Any]:
        return {k: v for k, v in kwargs.items() if v is not None}


class TokenLengthNormalized(ChoicesSamplingMethod):
    """The choice with the highest mean logprob per token (SGLang's default)."""

    def __call__(
        self,
        *,
        choices,
        normalized_prompt_logprobs,
        input_token_logprobs,
        output_token_logprobs,
        unconditional_token_logprobs=None,
    ):
        best = _argmax(normalized_prompt_logprobs)
        return ChoicesDecision(
            choices[best],
            self._meta(
                normalized_prompt_logprobs=normalized_prompt_logprobs,
                input_token_logprobs=input_token_logprobs,
                output_token_logprobs=output_token_logprobs,
            ),
        )


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Compare the choices token by token: keep those with the best logprob at each position until
    one is left. A choice that runs out of tokens continues at its own mean logprob."""

    def __call__(
        self,
        *,
        choices,
        normalized_prompt_logprobs,
        input_token_logprobs,
        output_token_logprobs,
        unconditional_token_logprobs=None,
    ):
        width = max(len(tokens) for tokens in input_token_logprobs)
        matrix = []
        for tokens in input_token_logprobs:
            row = [t[0] for t in tokens]
            mean = math.fsum(row) / len(row)
            matrix.append(row + [mean] * (width - len(row)))
        alive = list(range(len(choices)))
        for j in range(width):
            best = max(matrix[i][j] for i in alive)
            alive = [i for i in alive if matrix[i][j] == best]
            if len(alive) == 1:
                break
        return ChoicesDecision(
            choices[alive[0]],
            self._meta(
                normalized_prompt_logprobs=normalized_prompt_logprobs,
                input_token_logprobs=input_token_logprobs,
                output_token_logprobs=output_token_logprobs,
                greedy_logprob_matrix=matrix,
            ),
        )


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """The choice whose tokens gain the most from the prompt: the mean over its tokens of
    logprob(token | prompt) - logprob(token | no prompt). The first token has no unconditional
    logprob (nothing precedes it) and counts its conditional logprob whole."""

    @property
    def requires_unconditional_logprobs(self) -> bool:
        return True

    def __call__(
        self,
        *,
        choices,
        normalized_prompt_logprobs,
        input_token_logprobs,
        output_token_logprobs,
        unconditional_token_logprobs=None,
    ):
        if unconditional_token_logprobs is None:
            raise ValueError("unconditional_likelihood_normalized needs unconditional_token_logprobs")
        scores = []
        for cond, uncond in zip(input_token_logprobs, unconditional_token_logprobs, strict=True):
            if len(cond) != len(uncond):
                raise ValueError("conditional and unconditional token logprobs differ in length")
            gains = [c[0] - (u[0] or 0.0) for c, u in zip(cond, uncond, strict=True)]
            scores.append(math.fsum(gains) / len(gains))
        best = _argmax(scores)
        return ChoicesDecision(
            choices[best],
            self._meta(
                normalized_prompt_logprobs=normalized_prompt_logprobs,
                input_token_logprobs=input_token_logprobs,
                output_token_logprobs=output_token_logprobs,
                unconditional_token_logprobs=unconditional_token_logprobs,
                normalized_unconditional_prompt_logprobs=scores,
            ),
        )


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
_NAMES = {
    TokenLengthNormalized: "token_length_normalized",
    GreedyTokenSelection: "greedy_token_selection",
    UnconditionalLikelihoodNormalized: "unconditional_likelihood_normalized",
}
