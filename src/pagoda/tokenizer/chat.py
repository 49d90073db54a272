"""Rendering chat messages to prompt token ids with the tokenizer's own chat template."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
from transformers import PreTrainedTokenizerBase

_BASE_ROLES = ("system", "user", "assistant")
# Arguments that would change what apply_chat_template returns: this wrapper always returns token ids.
_RESERVED_KWARGS = ("tokenize", "return_dict", "return_tensors", "return_assistant_tokens_mask", "padding")


def chat_template_text(tokenizer: PreTrainedTokenizerBase) -> str:
    """The tokenizer's chat template (all named templates joined); ValueError if it has none."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, Mapping):
        template = "\n".join(str(t) for t in template.values())
    if not template:
        raise ValueError(
            "this tokenizer has no chat template (tokenizer_config.json 'chat_template' or "
            "chat_template.jinja); send a plain prompt instead of chat messages"
        )
    return template


def chat_roles(tokenizer: PreTrainedTokenizerBase) -> tuple[str, ...]:
    """The message roles the chat template takes: ``tool`` when the template mentions tools.
    ValueError if the tokenizer has no template."""
    return (*_BASE_ROLES, "tool") if "tool" in chat_template_text(tokenizer) else _BASE_ROLES


def validate_messages(messages: object, allowed_roles: Sequence[str] = _BASE_ROLES) -> None:
    """Checks that ``messages`` is a non-empty list of {role, content} dicts with allowed roles."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(
            f"messages must be a non-empty list of {{role, content}} objects, got {messages!r:.100}"
        )
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content', got {msg!r:.100}")
        role = msg.get("role")
        if role not in allowed_roles:
            raise ValueError(
                f"messages[{i}].role must be one of {', '.join(allowed_roles)}; got {role!r:.50}"
            )
        content = msg.get("content")
        if content is None:
            # An assistant turn that only calls tools has no content.
            if not (role == "assistant" and msg.get("tool_calls")):
                raise ValueError(f"messages[{i}] ({role}) has no 'content'")
        elif not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string, got {type(content).__name__}")


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    **kwargs: Any,
) -> list[int]:
    """Renders ``messages`` with the tokenizer's chat template and returns the prompt token ids.

    The ``tool`` role is accepted when the template mentions tools. Extra keyword arguments (``tools``,
    ``documents``, ``continue_final_message``, template variables such as ``enable_thinking``) go to
    ``tokenizer.apply_chat_template``.
    """
    validate_messages(messages, chat_roles(tokenizer))
    reserved = [k for k in _RESERVED_KWARGS if k in kwargs]
    if reserved:
        raise ValueError(
            f"apply_chat_template always returns a list of token ids; do not pass {', '.join(reserved)}"
        )
    try:
        ids = tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=False,
            **kwargs,
        )
    except jinja2.TemplateError as exc:  # includes raise_exception() calls inside the template
        raise ValueError(f"the chat template rejected the messages: {exc}") from exc
    return [int(t) for t in ids]
