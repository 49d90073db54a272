"""Limits on every size a request can choose, shared by the offline `LLM` and the server.

`RequestLimits` is a frozen config (`EngineArgs.limits`); the engine's `add_request` checks each
request against it before any work, and the server checks the same rules (plus the ones only an
HTTP request has: prompts per request, messages) before it tokenizes or compiles anything. Every
check runs in time proportional to the request's size and raises `LimitError`, a ValueError that
names the field (`param`) and the limit with its server flag, so that clients get a 400 they can act on.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from pagoda.cli_args import arg
from pagoda.sampling_params import SamplingParams, StructuredOutputs

# OpenAI's maximum for logprobs / top_logprobs; SamplingParams enforces it too.
MAX_LOGPROBS = 20
# Largest request body the server and the router read, in bytes (--max-body-size); a 413 beyond.
DEFAULT_MAX_BODY_SIZE = 16 * 1024 * 1024
# Seconds the server and the router keep an idle HTTP connection open (--timeout-keep-alive).
# Longer than the common clients' pool expiry (httpx and the OpenAI SDK: 5 s; aiohttp: 15 s), so
# that such a client drops an idle connection before the server closes it, never as it sends on it.
DEFAULT_KEEP_ALIVE_S = 30.0


class LimitError(ValueError):
    """A request over one of the limits; `param` names the field."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class RequestLimits:
    """Each field bounds one size a request chooses; each is a flag of `pagoda serve` (the field
    name with dashes: `max_n` -> `--max-n`). `max_prompt_chars=None` means 64 characters per token
    of context."""

    max_n: int = arg(128, help="samples per prompt (n)", metavar="N")
    max_sequences: int = arg(256, help="sequences one request adds: prompts x n", metavar="N")
    max_logprobs: int = arg(
        MAX_LOGPROBS, help="logprobs / top_logprobs / prompt_logprobs (at most 20, as OpenAI)", metavar="N"
    )
    max_stop: int = arg(64, help="entries of stop, and of stop_token_ids", metavar="N")
    max_stop_chars: int = arg(1024, help="characters of one stop string", metavar="N")
    max_logit_bias: int = arg(1024, help="logit_bias entries", metavar="N")
    max_messages: int = arg(2048, help="chat messages in one request", metavar="N")
    max_prediction_chars: int = arg(
        262144, help="characters of a predicted output (prediction), checked before tokenizing", metavar="N"
    )
    max_prompt_chars: int | None = arg(
        None,
        help="prompt characters, checked before tokenizing",
        default_text="64 x max-model-len",
        metavar="N",
    )
    max_grammar_chars: int = arg(
        65536, help="characters of a JSON schema (compact JSON), regex, grammar or all choices", metavar="N"
    )
    max_grammar_depth: int = arg(
        32, help="nesting of a JSON schema, or of groups in a regex or grammar", metavar="N"
    )
    grammar_compile_timeout: float = arg(
        30.0,
        help="seconds a structured-output grammar may take to compile (it fails and is abandoned then)",
        metavar="S",
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "max_prompt_chars" and value is None:
                continue
            if f.name == "grammar_compile_timeout":
                if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                    raise ValueError(f"grammar_compile_timeout must be a number > 0, got {value!r}")
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{f.name} must be an integer >= 1, got {value!r}")
        if self.max_logprobs > MAX_LOGPROBS:
            raise ValueError(
                f"max_logprobs must be <= {MAX_LOGPROBS} (OpenAI's limit), got {self.max_logprobs}"
            )

    # ---- what both paths check -------------------------------------------------------------------
    def check_request(self, prompt: object, params: SamplingParams, max_model_len: int) -> None:
        """Everything `LLMEngine.add_request` checks before it tokenizes."""
        self.check_prompt(prompt, max_model_len)
        self.check_params(params)

    def prompt_char_limit(self, max_model_len: int) -> int:
        return self.max_prompt_chars if self.max_prompt_chars is not None else 64 * max_model_len

    def check_prompt(self, prompt: object, max_model_len: int, param: str = "prompt") -> None:
        """A text prompt: at most `prompt_char_limit` characters, valid Unicode (no lone surrogate)."""
        if not isinstance(prompt, str):
            return  # token ids are checked against max_model_len and the vocabulary when tokenized
        _over(param, len(prompt), self.prompt_char_limit(max_model_len), "max_prompt_chars", "characters")
        check_text(prompt, param)

    def check_params(self, params: SamplingParams, constraint_param: str | None = None) -> None:
        """The sizes sampling parameters choose: n, logprobs, stop, logit_bias, the output constraint
        (`constraint_param` names the request field it came from; default structured_outputs.KIND)."""
        _over("n", params.n, self.max_n, "max_n")
        if params.logprobs is not None:
            _over("logprobs", params.logprobs, self.max_logprobs, "max_logprobs")
        if params.prompt_logprobs is not None:
            _over("prompt_logprobs", params.prompt_logprobs, self.max_logprobs, "max_logprobs")
        stops = params.stop or []
        _over("stop", len(stops), self.max_stop, "max_stop", "strings")
        for s in stops:
            _over("stop", len(s), self.max_stop_chars, "max_stop_chars", "characters in one string")
            check_text(s, "stop")
        _over("stop_token_ids", len(params.stop_token_ids or ()), self.max_stop, "max_stop", "entries")
        _over("logit_bias", len(params.logit_bias or ()), self.max_logit_bias, "max_logit_bias", "entries")
        if params.structured_outputs is not None:
            self.check_structured(params.structured_outputs, constraint_param)
        if params.prediction is not None:  # text, or token ids (each at least one character)
            unit = "characters" if isinstance(params.prediction, str) else "tokens"
            _over(
                "prediction", len(params.prediction), self.max_prediction_chars, "max_prediction_chars", unit
            )
            if isinstance(params.prediction, str):
                check_text(params.prediction, "prediction")

    def check_structured(self, spec: StructuredOutputs, param: str | None = None) -> None:
        """Size and nesting of an output constraint, before it is parsed or compiled."""
        kind = spec.kind
        where = param or f"structured_outputs.{kind}"
        document = spec.json if spec.json is not None else spec.structural_tag
        if document is not None:  # a JSON schema, or a structural tag (with schemas inside)
            text = document if isinstance(document, str) else None
            if text is not None:
                _over(where, len(text), self.max_grammar_chars, "max_grammar_chars", "characters")
                try:
                    schema: Any = json.loads(text)
                except (ValueError, RecursionError):
                    return  # not JSON: the schema parser reports it with its position
            else:
                schema = document
            size, depth = _json_size_and_depth(schema)
            _over(where, size, self.max_grammar_chars, "max_grammar_chars", "characters as compact JSON")
            _over(where, depth, self.max_grammar_depth, "max_grammar_depth", "levels of nesting")
            for pattern in _schema_patterns(schema):
                _over(
                    where,
                    regex_depth(pattern),
                    self.max_grammar_depth,
                    "max_grammar_depth",
                    "nested groups in a pattern",
                )
                check_text(pattern, where)
        elif spec.choice is not None:
            total = sum(len(c) for c in spec.choice)
            _over(where, total, self.max_grammar_chars, "max_grammar_chars", "characters in all choices")
            for c in spec.choice:
                check_text(c, where)
        elif spec.regex is not None or spec.grammar is not None:
            text = spec.regex if spec.regex is not None else spec.grammar
            if not isinstance(text, str):
                raise LimitError(f"{where} must be a string, got {type(text).__name__}", where)
            _over(where, len(text), self.max_grammar_chars, "max_grammar_chars", "characters")
            depth = regex_depth(text, grammar=spec.grammar is not None)
            _over(where, depth, self.max_grammar_depth, "max_grammar_depth", "nested groups")
            check_text(text, where)

    # ---- what only an HTTP request has -----------------------------------------------------------
    def check_sequences(self, num_prompts: int, n: int) -> None:
        """A request's prompts times n; n alone first, so the message names the field at fault."""
        _over("n", n, self.max_n, "max_n")
        if num_prompts * n > self.max_sequences:
            param = "prompt" if num_prompts > 1 else "n"
            raise LimitError(
                f"{param}: this request asks for {num_prompts} prompt(s) x n={n} = {num_prompts * n} "
                f"sequences, more than the limit of {self.max_sequences} (--max-sequences)",
                param,
            )

    def check_messages(self, messages: Sequence[Any], max_model_len: int) -> None:
        """Number of chat messages (dicts or the server's message models), and their text in total
        against the prompt character limit."""
        _over("messages", len(messages), self.max_messages, "max_messages", "messages")
        total = 0
        for message in messages:
            content = _get(message, "content")
            if isinstance(content, str):
                total += len(content)
            elif isinstance(content, list):  # content parts
                total += sum(len(t) for part in content if isinstance(t := _get(part, "text"), str))
        limit = self.prompt_char_limit(max_model_len)
        _over("messages", total, limit, "max_prompt_chars", "characters of content")


def _get(item: Any, name: str) -> Any:
    return item.get(name) if isinstance(item, Mapping) else getattr(item, name, None)


def check_context(
    num_prompt_tokens: int,
    max_tokens: int | None,
    min_tokens: int,
    max_model_len: int,
    param: str = "max_tokens",
) -> None:
    """The prompt plus max_tokens (and min_tokens) must fit the context; never truncated silently.
    One policy for the offline LLM and the server; max_tokens=None means up to the context."""
    for name, wanted in ((param, max_tokens), ("min_tokens", min_tokens)):
        if wanted and num_prompt_tokens + wanted > max_model_len:
            raise LimitError(
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{num_prompt_tokens + wanted} tokens ({num_prompt_tokens} in the prompt, {wanted} for the "
                f"completion). Shorten the prompt or lower {name}.",
                name,
            )


def check_text(text: str, param: str) -> None:
    """Text must be valid Unicode: a lone UTF-16 surrogate cannot be encoded, tokenized or matched."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise LimitError(
            f"{param} is not valid Unicode text: U+{ord(text[exc.start]):04X} is a lone UTF-16 surrogate",
            param,
        ) from None


def regex_depth(text: str, *, grammar: bool = False) -> int:
    """How deeply groups nest in a regex (or, with grammar=True, an EBNF / Lark grammar, whose quoted
    strings are skipped too): escapes and character classes are skipped, each '(' opens a level.
    Linear in the text."""
    depth = deepest = 0
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":  # a character class: its brackets are literal
            i += 1
            while i < n and text[i] != "]":
                i += 2 if text[i] == "\\" else 1
        elif c == '"' and grammar:  # a grammar's string literal
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
        elif c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth = max(depth - 1, 0)
        i += 1
    return deepest


def _over(param: str, value: int, limit: int, field: str, unit: str = "") -> None:
    if value > limit:
        what = f"{value} {unit}".strip() if unit else str(value)
        flag = "--" + field.replace("_", "-")
        raise LimitError(f"{param}: {what} is more than this server allows ({limit}; {flag})", param)


def _json_size_and_depth(value: Any) -> tuple[int, int]:
    """Characters of `value` as compact JSON (approximately: strings count their length plus quotes),
    and its nesting depth, without recursion."""
    size, deepest = 0, 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, Mapping):
            deepest = max(deepest, depth)
            size += 2 + len(item)
            for key, child in item.items():
                size += len(str(key)) + 3
                stack.append((child, depth + 1))
        elif isinstance(item, list | tuple):
            deepest = max(deepest, depth)
            size += 2 + len(item)
            stack.extend((child, depth + 1) for child in item)
        elif isinstance(item, str):
            size += len(item) + 2
        else:
            size += len(str(item))
    return size, deepest


def _schema_patterns(schema: Any) -> list[str]:
    """The regexes in a JSON schema: `pattern` values and `patternProperties` keys."""
    found: list[str] = []
    stack = [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, Mapping):
            pattern = item.get("pattern")
            if isinstance(pattern, str):
                found.append(pattern)
            props = item.get("patternProperties")
            if isinstance(props, Mapping):
                found.extend(k for k in props if isinstance(k, str))
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found
