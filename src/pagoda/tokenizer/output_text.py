"""Per-completion output text: incremental detokenization followed by stop-string checking."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from pagoda.sampling_params import SamplingParams
from pagoda.tokenizer.detokenizer import IncrementalDetokenizer
from pagoda.tokenizer.stop import StopStringChecker


class OutputTextState:
    """What the output processor keeps per completion to turn new token ids into streamed text.

    ``add`` returns ``(delta_text, stop_str)``; once a stop string is hit the completion is over and the
    text ends before it (or with it, with ``include_stop_str_in_output``). The concatenated deltas always
    equal ``text``, which is the final (non-streamed) text once the completion has finished. Stop strings
    only count when they start after the text of the first ``min_tokens`` output tokens.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] | None = None,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        if min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {min_tokens}")
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
        self._checker = StopStringChecker(stop, include_stop_str_in_output)
        self._min_tokens = min_tokens
        self._num_tokens = 0
        self._parts: list[str] = []
        self._finished = False

    @classmethod
    def from_sampling_params(
        cls, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> OutputTextState:
        return cls(
            tokenizer,
            prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
        )

    @property
    def text(self) -> str:
        """All text released so far."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    @property
    def stop_str(self) -> str | None:
        return self._checker.stop_str

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def num_tokens(self) -> int:
        """Output tokens added so far."""
        return self._num_tokens

    def add(self, new_token_ids: Sequence[int], *, finished: bool = False) -> tuple[str, str | None]:
        """Adds output tokens; returns (text to stream now, stop string hit or None).

        Pass ``finished=True`` with the last tokens of a completion that ends for another reason (EOS,
        stop token, length) to release held-back text. Whether a final EOS or stop token appears in the
        text is the caller's choice: leave it out of ``new_token_ids`` to keep it out of the text.
        """
        if self._finished:
            raise ValueError("OutputTextState.add() called after the completion finished")
        # Tokens up to min_tokens are fed unchecked, so a stop string cannot start inside their text.
        n_unchecked = min(len(new_token_ids), max(0, self._min_tokens - self._num_tokens))
        self._num_tokens += len(new_token_ids)
        out: list[str] = []
        stop_str = None
        if n_unchecked:
            released, _ = self._checker.feed(self._detok.add(new_token_ids[:n_unchecked]), check=False)
            out.append(released)
        rest = new_token_ids[n_unchecked:]
        delta = self._detok.add(rest) if rest else ""
        if finished:
            delta += self._detok.flush()
        if delta:
            released, stop_str = self._checker.feed(delta, check=self._num_tokens > self._min_tokens)
            out.append(released)
        if stop_str is not None:
            self._finished = True
        elif finished:
            out.append(self._checker.flush())
            self._finished = True
        text = "".join(out)
        if text:
            self._parts.append(text)
        return text, stop_str

    def finish(self) -> str:
        """Ends the completion (no more tokens); returns any held-back text."""
        if self._finished:
            return ""
        text, _ = self.add([], finished=True)
        return text
