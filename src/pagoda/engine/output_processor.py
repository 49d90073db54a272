"""Turns the core's `EngineCoreOutput`s into `RequestOutput`s: text, stop strings, n > 1 groups.

The one output builder: a streamed request gets one delta output per step that gave it something,
a non-streamed one a single cumulative output when it finishes. Finish state is copied from the
core's messages; a stop string found here is sent back to the core as an abort (reason "stop"),
whose final message then finishes the completion like any other.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from pagoda.engine.messages import EngineCoreOutput, RequestStepStats
from pagoda.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from pagoda.tokenizer import OutputTextState


@dataclass
class _Completion:
    index: int
    text: OutputTextState
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    # Copied from the core's final message (or the stop string found here, see process()).
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    prediction_tokens: tuple[int, int] | None = None  # (accepted, rejected), the core's latest totals
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
    last_token_time: float | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # once the first sample's prompt logprobs are in
    next_token_logprobs: dict[int, Logprob] | None = None  # SamplingParams.next_token_ids
    # this step, for metrics
    step_new_tokens: int = 0
    step_finish_reasons: list[str] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)


class OutputProcessor:
    """Owns the front end's record of each request id (`groups`, and `_child` for each sample's
    core request id); both are dropped together when the group's last sample finishes."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._token_texts: dict[int, str] = {}  # token id -> its text alone (`_decoded`)
        self.groups: dict[str, RequestGroup] = {}
        self._child: dict[str, tuple[RequestGroup, int]] = {}
        self._touched: dict[str, RequestGroup] = {}

    def add(self, group: RequestGroup) -> None:
        self.groups[group.request_id] = group
        for i, cid in enumerate(group.child_ids):
            self._child[cid] = (group, i)

    def knows(self, request_id: str) -> bool:
        """True while a request or a sample of one has this id."""
        return request_id in self.groups or request_id in self._child

    def child_ids(self, request_ids: list[str]) -> list[str]:
        """The core request ids of these user request ids (unknown ones are skipped)."""
        return [cid for rid in request_ids if (g := self.groups.get(rid)) for cid in g.child_ids]

    def process(self, outputs: list[EngineCoreOutput]) -> dict[str, str]:
        """Fold the core's messages in. Returns {core request id: stop string} for the samples that
        hit a stop string and are still running in the core: the caller aborts them there."""
        now = time.monotonic()
        stopped: dict[str, str] = {}
        for out in outputs:
            entry = self._child.get(out.request_id)
            if entry is None:
                continue
            group, i = entry
            comp = group.completions[i]
            if comp.finish_reason is not None:
                continue  # finished here by a stop string; this is the core's acknowledgement
            if out.prediction_tokens is not None:
                comp.prediction_tokens = out.prediction_tokens
            if out.prompt_logprobs is not None:  # the first sample's, once, with its first tokens
                group.prompt_logprobs = self._decoded(out.prompt_logprobs)
            if out.next_token_logprobs is not None:
                group.next_token_logprobs = self._decoded([out.next_token_logprobs])[0]
            new_ids = out.new_token_ids
            text_ids = new_ids
            if out.finish_reason == "stop" and isinstance(out.stop_reason, int):
                text_ids = text_ids[:-1]  # the stop token itself is not part of the text
            stop_str = None
            if not comp.text.finished:
                # Several tokens at once (accepted draft tokens) are checked one by one, so that a
                # stop string ends the completion at the same token as one-token steps would.
                delta = ""
                chunks = (
                    [text_ids[j : j + 1] for j in range(len(text_ids))] if len(text_ids) > 1 else [text_ids]
                )
                for j, ids in enumerate(chunks):
                    d, stop_str = comp.text.add(ids, finished=out.finished and j == len(chunks) - 1)
                    delta += d
                    if stop_str is not None:
                        if len(chunks) > 1:
                            new_ids = new_ids[: j + 1]
                        break
                comp.new_text += delta
            if group.first_token_time is None and not new_ids and out.finished:
                group.num_cached_tokens = out.num_cached_tokens  # a prompt-only request's one output
            if new_ids:
                if group.first_token_time is None:
                    group.first_token_time = now
                    group.num_cached_tokens = out.num_cached_tokens
                group.step_new_tokens += len(new_ids)
                comp.token_ids.extend(new_ids)
                comp.new_token_ids.extend(new_ids)
                if out.new_logprobs is not None:
                    lps = out.new_logprobs[: len(new_ids)]
                    comp.logprobs = comp.logprobs or []
                    comp.logprobs.extend(lps)
                    comp.new_logprobs.extend(lps)
            if stop_str is not None:
                if out.finished:
                    # The core ended it in the same step (e.g. at max_tokens): the stop string,
                    # earlier in the text, is what ended it for the user.
                    self._finish(group, comp, "stop", stop_str, None)
                else:
                    stopped[out.request_id] = stop_str
            elif out.finished:
                self._finish(group, comp, out.finish_reason, out.stop_reason, out.error)
            self._touched[group.request_id] = group
        return stopped

    def _finish(self, group: RequestGroup, comp: _Completion, reason, stop_reason, error) -> None:
        comp.finish_reason, comp.stop_reason, comp.error = reason, stop_reason, error
        group.step_finish_reasons.append(reason)

    def take_outputs(self) -> tuple[list[RequestOutput], list[RequestStepStats]]:
        """The outputs to report for everything processed since the last call, and what that did
        to each request (for metrics). Finished groups are forgotten here."""
        touched, self._touched = self._touched, {}
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        stats: list[RequestStepStats] = []
        for group in touched.values():
            finished = group.finished
            stats.append(self._step_stats(group, now, finished))
            if group.stream or finished:
                outputs.append(self._output(group, finished, now))
            if finished:
                del self.groups[group.request_id]
                for cid in group.child_ids:
                    del self._child[cid]
        return outputs, stats

    def _step_stats(self, group: RequestGroup, now: float, finished: bool) -> RequestStepStats:
        ttft = itl = None
        if group.step_new_tokens:
            if group.last_token_time is None:
                ttft = group.first_token_time - group.arrival_time
            else:
                itl = now - group.last_token_time  # one per step: the n samples advance together
            group.last_token_time = now
        stats = RequestStepStats(
            group.request_id,
            num_prompt_tokens=len(group.prompt_token_ids),
            num_new_tokens=group.step_new_tokens,
            ttft=ttft,
            itl=itl,
            e2e=now - group.arrival_time if finished else None,
            finish_reasons=tuple(group.step_finish_reasons),
        )
        group.step_new_tokens = 0
        group.step_finish_reasons = []
        return stats

    def _output(self, group: RequestGroup, finished: bool, now: float) -> RequestOutput:
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
                        c.error,
                        *(c.prediction_tokens or (None, None)),
                    )
                )
            else:
                completions.append(
                    CompletionOutput(
                        c.index,
                        c.text.text,
                        c.token_ids,
                        c.logprobs,
                        c.finish_reason,
                        c.stop_reason,
                        c.error,
                        *(c.prediction_tokens or (None, None)),
                    )
                )
            c.new_text, c.new_token_ids, c.new_logprobs = "", [], []
        prompt_logprobs = group.prompt_logprobs
        if group.stream:  # sent once, with the first delta after they are in
            group.prompt_logprobs = None
        metrics = {"arrival_time": group.arrival_time, "now": now}
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
            group.next_token_logprobs if finished else None,
        )

    def _decoded(self, entries: PromptLogprobs) -> PromptLogprobs:
        """Fill each Logprob's decoded_token (the token's text, as vLLM reports it). Token texts
        are kept (at most one per vocabulary entry): a select's requests score the same few."""
        texts = self._token_texts
        scored = [e for e in entries if e is not None]
        new = sorted({t for e in scored for t in e if t not in texts})
        if new:
            texts.update(zip(new, self.tokenizer.batch_decode([[t] for t in new]), strict=True))
        for e in scored:
            for t, lp in e.items():
                lp.decoded_token = texts[t]
        return entries
