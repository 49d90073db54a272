"""Chat messages to prompt token ids with the model's template: tools, documents, template keywords
(per request, over the server's defaults), the generation prompt or the continued final message.
Every problem is a 400 naming its field."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from pagoda.entrypoints.openai.chat_settings import ChatSettings
from pagoda.entrypoints.openai.errors import APIError
from pagoda.entrypoints.openai.protocol import ChatMessage, ChatTemplateFields
from pagoda.tokenizer.chat import apply_chat_template, check_template_kwargs

# Fields with a request field of their own: not taken from chat_template_kwargs.
_OWN_FIELDS = ("messages", "tools", "documents", "add_generation_prompt", "continue_final_message")
# Prompt tokens decoded to tell where the reply starts (e.g. inside an opened <think>).
_TAIL_TOKENS = 16


@dataclass(frozen=True)
class RenderedChat:
    prompt_ids: list[int]
    tail: str  # the text of the prompt's last tokens


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    settings: ChatSettings,
    messages: list[ChatMessage],
    fields: ChatTemplateFields,
) -> RenderedChat:
    kwargs = dict(fields.chat_template_kwargs or {})
    for key in kwargs:
        if key in _OWN_FIELDS:
            raise APIError(
                f"chat_template_kwargs.{key}: send {key} as a request field", param="chat_template_kwargs"
            )
    _check(tokenizer, kwargs, "chat_template_kwargs")
    extra: dict[str, object] = {}
    if fields.tools:
        if not settings.renders_tools:
            raise APIError("this model's chat template does not render tools", param="tools")
        extra["tools"] = [tool.to_dict() for tool in fields.tools]
    if fields.documents is not None:
        _check(tokenizer, {"documents": fields.documents}, "documents")
        extra["documents"] = fields.documents
    if fields.continue_final_message:
        extra["continue_final_message"] = True
    dicts = [m.to_dict() for m in messages]
    fmt = settings.tool_format
    if fmt is not None and fmt.prepare_messages is not None:
        dicts = fmt.prepare_messages(dicts)
    try:
        ids = apply_chat_template(
            tokenizer,
            dicts,
            add_generation_prompt=fields.add_generation_prompt,
            **extra,
            **{**settings.default_kwargs, **kwargs},
        )
    except ValueError as exc:
        raise APIError(str(exc), param="messages") from None
    return RenderedChat(ids, tokenizer.decode(ids[-_TAIL_TOKENS:], skip_special_tokens=False))


def _check(tokenizer: PreTrainedTokenizerBase, kwargs: dict, param: str) -> None:
    try:
        check_template_kwargs(tokenizer, kwargs)
    except ValueError as exc:
        raise APIError(f"{param}: {exc}", param=param) from None
