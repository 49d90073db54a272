"""How this server renders chats and reads replies, settled once at start from the model's chat
template and the server flags (--tool-call-parser, --reasoning-parser,
--default-chat-template-kwargs)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from pagoda.entrypoints.openai.reasoning import REASONING_PARSERS, detect_reasoning_parser
from pagoda.entrypoints.openai.tool_parsers import TOOL_PARSERS, ToolFormat, detect_tool_format, tool_format
from pagoda.tokenizer.chat import (
    apply_chat_template,
    chat_template_text,
    check_template_kwargs,
    template_variables,
)

logger = logging.getLogger("pagoda.server")

# A conversation with one call, rendered to tell apart variants of a family's syntax.
_PROBE_TOOL = {"type": "function", "function": {"name": "probe_fn", "parameters": {"type": "object"}}}
_PROBE_MESSAGES = [
    {"role": "user", "content": "x"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "abcdefghi", "type": "function", "function": {"name": "probe_fn", "arguments": {"k": 1}}}
        ],
    },
    {"role": "tool", "tool_call_id": "abcdefghi", "content": "y"},
]


@dataclass(frozen=True)
class ChatSettings:
    """``tool_format``: how calls are written and read (None: tools are rendered, calls are not
    parsed). ``reasoning_parser``: qwen3, deepseek_r1 or None. ``special_tokens``: the texts of the
    tokenizer's special tokens (hidden from replies when a parser needs some of them shown)."""

    has_template: bool = False
    renders_tools: bool = False
    tool_format: ToolFormat | None = None
    reasoning_parser: str | None = None
    default_kwargs: Mapping[str, Any] = field(default_factory=dict)
    special_tokens: tuple[str, ...] = ()

    @classmethod
    def create(
        cls,
        tokenizer: PreTrainedTokenizerBase,
        *,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
        default_kwargs: Mapping[str, Any] | None = None,
    ) -> ChatSettings:
        """``tool_call_parser`` / ``reasoning_parser``: a name, "none", or None to choose from the
        template. ValueError for an unknown name or a default keyword the template never reads."""
        if tool_call_parser not in (None, "none", *TOOL_PARSERS):
            raise ValueError(
                f"unknown tool call parser {tool_call_parser!r}; choose one of {', '.join(TOOL_PARSERS)} or none"
            )
        if reasoning_parser not in (None, "none", *REASONING_PARSERS):
            raise ValueError(
                f"unknown reasoning parser {reasoning_parser!r}; choose one of {', '.join(REASONING_PARSERS)} "
                "or none"
            )
        default_kwargs = dict(default_kwargs or {})
        specials = tuple(
            t.content for t in tokenizer.backend_tokenizer.get_added_tokens_decoder().values() if t.special
        )
        try:
            template = chat_template_text(tokenizer)
        except ValueError:
            if default_kwargs:
                raise ValueError(
                    "--default-chat-template-kwargs needs a model with a chat template"
                ) from None
            return cls(special_tokens=specials)
        check_template_kwargs(tokenizer, default_kwargs)
        variables = template_variables(tokenizer)
        renders_tools = variables is None or "tools" in variables
        name = detect_tool_format(template) if tool_call_parser is None else tool_call_parser
        fmt = None
        if name not in (None, "none"):
            fmt = tool_format(name, lambda: _render_probe(tokenizer))
        reasoning = detect_reasoning_parser(template) if reasoning_parser is None else reasoning_parser
        return cls(
            has_template=True,
            renders_tools=renders_tools,
            tool_format=fmt,
            reasoning_parser=None if reasoning == "none" else reasoning,
            default_kwargs=default_kwargs,
            special_tokens=specials,
        )

    def describe(self) -> list[tuple[int, str]]:
        """(log level, message) lines for the server's start."""
        if not self.has_template:
            return [
                (logging.INFO, "the model has no chat template: /v1/chat/completions will refuse requests")
            ]
        lines = []
        if not self.renders_tools:
            lines.append(
                (logging.INFO, "the chat template does not render tools: requests with tools are refused")
            )
        elif self.tool_format is None:
            lines.append(
                (
                    logging.WARNING,
                    "no tool call parser knows this chat template's call format: tools are rendered into "
                    "prompts but calls come back as content (choose one with --tool-call-parser)",
                )
            )
        else:
            lines.append((logging.INFO, f"tool calls are parsed as {self.tool_format.name}"))
        if self.reasoning_parser is not None:
            lines.append((logging.INFO, f"reasoning is parsed as {self.reasoning_parser}"))
        return lines

    def hidden_specials(
        self, skip_special_tokens: bool, *, tools: bool, reasoning: bool
    ) -> tuple[str, ...] | None:
        """When the parsers a reply uses (``tools``, ``reasoning``) need special tokens shown (markers
        such as [TOOL_CALLS]), the other special tokens to hide as ``skip_special_tokens`` would; None
        when the decode can skip them itself."""
        needed: set[str] = set()
        if tools and self.tool_format is not None:
            needed |= set(self.tool_format.visible)
        if reasoning and self.reasoning_parser is not None:
            needed |= {"<think>", "</think>"}
        needed &= set(self.special_tokens)
        if not needed:
            return None
        return tuple(t for t in self.special_tokens if t not in needed) if skip_special_tokens else ()


def _render_probe(tokenizer: PreTrainedTokenizerBase) -> str | None:
    try:
        ids = apply_chat_template(
            tokenizer, _PROBE_MESSAGES, add_generation_prompt=False, tools=[_PROBE_TOOL]
        )
    except ValueError:
        return None
    return tokenizer.decode(ids, skip_special_tokens=False)


def log_settings(settings: ChatSettings) -> None:
    for level, message in settings.describe():
        logger.log(level, message)
