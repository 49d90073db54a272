"""Request and response bodies of the OpenAI-compatible API (field names as in OpenAI and vLLM).

Requests forbid unknown fields. Fields that OpenAI defines but this server cannot honour are
declared so that the error names them, and are refused by `unsupported()` when set.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, Literal

import jsonschema
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    field_validator,
    model_serializer,
    model_validator,
)

from pagoda.json_input import parse_json_object
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
    structural_tag: dict[str, Any] | str | None = None


class PredictionTextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class Prediction(_Strict):
    """OpenAI's predicted output: text the reply is expected to mostly repeat (a string, or text
    content parts, joined)."""

    type: Literal["content"]
    content: StrictStr | list[PredictionTextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


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
    prediction: Prediction | None = None
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
    prompt_logprobs: int | None = None
    # pagoda's extension (SGLang's name): prompt logprobs only from this position on
    logprob_start_len: int | None = None

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

    def structured_outputs_requested(self) -> StructuredOutputs | None:
        """The user's own output constraint (ParamError if malformed or more than one)."""
        return self._structured_outputs()

    def common_checks(self) -> None:
        """Raises ValueError (message, param) for combinations that cannot be honoured."""
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options is only allowed with stream: true", "stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise ParamError("prompt_logprobs are not available with stream: true", "prompt_logprobs")

    def sampling_params(
        self,
        vocab_size: int,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
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
            "prompt_logprobs": self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            "logprob_start_len": self.logprob_start_len,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": self.skip_special_tokens,
            "logit_bias": bias,
            "structured_outputs": structured,
            "prediction": self.prediction.text() if self.prediction is not None else None,
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
    # 0: a prompt-only request (OpenAI's legacy scoring with echo and logprobs, vLLM's
    # prompt_logprobs, or a prompt put in the prefix cache): the prompt alone, nothing generated.
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None
    # vLLM's: each choice also carries its prompt's token ids and its output's (in a stream: the
    # prompt's in the choice's first chunk, each chunk's new tokens).
    return_token_ids: bool | None = None
    # pagoda's extension for scoring continuations (pagoda.lang's select): each prompt's logprobs
    # start at its first token that differs from the tokens of its first `logprob_start_char`
    # characters (Unicode code points) alone, and each choice's prompt_logprobs hold that span
    # only, from its `prompt_logprobs_start` (see continuations.py).
    logprob_start_char: StrictInt | None = None

    def max_tokens_requested(self) -> int | None:
        return self.max_tokens

    def check(self) -> None:
        self.common_checks()
        if self.logprob_start_char is not None:
            self._check_start_char()
        if self.suffix is not None:
            raise ParamError("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise ParamError(f"best_of ({self.best_of}) other than n ({self.n}) is not supported", "best_of")

    def _check_start_char(self) -> None:
        chars, field = self.logprob_start_char, "logprob_start_char"
        if chars is None:
            return
        if chars < 0:
            raise ParamError(f"logprob_start_char must be an integer >= 0, got {chars}", field)
        if self.logprob_start_len is not None:
            raise ParamError("logprob_start_char and logprob_start_len cannot be given together", field)
        if self.prompt_logprobs is None:
            raise ParamError("logprob_start_char needs prompt_logprobs", field)
        prompts = self.prompts()
        if not all(isinstance(p, str) for p in prompts):
            raise ParamError("logprob_start_char needs text prompts (it counts characters)", field)
        shortest = min(len(p) for p in prompts)
        if chars > shortest:
            raise ParamError(
                f"logprob_start_char ({chars}) must be at most the prompt's length ({shortest} characters)",
                field,
            )

    def engine_prompt_logprobs(self) -> int | None:
        """prompt_logprobs, or with echo the logprobs asked (the echoed prompt's, as vLLM)."""
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs

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


# OpenAI's function names, plus "." and ":" (namespaced tools); every call syntax can write them.
_TOOL_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


class FunctionDefinition(_Strict):
    name: StrictStr
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not _TOOL_NAME.fullmatch(name):
            raise ValueError(f"tool name {name!r:.80} must be 1 to 64 letters, digits, '_', '-', '.' or ':'")
        return name

    @field_validator("parameters")
    @classmethod
    def _schema(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        if schema is not None:
            try:
                jsonschema.validators.validator_for(schema).check_schema(schema)
            except jsonschema.SchemaError as e:
                where = "/".join(str(p) for p in e.absolute_path) or "(root)"
                raise ValueError(f"not a valid JSON schema at {where}: {e.message}") from None
        return schema


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition

    def to_dict(self) -> dict[str, Any]:
        """The tool as chat templates read it (OpenAI's shape)."""
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class NamedFunction(_Strict):
    name: StrictStr


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(_Strict):
    name: StrictStr
    arguments: dict[str, Any] | str

    @field_validator("arguments")
    @classmethod
    def _object(cls, arguments: dict[str, Any] | str) -> dict[str, Any]:
        """Templates read arguments as an object: a JSON string is parsed here."""
        return parse_json_object(arguments, "arguments")


class ToolCallItem(_Strict):
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None
    tool_call_id: str | None = None
    # The assistant's reasoning, under either name (vLLM's newer one is "reasoning").
    reasoning_content: str | None = None
    reasoning: str | None = None
    # Fields of OpenAI's reply message that clients send back with it: accepted when empty.
    refusal: str | None = None
    audio: Any = None
    function_call: Any = None
    annotations: list[Any] | None = None

    @model_validator(mode="after")
    def _fields_fit_role(self) -> ChatMessage:
        for name in ("refusal", "audio", "function_call", "annotations"):
            if getattr(self, name):
                raise ValueError(f"{name} in a message is not supported")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages have tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("only tool messages have a tool_call_id")
        if (self.reasoning_content is not None or self.reasoning is not None) and self.role != "assistant":
            raise ValueError("only assistant messages have reasoning")
        if None not in (self.reasoning, self.reasoning_content) and self.reasoning != self.reasoning_content:
            raise ValueError("reasoning and reasoning_content differ; send one")
        return self

    def to_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text or "" for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        return message


class ChatTemplateFields(_Strict):
    """How messages are rendered: shared by chat completions and /tokenize (names as in vLLM)."""

    tools: list[ChatTool] | None = None
    documents: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False

    def template_checks(self, messages: list[ChatMessage]) -> None:
        if self.continue_final_message and self.add_generation_prompt:
            raise ParamError(
                "continue_final_message continues the last assistant message; set add_generation_prompt "
                "to false with it",
                "continue_final_message",
            )
        if self.continue_final_message and (not messages or messages[-1].role != "assistant"):
            raise ParamError(
                "continue_final_message needs an assistant message last", "continue_final_message"
            )
        names = [t.function.name for t in self.tools or ()]
        duplicate = next((n for n in names if names.count(n) > 1), None)
        if duplicate is not None:
            raise ParamError(f"two tools are named {duplicate!r}", "tools")


class ChatCompletionRequest(ChatTemplateFields, _SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    # OpenAI's deprecated function-calling fields, refused when set (see check()).
    functions: list[Any] | None = None
    function_call: Any = None

    def max_tokens_requested(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def tool_mode(self) -> Literal["none", "auto", "required", "named"]:
        """What the tool choice asks for; "none" also when no tools are given."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return "required" if self.tool_choice == "required" else "auto"

    def check(self) -> None:
        self.common_checks()
        for name in ("functions", "function_call"):
            if getattr(self, name):
                raise ParamError(f"{name} is deprecated and not supported: send tools and tool_choice", name)
        self.template_checks(self.messages)
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ParamError("tool_choice needs tools", "tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice):
            wanted = self.tool_choice.function.name
            if wanted not in {t.function.name for t in self.tools or ()}:
                raise ParamError(f"tool_choice names {wanted!r}, which is not among the tools", "tool_choice")
        if self.tool_mode() in ("required", "named") and self.structured_outputs_requested() is not None:
            raise ParamError(
                "an output constraint cannot be combined with tool_choice 'required' or a named tool: "
                "the call is the constraint",
                "tool_choice",
            )
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
        for name in ("max_completion_tokens", "max_tokens"):
            if getattr(self, name) == 0:
                raise ParamError(
                    f"{name} must be at least 1 for chat completions (a prompt alone: "
                    "/v1/completions with max_tokens 0)",
                    name,
                )

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(ChatTemplateFields):
    model: str | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt and messages")
        chat_only = ("tools", "documents", "chat_template_kwargs", "continue_final_message")
        used = [name for name in chat_only if getattr(self, name)]
        if self.prompt is not None and used:
            raise ValueError(f"{used[0]} is only for messages, not a prompt")
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


class CompletionTokensDetails(BaseModel):
    """With a prediction: its tokens that are in the completion, and those that are not (OpenAI)."""

    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None  # only with a prediction


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: per prompt token, None (the first) or token id -> its logprob
PromptLogprobsOut = list[dict[int, PromptLogprob] | None]


def prompt_logprobs_out(entries: list | None) -> PromptLogprobsOut | None:
    if entries is None:
        return None
    return [None if e is None else {t: PromptLogprob(**vars(lp)) for t, lp in e.items()} for e in entries]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobsOut | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids
    token_ids: list[int] | None = None  # with return_token_ids
    # With logprob_start_char only (absent otherwise): prompt_logprobs[0]'s position.
    prompt_logprobs_start: int | None = Field(default=None, exclude_if=lambda v: v is None)


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


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # the same text under vLLM's newer name
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


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
    prompt_logprobs: PromptLogprobsOut | None = None


class _WithoutNulls(BaseModel):
    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_WithoutNulls):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_WithoutNulls):
    """One call's part of a stream delta: ``id``, ``type`` and ``name`` in its first delta only."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(_WithoutNulls):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


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
    format: str | None = None  # how the weights are stored (e.g. GGUF MOSTLY_Q4_K_M, quantized at load)


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]
