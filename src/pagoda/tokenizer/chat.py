"""Rendering chat messages to prompt token ids with the tokenizer's own chat template."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.meta
from transformers import PreTrainedTokenizerBase

from pagoda.json_input import parse_json_object

_BASE_ROLES = ("system", "user", "assistant")
# Arguments that would change what apply_chat_template returns: this wrapper always returns token ids.
_RESERVED_KWARGS = (
    "tokenize",
    "return_dict",
    "return_tensors",
    "return_assistant_tokens_mask",
    "padding",
    "truncation",
    "max_length",
)
# Arguments transformers itself takes rather than passing to the template.
_OWN_KWARGS = ("chat_template", "tokenizer_kwargs")


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


@functools.lru_cache(maxsize=16)
def _variables(template: str) -> frozenset[str] | None:
    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(env.parse(template)))
    except jinja2.TemplateError:  # a syntax our plain environment lacks (e.g. {% generation %})
        return None


def template_variables(tokenizer: PreTrainedTokenizerBase) -> frozenset[str] | None:
    """The variables the chat template reads (None if it cannot be parsed here: no checks then)."""
    return _variables(chat_template_text(tokenizer))


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
        calls = msg.get("tool_calls")
        if calls is not None and (role != "assistant" or not isinstance(calls, list)):
            raise ValueError(f"messages[{i}].tool_calls must be a list, on an assistant message")


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates read them: tool call ``arguments`` as objects (OpenAI sends JSON
    text), the reasoning as ``reasoning_content`` whichever name it came under."""
    out = []
    for i, msg in enumerate(messages):
        msg = dict(msg)
        if msg.get("reasoning") is not None:
            if msg.get("reasoning_content") not in (None, msg["reasoning"]):
                raise ValueError(f"messages[{i}]: reasoning and reasoning_content differ; send one")
            msg["reasoning_content"] = msg.pop("reasoning")
        if msg.get("tool_calls"):
            msg["tool_calls"] = [
                _tool_call(call, f"messages[{i}].tool_calls[{j}]") for j, call in enumerate(msg["tool_calls"])
            ]
        out.append(msg)
    return out


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ValueError(f"{where} must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}")
    arguments = parse_json_object(function.get("arguments", {}), f"{where}.function.arguments")
    return {**call, "function": {**function, "arguments": arguments}}


def check_template_kwargs(tokenizer: PreTrainedTokenizerBase, kwargs: Mapping[str, Any]) -> None:
    """ValueError naming a keyword the chat template never reads (it would be ignored)."""
    if all(value is None for value in kwargs.values()):
        return
    used = template_variables(tokenizer)
    if used is None:
        return
    for key, value in kwargs.items():
        if value is None or key in used:
            continue
        if key == "tools":
            raise ValueError("this model's chat template does not render tools")
        if key == "documents":
            raise ValueError("this model's chat template does not render documents")
        raise ValueError(f"this model's chat template does not use {key!r}")


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    **kwargs: Any,
) -> list[int]:
    """Renders ``messages`` with the tokenizer's chat template and returns the prompt token ids.

    The ``tool`` role is accepted when the template mentions tools; tool call arguments may be
    JSON text (they are parsed). Extra keyword arguments (``tools``, ``documents``,
    ``continue_final_message``, template variables such as ``enable_thinking``) go to
    ``tokenizer.apply_chat_template``; one the template never reads is a ValueError.
    """
    validate_messages(messages, chat_roles(tokenizer))
    reserved = [k for k in (*_RESERVED_KWARGS, *_OWN_KWARGS) if k in kwargs]
    if reserved:
        raise ValueError(
            f"apply_chat_template always returns a list of token ids with the model's template; "
            f"do not pass {', '.join(reserved)}"
        )
    continue_final = bool(kwargs.get("continue_final_message"))
    if continue_final and messages[-1].get("role") != "assistant":
        raise ValueError("continue_final_message needs an assistant message last")
    check_template_kwargs(tokenizer, {k: v for k, v in kwargs.items() if k != "continue_final_message"})
    try:
        ids = tokenizer.apply_chat_template(
            normalize_messages(messages),
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=False,
            **kwargs,
        )
    except jinja2.TemplateError as exc:  # includes raise_exception() calls inside the template
        raise ValueError(f"the chat template rejected the messages: {exc}") from exc
    return [int(t) for t in ids]
