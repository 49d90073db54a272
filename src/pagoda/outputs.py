"""Public result types, as in vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token plus the top-N).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token: None for the first (nothing predicts it) and for positions before
# `logprob_start_len`, else token id -> Logprob (the prompt token plus the top-k).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    error: str | None = None  # with finish_reason "error": why this completion failed
    # With SamplingParams.prediction: prediction tokens proposed as drafts that are in the
    # completion, and those that are not (totals so far, also on streamed deltas); None without one.
    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    prompt_logprobs: PromptLogprobs | None = None
    # SamplingParams.next_token_ids: token id -> its Logprob as the token after the prompt.
    next_token_logprobs: dict[int, Logprob] | None = None
