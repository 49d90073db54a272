"""`pl.Engine`: programs on a pagoda engine in this process.

The engine (`pagoda.LLM`'s) is stepped by `AsyncLLM` on its own thread, as the server does, so
the requests of concurrent branches and programs are batched together. Requests are made on one
private asyncio loop thread; callers on any thread wait for their result.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import queue
import threading
from collections.abc import Coroutine, Iterator
from typing import Any

from pagoda import LLM, CompletionOutput, RequestOutput, SamplingParams
from pagoda.engine.async_engine import AsyncLLM, EngineDeadError
from pagoda.lang.backend.base import Backend, ChoiceScore, GenOutput, choice_scores
from pagoda.lang.errors import BackendRequestError
from pagoda.tokenizer.continuation import HeadTokenizer
from pagoda.tokenizer.spans import choice_spans, shared_lead

_PARAM_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def engine_has_prompt_logprobs() -> bool:
    """Whether this pagoda's SamplingParams has `prompt_logprobs` (vLLM's name)."""
    return "prompt_logprobs" in _PARAM_FIELDS


class Engine(Backend):
    """`pl.Engine(model="path", **engine_args)`: keyword arguments are `pagoda.LLM`'s (EngineArgs)."""

    def __init__(self, model: str, **engine_args: Any) -> None:
        super().__init__()
        llm = LLM(model, **engine_args)
        self.model = model
        self.tokenizer = llm.tokenizer
        self._engine = AsyncLLM(llm.engine)
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(
            target=self._loop.run_forever, name="pagoda-lang-engine", daemon=True
        )
        self._loop_thread.start()
        self._ids = itertools.count()
        self._token_text: dict[int, str] = {}
        self._closed = False

    @property
    def name(self) -> str:
        return f"pl.Engine({self.model!r})"

    # ---- requests --------------------------------------------------------------------------------
    def generate(self, prompt: str, params: SamplingParams) -> GenOutput:
        (out,) = self._wait(self._collect([prompt], [params]))
        return self._output(out, params)

    def generate_stream(self, prompt: str, params: SamplingParams) -> Iterator[str | GenOutput]:
        items: queue.Queue[Any] = queue.Queue()
        done = object()

        async def pump() -> None:
            try:
                async for delta in self._engine.generate(prompt, params, self._request_id(), stream=True):
                    items.put(delta)
            except BaseException as exc:
                items.put(exc)
            finally:
                items.put(done)

        future = self._submit(pump())
        text: list[str] = []
        token_ids: list[int] = []
        logprobs: list = []
        last: RequestOutput | None = None
        try:
            while (item := items.get()) is not done:
                if isinstance(item, BaseException):
                    raise self._translate(item)
                last = item
                for c in item.outputs:
                    text.append(c.text)
                    token_ids.extend(c.token_ids)
                    logprobs.extend(c.logprobs or [])
                    if c.text:
                        yield c.text
        finally:
            future.cancel()
        assert last is not None
        final = last.outputs[-1] if last.outputs else CompletionOutput(0, "", [])
        whole = CompletionOutput(
            0,
            "".join(text),
            token_ids,
            logprobs if params.logprobs is not None else None,
            final.finish_reason,
            final.stop_reason,
        )
        yield self._output(dataclasses.replace(last, outputs=[whole]), params)

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    _prompt_logprobs_need = "prompt logprobs (SamplingParams.prompt_logprobs), which this engine lacks"

    def supports_prompt_logprobs(self) -> bool:
        return engine_has_prompt_logprobs()

    def prompt_logprobs(self, prompts: list[list[int]], starts: list[int]) -> list[list[float]]:
        self.check_prompt_logprobs()
        extra: dict[str, Any] = {"prompt_logprobs": 0}
        params = []
        for start in starts:
            if "logprob_start_len" in _PARAM_FIELDS:  # SGLang's name: logprobs only from there on
                extra["logprob_start_len"] = start
            params.append(SamplingParams(max_tokens=0, **extra))  # prompt-only: nothing sampled
        outs = self._wait(self._collect(prompts, params))
        result = []
        for out, prompt, start in zip(outs, prompts, starts, strict=True):
            entries = out.prompt_logprobs  # type: ignore[attr-defined]
            result.append([entries[i][prompt[i]].logprob for i in range(start, len(prompt))])
            self._count(len(prompt), out.num_cached_tokens, 0)
        return result

    def score_choices(self, prompt: str, choices: list[str]) -> list[ChoiceScore]:
        """select's scoring with no row computed twice or for nothing, when every choice's tokens
        follow the prompt's own (else as the base class): one prompt-only request computes the
        prompt and the tokens every choice starts with (`shared_lead`, scored as its prompt
        logprobs) and scores each choice's next token from its last row
        (SamplingParams.next_token_ids); then, for each choice longer than that, one prompt-only
        request of the prompt and the choice but its last token, which finds the head cached,
        scores the choice's middle tokens as prompt logprobs and its last token from its last row
        (that token itself is never computed: its KV and logits are not needed). The server's
        logprob_start_char scoring does the same."""
        self.check_prompt_logprobs()
        head = HeadTokenizer(self.tokenizer, prompt)  # the prompt tokenized once, where exact
        prompt_ids = head.head_ids
        full = [head.ids(prompt + choice) for choice in choices]
        starts = choice_spans(prompt_ids, full)
        s = len(prompt_ids)
        if any(start != s or ids[:s] != prompt_ids for ids, start in zip(full, starts, strict=True)):
            return choice_scores(prompt_ids, full, starts, self.prompt_logprobs(full, starts))
        lead = shared_lead(full, s)
        h = s + lead  # the head: the prompt and the tokens every choice starts with
        head_params = SamplingParams(
            max_tokens=0,
            next_token_ids=sorted({ids[h] for ids in full}),
            **({"prompt_logprobs": 0, "logprob_start_len": s} if lead else {}),
        )
        (head,) = self._wait(self._collect([full[0][:h]], [head_params]))
        self._count(h, head.num_cached_tokens, 0)
        longer = [i for i, ids in enumerate(full) if len(ids) > h + 1]
        params = [
            SamplingParams(
                max_tokens=0,
                next_token_ids=[full[i][-1]],
                # the choice's middle tokens, if any, as prompt logprobs
                **({"prompt_logprobs": 0, "logprob_start_len": h + 1} if len(full[i]) > h + 2 else {}),
            )
            for i in longer
        ]
        tails = dict(
            zip(longer, self._wait(self._collect([full[i][:-1] for i in longer], params)), strict=True)
        )
        shared = [head.prompt_logprobs[j][full[0][j]].logprob for j in range(s, h)]
        result = []
        for i, ids in enumerate(full):
            scores = [*shared, head.next_token_logprobs[ids[h]].logprob]
            tail = tails.get(i)
            if tail is not None:
                scores += [tail.prompt_logprobs[j][ids[j]].logprob for j in range(h + 1, len(ids) - 1)]
                scores.append(tail.next_token_logprobs[ids[-1]].logprob)
                self._count(len(ids) - 1, tail.num_cached_tokens, 0)
            result.append(scores)
        return choice_scores(prompt_ids, full, starts, result)

    def flush_cache(self) -> None:
        self._wait(self._engine.call(lambda engine: engine.reset_prefix_cache()))

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._engine.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join(10)

    # ---- helpers ---------------------------------------------------------------------------------
    def _request_id(self) -> str:
        return f"lang-{next(self._ids)}"

    async def _collect(self, prompts: list[Any], params: list[SamplingParams]) -> list[RequestOutput]:
        async def one(prompt: Any, p: SamplingParams) -> RequestOutput:
            final = None
            async for out in self._engine.generate(prompt, p, self._request_id(), stream=False):
                final = out
            assert final is not None
            return final

        return list(await asyncio.gather(*(one(x, p) for x, p in zip(prompts, params, strict=True))))

    def _submit(self, coro: Coroutine[Any, Any, Any]):
        if self._closed:
            coro.close()
            raise BackendRequestError(f"{self.name} is shut down")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _wait(self, coro: Coroutine[Any, Any, Any]) -> Any:
        try:
            return self._submit(coro).result()
        except EngineDeadError as exc:
            raise self._translate(exc) from exc

    def _translate(self, exc: BaseException) -> BaseException:
        if isinstance(exc, EngineDeadError):
            return BackendRequestError(f"{self.name}: {exc}")
        return exc

    def _output(self, out: RequestOutput, params: SamplingParams) -> GenOutput:
        c = out.outputs[0]
        token_logprobs = top = None
        if params.logprobs is not None:
            token_logprobs, top = [], []
            for token_id, entry in zip(c.token_ids, c.logprobs or [], strict=False):
                token_logprobs.append((entry[token_id].logprob, token_id, self._text_of(token_id)))
                ranked = sorted(
                    (
                        (t, lp)
                        for t, lp in entry.items()
                        if lp.rank is not None and lp.rank <= params.logprobs
                    ),
                    key=lambda item: item[1].rank,
                )
                top.append([(lp.logprob, t, self._text_of(t)) for t, lp in ranked])
        self._count(len(out.prompt_token_ids), out.num_cached_tokens, len(c.token_ids))
        return GenOutput(
            text=c.text,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            prompt_tokens=len(out.prompt_token_ids),
            cached_tokens=out.num_cached_tokens,
            completion_tokens=len(c.token_ids),
            token_logprobs=token_logprobs,
            top_logprobs=top,
        )

    def _text_of(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def _render_chat(self, messages: list[dict[str, str]]) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                f"{self.name}: the model's tokenizer has no chat template; pl.system / pl.user / "
                "pl.assistant need one (append plain text instead)"
            )
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)

    def _bos_text(self) -> str:
        with_special = self.tokenizer("a")["input_ids"]
        plain = self.tokenizer("a", add_special_tokens=False)["input_ids"]
        n = len(with_special) - len(plain)
        lead = with_special[:n] if n > 0 and with_special[n:] == plain else []
        return self.tokenizer.decode(lead, skip_special_tokens=False) if lead else ""
