"""The typed messages between the engine core and every front end (LLMEngine, AsyncLLM, the
server's metrics, the benchmarks).

Requests go in as `EngineCoreRequest`; each step (and each abort) comes out as a list of
`EngineCoreOutput`, one per request that got tokens or finished; `EngineStats` is a snapshot of
the core's counters taken whenever a front end asks. No front end holds a live `Request`, the
scheduler or the KV cache: with the core in another process these would be the only things sent
over the wire (plain data; the compiled grammar is the one in-process handle, see below).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from pagoda.outputs import Logprob, PromptLogprobs
from pagoda.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagoda.structured import CompiledGrammar

# "stop": a stop token or stop string; "length": max_tokens or the context; "abort": cancelled (user,
# disconnect, shutdown); "error": this request failed (the message says why), the engine serves on.
FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(frozen=True)
class EngineCoreRequest:
    """One sequence to generate. A user request with n > 1 is n of these; each later sample names
    the first in `fork_of`, whose prompt KV it shares instead of computing it again."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: the request's own, or up to the context
    eos_token_ids: frozenset[int]  # the model's, engine state rather than the user's
    arrival_time: float
    cache_salt: str | None = None
    fork_of: str | None = None
    # Compiled off the engine loop by the front end. A core in another process would receive the
    # spec (params.structured_outputs) and compile it there from its own cache instead.
    grammar: CompiledGrammar | None = None
    # SamplingParams.prediction as token ids (tokenized by the front end); None without one.
    prediction_token_ids: tuple[int, ...] | None = None


@dataclass
class EngineCoreOutput:
    """What one step (or an abort) produced for one request: the tokens new since its last output,
    their logprobs (once, its prompt's too), and, on its last output, how it finished. The core is
    the one record of finish state; front ends copy it from here."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (or a sibling's KV)
    error: str | None = None  # with finish_reason "error": what went wrong, for the user
    # SamplingParams.prompt_logprobs: one entry per prompt token, sent once, on the output with the
    # request's first tokens (the core computes them chunk by chunk before that).
    prompt_logprobs: PromptLogprobs | None = None
    # SamplingParams.next_token_ids: their logprobs after the prompt, on the final output.
    next_token_logprobs: dict[int, Logprob] | None = None
    # With a prediction: (accepted, rejected) prediction tokens so far (totals, not deltas).
    prediction_tokens: tuple[int, int] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the core after a step. Counters are totals since the engine started; readers
    take differences."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0  # fraction of blocks held by requests (cached-but-idle ones count as free)
    num_free_blocks: int = 0
    num_blocks: int = 0
    num_preemptions: int = 0
    num_finished: int = 0
    num_computed_tokens: int = 0  # tokens run through the model (prompt, recompute and decode)
    num_steps: int = 0  # forward passes
    num_sequence_steps: int = 0  # forward passes summed over the sequences in them
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # prompt tokens it served
    num_evicted_blocks: int = 0
    jump_forward_drafts: int = 0  # draft tokens proposed
    jump_forward_accepted: int = 0  # of those, the ones sampling confirmed (not other proposers')
    # Speculative decoding, every proposer (grammar-forced drafts too), counted when verified.
    spec_num_drafts: int = 0  # draft spans verified (one request's drafts in one step)
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0

    @property
    def num_unfinished(self) -> int:
        return self.num_running + self.num_waiting


@dataclass(frozen=True)
class RequestStepStats:
    """What one step (or abort) did for one user request (all its n samples), for metrics."""

    request_id: str
    num_prompt_tokens: int
    num_new_tokens: int
    ttft: float | None = None  # seconds from arrival, on the step that gave its first tokens
    itl: float | None = None  # seconds since its previous step with tokens
    e2e: float | None = None  # seconds from arrival, once every sample finished
    finish_reasons: tuple[str, ...] = ()  # one per sample that finished here


@dataclass(frozen=True)
class StepStats:
    """Handed to an `on_step` observer after every step: the core's snapshot and the requests'."""

    engine: EngineStats
    requests: list[RequestStepStats] = field(default_factory=list)
