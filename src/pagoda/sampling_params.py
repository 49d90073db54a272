"""User-facing sampling parameters, validated at construction."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

_GREEDY_EPS = 1e-5
MAX_NEXT_TOKEN_IDS = 256  # SamplingParams.next_token_ids: as many as a select has choices
MAX_TEMPERATURE = 100.0
REPETITION_PENALTY_RANGE = (0.01, 100.0)
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


@dataclass(frozen=True)
class StructuredOutputs:
    """Constraints on the output: exactly one of the fields must be set (names as in vLLM).

    ``structural_tag`` is a structural tag (JSON text or dict, ``{"type": "structural_tag", "format":
    ...}``): free text, tagged regions and constrained parts in sequence; the tool-call and
    reasoning constraints of the chat API are built as such (``pagoda.structured.tags``).
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: dict[str, Any] | str | None = None

    def __post_init__(self) -> None:
        given = [
            name
            for name, value in (
                ("json", self.json),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
                ("structural_tag", self.structural_tag),
            )
            if value is not None
        ] + (["json_object"] if self.json_object else [])
        if len(given) != 1:
            raise ValueError(
                "StructuredOutputs needs exactly one of json, regex, choice, grammar, json_object, "
                f"structural_tag; got {given or 'none'}"
            )
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")

    @property
    def kind(self) -> str:
        for name in ("json", "regex", "choice", "grammar", "structural_tag"):
            if getattr(self, name) is not None:
                return name
        return "json_object"


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one prompt's completions. Field names and defaults follow vLLM."""

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    # None: up to max_model_len. 0: a prompt-only request (vLLM's "echo with max_tokens 0"): the
    # engine computes the prompt (its KV goes to the prefix cache) and its prompt logprobs if
    # asked, samples nothing and finishes with reason "length".
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    # The logprob of each prompt token given the ones before it, plus its top-k (vLLM's field);
    # `logprob_start_len` (SGLang's name, a pagoda extension) skips the positions before it.
    prompt_logprobs: int | None = None
    logprob_start_len: int | None = None
    # A pagoda extension for scoring continuations of a prompt (pagoda.lang's select), with
    # max_tokens 0 only: the logprob (and rank) of each of these token ids as the token after the
    # prompt, from the prompt's last row (RequestOutput.next_token_logprobs).
    next_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputs | None = None
    # Predicted output (OpenAI's `prediction`): text (or its token ids) the output is expected to
    # mostly repeat, e.g. the previous version of a file being edited. Its tokens are draft tokens
    # verified like any other (outputs are those without it); it drafts without a speculative_config.
    prediction: str | list[int] | None = None

    def __post_init__(self) -> None:
        def check(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        check(isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        for name in _FLOAT_FIELDS:  # NaN and infinity pass the range checks below (or break them)
            value = getattr(self, name)
            check(
                isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value),
                f"{name} must be a finite number, got {value!r}",
            )
        check(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        # The sampler works in float32: these bounds keep every logit finite (an infinite logit
        # turns the row's probabilities into NaN), with room to spare.
        check(
            self.temperature <= MAX_TEMPERATURE,
            f"temperature must be <= {MAX_TEMPERATURE}, got {self.temperature}",
        )
        check(
            REPETITION_PENALTY_RANGE[0] <= self.repetition_penalty <= REPETITION_PENALTY_RANGE[1],
            f"repetition_penalty must be in [{REPETITION_PENALTY_RANGE[0]}, {REPETITION_PENALTY_RANGE[1]}], "
            f"got {self.repetition_penalty}",
        )
        check(
            isinstance(self.top_k, int) and (self.top_k >= 0 or self.top_k == -1),
            f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}",
        )
        check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        check(self.repetition_penalty > 0.0, f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        check(
            -2.0 <= self.presence_penalty <= 2.0,
            f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
        )
        check(
            -2.0 <= self.frequency_penalty <= 2.0,
            f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
        )
        check(
            self.max_tokens is None
            or (
                isinstance(self.max_tokens, int)
                and not isinstance(self.max_tokens, bool)
                and self.max_tokens >= 0
            ),
            f"max_tokens must be an integer >= 0 (0: the prompt alone), got {self.max_tokens!r}",
        )
        check(
            isinstance(self.min_tokens, int) and self.min_tokens >= 0,
            f"min_tokens must be >= 0, got {self.min_tokens!r}",
        )
        check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
        )
        check(
            self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
            f"logprobs must be an integer in [0, 20], got {self.logprobs!r}",
        )
        check(
            self.prompt_logprobs is None
            or (
                isinstance(self.prompt_logprobs, int)
                and not isinstance(self.prompt_logprobs, bool)
                and 0 <= self.prompt_logprobs <= 20
            ),
            f"prompt_logprobs must be an integer in [0, 20], got {self.prompt_logprobs!r}",
        )
        check(
            self.logprob_start_len is None
            or (
                isinstance(self.logprob_start_len, int)
                and not isinstance(self.logprob_start_len, bool)
                and self.logprob_start_len >= 0
            ),
            f"logprob_start_len must be an integer >= 0, got {self.logprob_start_len!r}",
        )
        check(
            self.logprob_start_len is None or self.prompt_logprobs is not None,
            "logprob_start_len needs prompt_logprobs",
        )
        check(self.seed is None or isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", [self.stop])
        if self.stop is not None:
            check(
                all(isinstance(s, str) and s for s in self.stop), "stop must be a list of non-empty strings"
            )
        if self.stop_token_ids is not None:
            check(
                all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
                "stop_token_ids must be a list of non-negative integers",
            )
        if isinstance(self.prediction, tuple):
            object.__setattr__(self, "prediction", list(self.prediction))
        check(
            self.prediction is None
            or isinstance(self.prediction, str)
            or (
                isinstance(self.prediction, list)
                and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.prediction)
            ),
            "prediction must be the predicted output's text or a list of token ids, got "
            f"{type(self.prediction).__name__}",
        )
        if isinstance(self.next_token_ids, tuple):
            object.__setattr__(self, "next_token_ids", list(self.next_token_ids))
        if self.next_token_ids is not None:
            ids = self.next_token_ids
            check(
                isinstance(ids, list)
                and 1 <= len(ids) <= MAX_NEXT_TOKEN_IDS
                and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids),
                f"next_token_ids must be a list of 1 to {MAX_NEXT_TOKEN_IDS} token ids, got {ids!r:.80}",
            )
            check(self.max_tokens == 0, "next_token_ids needs max_tokens 0 (a prompt-only request)")
        if self.max_tokens == 0:  # an empty output cannot follow a constraint, nor repeat a prediction
            for name, given in (
                ("structured_outputs", self.structured_outputs is not None),
                ("prediction", self.prediction is not None),
            ):
                check(not given, f"{name} needs max_tokens >= 1 (max_tokens 0 generates nothing)")
        if self.logit_bias is not None:
            for tok, bias in self.logit_bias.items():
                check(isinstance(tok, int) and tok >= 0, f"logit_bias keys must be token ids, got {tok!r}")
                check(
                    isinstance(bias, int | float) and not isinstance(bias, bool) and -100.0 <= bias <= 100.0,
                    f"logit_bias values must be numbers in [-100, 100], got {bias!r}",
                )

    @property
    def prompt_only(self) -> bool:
        """max_tokens 0: the prompt is computed (and scored, if asked), nothing is sampled."""
        return self.max_tokens == 0

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def stop_token_set(self, eos_token_ids: Iterable[int]) -> frozenset[int]:
        """The ids that end a sequence for a model whose end-of-sequence ids are `eos_token_ids`:
        stop_token_ids, and the EOS ids unless ignore_eos."""
        ids = set(self.stop_token_ids or ())
        if not self.ignore_eos:
            ids.update(eos_token_ids)
        return frozenset(ids)
