"""Turns the core's per-step token ids into RequestOutputs: text, stop strings, n > 1 groups."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from pagoda.engine.core import StepOutput
from pagoda.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from pagoda.request import Request
from pagoda.tokenizer import OutputTextState


@dataclass
class _Completion:
    index: int
    text: OutputTextState
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # what the last delta output has not shown yet
    new_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reported: bool = False


@dataclass
class RequestGroup:
    """One user request: its n completions, and how its outputs are reported."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    completions: list[_Completion]
    child_ids: list[str]
    stream: bool  # True: one delta RequestOutput per step; False: one cumulative output at the end
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # once the first sample's prompt logprobs are in

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.groups: dict[str, RequestGroup] = {}
        self._child: dict[str, tuple[RequestGroup, int]] = {}

    def add(self, group: RequestGroup) -> None:
        self.groups[group.request_id] = group
        for i, cid in enumerate(group.child_ids):
            self._child[cid] = (group, i)

    def process(
        self, step: list[StepOutput], finished: list[Request]
    ) -> tuple[list[RequestOutput], list[str]]:
        """Returns the outputs to report and the child request ids that hit a stop string (the
        caller finishes those in the core)."""
        now = time.monotonic()
        touched: dict[str, RequestGroup] = {}
        stopped: list[str] = []
        for out in step:
            group, i = self._child[out.request.request_id]
            comp = group.completions[i]
            if group.first_token_time is None:
                group.first_token_time = now
                group.num_cached_tokens = max(out.request.num_cached_tokens, 0)
            if out.prompt_logprobs is not None:
                group.prompt_logprobs = self._decoded(out.prompt_logprobs)
            comp.token_ids.extend(out.new_token_ids)
            comp.new_token_ids.extend(out.new_token_ids)
            if out.new_logprobs is not None:
                comp.logprobs = comp.logprobs or []
                comp.logprobs.extend(out.new_logprobs)
                comp.new_logprobs.extend(out.new_logprobs)
            req = out.request
            text_ids = out.new_token_ids
            if req.finish_reason == "stop" and isinstance(req.stop_reason, int):
                text_ids = text_ids[:-1]  # the stop token itself is not part of the text
            delta, stop_str = comp.text.add(text_ids, finished=req.is_finished)
            comp.new_text += delta
            if stop_str is not None:
                comp.finish_reason, comp.stop_reason = "stop", stop_str
                if not req.is_finished:
                    stopped.append(req.request_id)
            elif req.is_finished:
                comp.finish_reason, comp.stop_reason = req.finish_reason, req.stop_reason
            touched[group.request_id] = group
        for req in finished:  # finished from outside a step (abort)
            entry = self._child.get(req.request_id)
            if entry is None:
                continue
            group, i = entry
            comp = group.completions[i]
            if comp.finish_reason is None:
                comp.new_text += comp.text.finish()
                comp.finish_reason = req.finish_reason or "abort"
            touched[group.request_id] = group
        outputs = [o for g in touched.values() if (o := self._output(g)) is not None]
        return outputs, stopped

    def _output(self, group: RequestGroup) -> RequestOutput | None:
        finished = group.finished
        if not group.stream and not finished:
            return None
        completions = []
        for c in group.completions:
            if group.stream:
                if c.finish_reported or not (c.new_token_ids or c.new_text or c.finish_reason):
                    continue
                c.finish_reported = c.finish_reason is not None
                completions.append(
                    CompletionOutput(
                        c.index,
                        c.new_text,
                        c.new_token_ids,
                        c.new_logprobs if c.logprobs is not None else None,
                        c.finish_reason,
                        c.stop_reason,
                    )
                )
            else:
                completions.append(
                    CompletionOutput(
                        c.index, c.text.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason
                    )
                )
            c.new_text, c.new_token_ids, c.new_logprobs = "", [], []
        if finished:
            del self.groups[group.request_id]
            for cid in group.child_ids:
                del self._child[cid]
        prompt_logprobs = group.prompt_logprobs
        if group.stream:  # sent once, with the first delta after they are in
            group.prompt_logprobs = None
        metrics = {"arrival_time": group.arrival_time, "now": time.monotonic()}
        if group.first_token_time is not None:
            metrics["first_token_time"] = group.first_token_time
        return RequestOutput(
            group.request_id,
            group.prompt,
            group.prompt_token_ids,
            completions,
            finished,
            group.num_cached_tokens,
            metrics,
            prompt_logprobs,
        )

    def _decoded(self, entries: PromptLogprobs) -> PromptLogprobs:
        """Fill each Logprob's decoded_token (the token's text, as vLLM reports it)."""
        ids = sorted({t for e in entries if e is not None for t in e})
        texts = dict(zip(ids, self.tokenizer.batch_decode([[t] for t in ids]), strict=True))
        for e in entries:
            for t, lp in (e or {}).items():
                lp.decoded_token = texts[t]
        return entries
