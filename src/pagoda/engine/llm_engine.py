"""The synchronous engine: input processing, the core loop, output processing."""

from __future__ import annotations

import dataclasses
import itertools
import time
from concurrent.futures import Future

from pagoda.config import EngineArgs
from pagoda.engine.core import EngineCore
from pagoda.engine.input_processor import Prompt, normalize_prompt, tokenize_prompt
from pagoda.engine.messages import EngineCoreRequest, EngineStats, StepStats
from pagoda.engine.output_processor import OutputProcessor, RequestGroup, _Completion
from pagoda.engine.resolve import resolve_engine_config
from pagoda.limits import check_context
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams, StructuredOutputs
from pagoda.structured import CompiledGrammar, GrammarConfig, GrammarManager
from pagoda.tokenizer import (
    OutputTextState,
    apply_chat_template,
    check_same_tokenizer,
    eos_token_ids,
    load_tokenizer,
)


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        if args.headless:
            raise ValueError(
                "a headless node runs only worker ranks (no engine): start it with `pagoda serve MODEL "
                "--headless ...`"
            )
        self.args = args  # as the user gave them
        self.config = resolve_engine_config(args)  # what the engine runs with
        self.tokenizer = load_tokenizer(self.config.tokenizer)
        self.eos_token_ids = eos_token_ids(self.tokenizer, args.model)
        if self.config.draft_model is not None:  # before either model loads
            draft = load_tokenizer(self.config.draft_model.path)
            check_same_tokenizer(self.tokenizer, draft, "speculative_config")
        self.core = EngineCore(self.config, self._make_grammar_manager)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        # What the last step (or abort) did, for an observer such as the server's metrics.
        self.last_step_stats = StepStats(self.core.stats())

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.core.runner.vocab_size

    @property
    def weight_format(self) -> str:
        """What the weights are stored as, e.g. `GGUF MOSTLY_Q8_0: Q8_0 100%; 500.1 MiB of weights`."""
        return self.core.runner.weight_format

    # ---- requests --------------------------------------------------------------------------------
    def chat_prompt(self, messages: list[dict], **template_kwargs) -> list[int]:
        return apply_chat_template(self.tokenizer, messages, add_generation_prompt=True, **template_kwargs)

    def add_request(
        self,
        request_id: str | None,
        prompt: Prompt,
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        stream: bool = False,
        grammar: CompiledGrammar | None = None,
    ) -> str:
        """Validate and queue a request; raises ValueError naming the problem. Returns its id.
        A structured-output request is compiled here (blocking) unless its compiled `grammar` is
        given; the async engine compiles off the loop and passes it."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if self.output_processor.knows(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt = normalize_prompt(prompt)
        self.args.limits.check_request(prompt, params, self.max_model_len)
        text, prompt_ids = tokenize_prompt(self.tokenizer, prompt, self.vocab_size, self.max_model_len)
        if params.logprob_start_len is not None and params.logprob_start_len >= len(prompt_ids):
            raise ValueError(
                f"logprob_start_len ({params.logprob_start_len}) must be less than the prompt's "
                f"length ({len(prompt_ids)} tokens)"
            )
        bad = next((t for t in params.next_token_ids or () if t >= self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"next_token_ids entry {bad} is not in [0, {self.vocab_size})")
        # The same policy as the server's: over the context is an error, None means up to it.
        check_context(len(prompt_ids), params.max_tokens, params.min_tokens, self.max_model_len)
        max_tokens = self.max_model_len - len(prompt_ids) if params.max_tokens is None else params.max_tokens
        if params.structured_outputs is not None:
            if params.min_tokens:
                raise ValueError("min_tokens cannot be combined with structured_outputs")
            grammar = grammar or self.compile_grammar(params.structured_outputs).result()
        prediction = None
        if isinstance(params.prediction, str):  # the predicted output's tokens, as the model writes them
            prediction = tuple(self.tokenizer(params.prediction, add_special_tokens=False)["input_ids"])
        elif params.prediction is not None:
            prediction = tuple(params.prediction)
            bad = next((t for t in prediction if t >= self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"prediction token id {bad} is not in [0, {self.vocab_size})")
        child_ids = [request_id] if params.n == 1 else [f"{request_id}-{i}" for i in range(params.n)]
        for cid in child_ids:
            if self.output_processor.knows(cid):
                raise ValueError(f"request id {cid!r} is already in use")
        arrival = time.monotonic()
        messages = [
            EngineCoreRequest(
                cid,
                prompt_ids,
                dataclasses.replace(params, seed=params.seed + i)
                if params.seed is not None and i
                else params,
                max_tokens=max_tokens,
                eos_token_ids=self.eos_token_ids,
                arrival_time=arrival,
                cache_salt=cache_salt,
                fork_of=child_ids[0] if i else None,
                grammar=grammar,
                prediction_token_ids=prediction,
            )
            for i, cid in enumerate(child_ids)
        ]
        completions = [
            _Completion(i, OutputTextState.from_sampling_params(self.tokenizer, prompt_ids, params))
            for i in range(params.n)
        ]
        self.output_processor.add(
            RequestGroup(request_id, text, prompt_ids, completions, child_ids, stream, arrival_time=arrival)
        )
        for msg in messages:
            self.core.add_request(msg)
        return request_id

    def _make_grammar_manager(self) -> GrammarManager:
        """The core's grammar compiler and masker, built from this engine's tokenizer. Compact JSON
        (no free whitespace): fixed keys and punctuation become forced strings that jump-forward can
        append without decoding."""
        return GrammarManager.from_tokenizer(
            self.tokenizer,
            vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids,
            config=GrammarConfig(
                any_whitespace=False, compile_timeout_s=self.args.limits.grammar_compile_timeout
            ),
        )

    def compile_grammar(self, spec: StructuredOutputs) -> Future[CompiledGrammar]:
        """Compile off the engine loop (thread-safe); a malformed spec raises ValueError here, a
        failed compile makes the future raise ValueError."""
        return self.core.grammar_manager().compile_async(spec)

    def wait_for_grammar_compiles(self, timeout: float | None) -> bool:
        """False if a grammar compile is still running after `timeout` seconds."""
        return self.core.grammars is None or self.core.grammars.wait_for_compiles(timeout)

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]:
        """Abort requests (by user request id); returns their final outputs."""
        self.output_processor.process(self.core.abort_requests(self.output_processor.child_ids(request_ids)))
        return self._take_outputs()

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.groups)

    def stats(self) -> EngineStats:
        """A snapshot of the core's counters (running, waiting, KV use, prefix hits, ...)."""
        return self.core.stats()

    # ---- the loop --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        stopped = self.output_processor.process(self.core.step())
        if stopped:  # stop strings end requests through the core's one abort path
            self.output_processor.process(self.core.abort_requests(stopped, "stop", stopped))
        return self._take_outputs()

    def _take_outputs(self) -> list[RequestOutput]:
        outputs, requests = self.output_processor.take_outputs()
        self.last_step_stats = StepStats(self.core.stats(), requests)
        return outputs

    def reset_prefix_cache(self) -> int:
        return self.core.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker ranks, if any, and leave their group (idempotent)."""
        self.core.shutdown()
