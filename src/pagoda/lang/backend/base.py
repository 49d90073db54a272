"""What the interpreter needs from a backend, and what a backend reports back.

A backend runs requests on one pagoda engine: `pl.Engine` in this process, `pl.RuntimeEndpoint`
on a server over HTTP. Both take the same resolved `pagoda.SamplingParams`, send prompts as the
same text (tokenized by the engine's tokenizer, as `/v1/completions` does), and report the same
`GenOutput`, so a program gives the same greedy results on either. Every backend method is safe
to call from many threads at once: fork branches and `run_batch` programs run concurrently.

Prefix reuse is the engine's: its radix cache keeps the KV of every prompt it computed. A backend
"commits" a prefix by running it as a prompt-only request (`max_tokens=0`: the prompt computed,
nothing sampled), so that requests sent after it find the prefix cached instead of all
computing it at once.
"""

from __future__ import annotations

import dataclasses
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pagoda import SamplingParams
from pagoda.lang.chat_template import ChatTemplate
from pagoda.lang.choices import TokenLogprob
from pagoda.lang.errors import BackendCapabilityError
from pagoda.tokenizer.spans import choice_spans

# The request that commits a prefix to the engine's cache: the prompt alone, nothing sampled.
COMMIT_PARAMS = SamplingParams(max_tokens=0)


@dataclass(frozen=True)
class GenOutput:
    text: str
    finish_reason: str | None
    stop_reason: int | str | None
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served by the prefix cache
    completion_tokens: int
    token_logprobs: list[TokenLogprob] | None = None  # when return_logprob: one per output token
    top_logprobs: list[list[TokenLogprob]] | None = None  # and the top_logprobs_num best, best first

    def meta_info(self) -> dict[str, Any]:
        """What `s.get_meta_info(name)` shows for a gen (SGLang's keys)."""
        if self.finish_reason == "stop":
            finish: dict[str, Any] = {"type": "stop", "matched": self.stop_reason}
        else:
            finish = {"type": self.finish_reason, "length": self.completion_tokens}
        meta: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "finish_reason": finish,
        }
        if self.token_logprobs is not None:
            meta["output_token_logprobs"] = self.token_logprobs
            meta["output_top_logprobs"] = self.top_logprobs
        return meta


@dataclass
class Usage:
    """Totals over every request a backend sent (gens, commits, select scoring)."""

    num_requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    @property
    def computed_prompt_tokens(self) -> int:
        """Prompt tokens the engine computed: those the prefix cache did not serve."""
        return self.prompt_tokens - self.cached_tokens


@dataclass(frozen=True)
class ChoiceScore:
    """One choice's scored tokens: those of prompt + choice from `start` on (where they differ
    from the prompt's own tokens), and each one's logprob given all the tokens before it."""

    start: int
    token_ids: list[int]
    logprobs: list[float]
    # Whether the tokens before `start` are known to be the prompt's own (False where a choice
    # re-tokenized the prompt's first token, or where the backend cannot tell): two such choices
    # whose spans start at the same position and agree up to a token follow the same tokens there.
    after_prompt: bool


def choice_scores(
    prompt_ids: list[int], full: list[list[int]], starts: list[int], logprobs: list[list[float]]
) -> list[ChoiceScore]:
    """ChoiceScores from each prompt + choice's whole token ids."""
    return [
        ChoiceScore(start, ids[start:], lps, ids[:start] == prompt_ids[:start])
        for ids, start, lps in zip(full, starts, logprobs, strict=True)
    ]


class Backend(ABC):
    """The engine side of the interpreter. Subclasses implement the transport."""

    def __init__(self) -> None:
        self._usage = Usage()
        self._usage_lock = threading.Lock()
        self._chat_template: ChatTemplate | None = None
        self._chat_lock = threading.Lock()

    # ---- what programs use -----------------------------------------------------------------------
    @property
    @abstractmethod
    def name(self) -> str:
        """How errors name this backend, e.g. "pl.RuntimeEndpoint('http://...')"."""

    @abstractmethod
    def generate(self, prompt: str, params: SamplingParams) -> GenOutput: ...

    @abstractmethod
    def generate_stream(self, prompt: str, params: SamplingParams) -> Iterator[str | GenOutput]:
        """Text deltas as they are produced, then the final GenOutput (whose text is the whole)."""

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text` as a prompt (special tokens such as BOS added, as requests do)."""

    @abstractmethod
    def prompt_logprobs(self, prompts: list[list[int]], starts: list[int]) -> list[list[float]]:
        """One batched request: for each prompt, the logprob of each of its tokens from position
        `start` on, given the tokens before it. Raises BackendCapabilityError when the engine
        cannot return prompt logprobs."""

    def score_choices(self, prompt: str, choices: list[str]) -> list[ChoiceScore]:
        """select's scoring, in one batched request: each choice's own tokens in prompt + choice
        (from `choice_spans`) and their logprobs. Raises BackendCapabilityError when the engine
        cannot return prompt logprobs."""
        self.check_prompt_logprobs()
        prompt_ids = self.tokenize(prompt)
        full = [self.tokenize(prompt + choice) for choice in choices]
        starts = choice_spans(prompt_ids, full)
        return choice_scores(prompt_ids, full, starts, self.prompt_logprobs(full, starts))

    @abstractmethod
    def supports_prompt_logprobs(self) -> bool:
        """Whether the engine behind this backend returns prompt logprobs (what select needs)."""

    def check_prompt_logprobs(self) -> None:
        """Raise BackendCapabilityError, naming this backend, unless prompt logprobs work."""
        if not self.supports_prompt_logprobs():
            raise BackendCapabilityError(self.name, "select", self._prompt_logprobs_need)

    _prompt_logprobs_need = "prompt logprobs"

    @abstractmethod
    def flush_cache(self) -> None:
        """Drop every cached prefix not in use."""

    @abstractmethod
    def shutdown(self) -> None: ...

    def commit(self, prompt: str) -> GenOutput:
        """Compute `prompt` once so that its KV is cached for the requests that follow."""
        return self.generate(prompt, COMMIT_PARAMS)

    def chat_template(self) -> ChatTemplate:
        with self._chat_lock:
            if self._chat_template is None:
                self._chat_template = ChatTemplate(self._render_chat, self._bos_text())
            return self._chat_template

    @property
    def usage(self) -> Usage:
        """A snapshot of the totals so far."""
        with self._usage_lock:
            return dataclasses.replace(self._usage)

    def reset_usage(self) -> None:
        with self._usage_lock:
            self._usage = Usage()

    # ---- for subclasses --------------------------------------------------------------------------
    @abstractmethod
    def _render_chat(self, messages: list[dict[str, str]]) -> str:
        """The model's chat template applied to `messages` (no generation prompt), as text."""

    @abstractmethod
    def _bos_text(self) -> str:
        """The text of the tokens that tokenizing a prompt prepends (BOS), or ''."""

    def _count(
        self, prompt_tokens: int, cached_tokens: int, completion_tokens: int, *, requests: int = 1
    ) -> None:
        with self._usage_lock:
            u = self._usage
            u.num_requests += requests
            u.prompt_tokens += prompt_tokens
            u.cached_tokens += cached_tokens
            u.completion_tokens += completion_tokens

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
