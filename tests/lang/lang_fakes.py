"""A scripted backend for testing the interpreter without a model: one token per character,
replies chosen by a function of (prompt, params), every call recorded."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

from pagoda import SamplingParams
from pagoda.lang.backend.base import Backend, GenOutput

Reply = Callable[[str, SamplingParams], str]


def echo_length(prompt: str, params: SamplingParams) -> str:
    return f"<{len(prompt)}>"


class FakeBackend(Backend):
    """Chat template: `[role]content[/role]`, with a default system turn before a first user turn."""

    def __init__(
        self,
        reply: Reply = echo_length,
        *,
        logprob: Callable[[list[int], int], float] | None = None,
        stream_delay: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        self.reply = reply
        self.logprob = logprob  # (tokens before, token) -> logprob; None: no prompt logprobs
        self.stream_delay = stream_delay
        self.calls: list[tuple[str, object]] = []  # ("generate" | "commit" | "score", detail)
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return "FakeBackend()"

    def _record(self, kind: str, detail: object) -> None:
        with self._lock:
            self.calls.append((kind, detail))

    def of_kind(self, kind: str) -> list[object]:
        with self._lock:
            return [detail for k, detail in self.calls if k == kind]

    def generate(self, prompt: str, params: SamplingParams) -> GenOutput:
        self._record("generate", (prompt, params))
        text = self.reply(prompt, params)
        self._count(len(prompt), 0, len(text))
        return GenOutput(text, "length", None, len(prompt), 0, len(text))

    def commit(self, prompt: str) -> GenOutput:
        self._record("commit", prompt)
        self._count(len(prompt), 0, 1)
        return GenOutput("", "length", None, len(prompt), 0, 1)

    def generate_stream(self, prompt: str, params: SamplingParams) -> Iterator[str | GenOutput]:
        self._record("generate", (prompt, params))
        text = self.reply(prompt, params)
        for ch in text:
            if self.stream_delay is not None:
                self.stream_delay()
            yield ch
        yield GenOutput(text, "length", None, len(prompt), 0, len(text))

    def tokenize(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def supports_prompt_logprobs(self) -> bool:
        return self.logprob is not None

    def prompt_logprobs(self, prompts: list[list[int]], starts: list[int]) -> list[list[float]]:
        self.check_prompt_logprobs()
        assert self.logprob is not None
        self._record("score", (prompts, starts))
        return [
            [self.logprob(p[:i], p[i]) for i in range(s, len(p))]
            for p, s in zip(prompts, starts, strict=True)
        ]

    def flush_cache(self) -> None:
        self._record("flush", None)

    def shutdown(self) -> None:
        pass

    def _render_chat(self, messages: list[dict[str, str]]) -> str:
        text = ""
        if messages[0]["role"] != "system":
            text += "[system]default[/system]"
        return text + "".join(f"[{m['role']}]{m['content']}[/{m['role']}]" for m in messages)

    def _bos_text(self) -> str:
        return ""
