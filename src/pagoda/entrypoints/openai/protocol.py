"""Request and response bodies of the OpenAI-compatible API (field names as in OpenAI and vLLM).

Requests forbid unknown fields. Fields that OpenAI defines but this server cannot honour are
declared so that the error names them, and are refused by `unsupported()` when set.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_serializer, model_validator

from pagoda.sampling_params import SamplingParams, StructuredOutputs


class ParamError(ValueError):
    """A request parameter that cannot be honoured; `param` names it."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class _Strict(BaseModel):
    # Unknown fields are refused, and values must have their JSON type ("2" is not an integer).
    model_config = ConfigDict(extra="forbid", strict=True)


# ---- requests --------------------------------------------------------------------------------------
class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk


class JsonSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        return self

    def to_structured(self) -> StructuredOutputs | None:
        if self.type == "json_object":
            return StructuredOutputs(json_object=True)
        if self.type == "json_schema" and self.json_schema is not None:  # _schema_given checked it is set
            return StructuredOutputs(json=self.json_schema.schema_)
        return None


class StructuredOutputsField(_Strict):
    """vLLM's `structured_outputs` request field."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _SamplingRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extras
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = None

    def _structured_outputs(self) -> StructuredOutputs | None:
        """The one output constraint asked for, by whichever field; two at once is an error."""
        given: dict[str, StructuredOutputs] = {}
        if self.response_format is not None and (spec := self.response_format.to_structured()) is not None:
            given["response_format"] = spec
        candidates: dict[str, dict[str, Any]] = {
            "guided_json": {"json": self.guided_json},
            "guided_regex": {"regex": self.guided_regex},
            "guided_choice": {"choice": self.guided_choice},
            "guided_grammar": {"grammar": self.guided_grammar},
            "structured_outputs": self.structured_outputs.model_dump(exclude_none=True, by_alias=True)
            if self.structured_outputs is not None
            else {},
        }
        for name, fields in candidates.items():
            fields = {k: v for k, v in fields.items() if v is not None}
            if not fields:
                continue
            try:
                given[name] = StructuredOutputs(**fields)
            except ValueError as exc:
                raise ParamError(f"{name}: {exc}", name) from None
        if len(given) > 1:
            raise ParamError(
                f"only one output constraint may be given, got {', '.join(given)}", list(given)[1]
            )
        return next(iter(given.values()), None)

    def common_checks(self) -> None:
        """Raises ValueError (message, param) for combinations that cannot be honoured."""
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options is only allowed with stream: true", "stream_options")

    def sampling_params(
        self, vocab_size: int, max_tokens: int | None, logprobs: int | None
    ) -> SamplingParams:
        """SamplingParams; raises ParamError naming the bad field."""
        bias = None
        if self.logit_bias is not None:
            bias = {}
            for key, value in self.logit_bias.items():
                try:
                    token = int(key)
                except ValueError:
                    raise ParamError(f"logit_bias key {key!r} is not a token id", "logit_bias") from None
                if not 0 <= token < vocab_size:
                    raise ParamError(f"logit_bias token id {token} is not in [0, {vocab_size})", "logit_bias")
                bias[token] = value
        for tok in self.stop_token_ids or ():
            if not 0 <= tok < vocab_size:
                raise ParamError(f"stop_token_ids entry {tok} is not in [0, {vocab_size})", "stop_token_ids")
        structured = self._structured_outputs()
        values = {
            "n": self.n,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "seed": self.seed,
            "max_tokens": max_tokens,
            "min_tokens": self.min_tokens,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "logprobs": logprobs,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": self.skip_special_tokens,
            "logit_bias": bias,
            "structured_outputs": structured,
        }
        # A null in the request means "the default", as an omitted field does (max_tokens: None is
        # meaningful, "up to the context length").
        kwargs = {k: v for k, v in values.items() if v is not None or k == "max_tokens"}
        try:
            return SamplingParams(**kwargs)
        except ValueError as exc:
            message = str(exc)
            first_word = message.split(" ", 1)[0]
            raise ParamError(message, first_word if first_word in kwargs else None) from None


PromptInput = StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]


class CompletionRequest(_SamplingRequest):
    prompt: PromptInput
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    def max_tokens_requested(self) -> int | None:
        return self.max_tokens

    def check(self) -> None:
        self.common_checks()
        if self.suffix is not None:
            raise ParamError("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise ParamError(f"best_of ({self.best_of}) other than n ({self.n}) is not supported", "best_of")
        if self.echo and self.logprobs is not None:
            raise ParamError("echo with logprobs needs prompt logprobs, which are not supported", "echo")

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list of strings or token-id lists; ParamError if empty."""
        p = self.prompt
        if isinstance(p, str):
            prompts: list[Any] = [p]
        elif p and isinstance(p[0], int):
            prompts = [p]
        else:
            prompts = list(p)
        if not prompts or any(len(x) == 0 for x in prompts):
            raise ParamError("prompt must not be empty", "prompt")
        return prompts


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> ContentPart:
        if self.type != "text":
            raise ValueError(f"content parts of type {self.type!r} are not supported; only 'text'")
        if self.text is None:
            raise ValueError("a text content part needs 'text'")
        return self


class ChatMessage(_Strict):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def to_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text or "" for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # OpenAI fields this server refuses when set (see check()).
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None

    def max_tokens_requested(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def check(self) -> None:
        self.common_checks()
        for name in ("tools", "functions", "function_call"):
            if getattr(self, name):
                raise ParamError(f"{name} is not supported by this server", name)
        if self.tool_choice not in (None, "none"):
            raise ParamError("tool_choice is not supported by this server", "tool_choice")
        if self.top_logprobs is not None and not self.logprobs:
            raise ParamError("top_logprobs needs logprobs: true", "top_logprobs")
        if (
            self.max_tokens is not None
            and self.max_completion_tokens is not None
            and self.max_tokens != self.max_completion_tokens
        ):
            raise ParamError("max_tokens and max_completion_tokens disagree; send one", "max_tokens")
        if not self.messages:
            raise ParamError("messages must not be empty", "messages")

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt and messages")
        return self


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[StrictInt]


# ---- responses -------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobToken] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=now_s)
    owned_by: str = "pagoda"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]
