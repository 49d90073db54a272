"""One chat request's reply: the constraint its tool choice and reasoning need, and the parsers that
turn each choice's text into reasoning, content and tool calls.

The constraint, by tool choice (see ``pagoda.structured.tags`` for the grammar of each):

* ``required`` / named: the family's call syntax, arguments by schema, after the reasoning span if
  the reply thinks. A user constraint with them is an error (the call is the constraint).
* ``auto``: the user's constraint if there is one (its text is parsed for calls as any text would
  be); else the ``strict`` tools' calls (all calls when ``parallel_tool_calls`` is false).
* ``none`` / no tools: the user's constraint, if any. Calls are never parsed.

Any constraint applies to the answer: a reply that thinks first gets free text up to the end of
the thought (the prompt tells whether the output starts inside one).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from pagoda.entrypoints.openai.chat_settings import ChatSettings
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest, NamedToolChoice, ParamError
from pagoda.entrypoints.openai.reasoning import PromptState, ReasoningParser, think_span
from pagoda.entrypoints.openai.tool_parsers import ParserConfig, ToolCallDelta, ToolFormat, ToolParser
from pagoda.sampling_params import StructuredOutputs
from pagoda.structured.tags import ToolSchema, answer_after_thinking, tool_call_constraint


@dataclass
class ChoiceDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


class HiddenText:
    """Removes given strings (special tokens the decode had to keep) from streamed text, holding
    back an end that may be the start of one."""

    def __init__(self, hidden: tuple[str, ...]) -> None:
        self._pattern = re.compile("|".join(map(re.escape, sorted(hidden, key=len, reverse=True))))
        self._prefixes = {h[:k] for h in hidden for k in range(1, len(h))}
        self._max = max(map(len, hidden)) - 1
        self._buf = ""

    def feed(self, text: str, final: bool = False) -> str:
        buf = self._pattern.sub("", self._buf + text)
        keep = 0
        if not final:
            for k in range(min(self._max, len(buf)), 0, -1):
                if buf[-k:] in self._prefixes:
                    keep = k
                    break
        self._buf = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]


class ChoiceParser:
    """text → (hidden specials removed) → reasoning / answer → content / tool calls, for one choice."""

    def __init__(
        self, hidden: HiddenText | None, reasoning: ReasoningParser | None, tools: ToolParser | None
    ) -> None:
        self._hidden = hidden
        self._reasoning = reasoning
        self._tools = tools

    @property
    def num_calls(self) -> int:
        return self._tools.num_calls if self._tools is not None else 0

    def feed(self, text: str) -> ChoiceDelta:
        return self._run(text, final=False)

    def finish(self) -> ChoiceDelta:
        return self._run("", final=True)

    def _run(self, text: str, final: bool) -> ChoiceDelta:
        if self._hidden is not None:
            text = self._hidden.feed(text, final)
        out = ChoiceDelta()
        answer = text
        if self._reasoning is not None:
            out.reasoning, answer = self._reasoning.feed(text)
            if final:
                reasoning, rest = self._reasoning.finish()
                out.reasoning += reasoning
                answer += rest
        if self._tools is None:
            out.content = answer
            return out
        deltas = [self._tools.feed(answer)] if answer else []
        if final:
            deltas.append(self._tools.finish())
        for d in deltas:
            out.content += d.content
            out.calls.extend(d.calls)
        return out


@dataclass(frozen=True)
class ReplyPlan:
    """What a chat request's reply needs: the constraint, how the engine decodes, and what to parse."""

    structured: StructuredOutputs | None
    hidden: tuple[str, ...] | None  # None: decode as asked; else keep special tokens, hide these
    tool_format: ToolFormat | None
    parser_config: ParserConfig | None  # None: calls are not parsed
    reasoning: tuple[str, PromptState] | None
    named: bool  # a named tool choice: the reply ends with "stop", not "tool_calls"
    tools_constrain: bool = False  # the constraint comes from the tools (their schemas compile into it)

    def new_choice(self) -> ChoiceParser:
        hidden = HiddenText(self.hidden) if self.hidden else None
        reasoning = ReasoningParser(*self.reasoning) if self.reasoning is not None else None
        tools = None
        if self.parser_config is not None and self.tool_format is not None:
            tools = self.tool_format.new_parser(self.parser_config)
        return ChoiceParser(hidden, reasoning, tools)


def plan_reply(
    body: ChatCompletionRequest, settings: ChatSettings, state: PromptState, skip_special_tokens: bool
) -> ReplyPlan:
    """ParamError for a tool choice this server cannot enforce."""
    mode = body.tool_mode()
    fmt = settings.tool_format
    user = body.structured_outputs_requested()
    reasoning = settings.reasoning_parser
    think = think_span(reasoning, state) if reasoning is not None else None
    tools = [
        ToolSchema(t.function.name, t.function.parameters, bool(t.function.strict)) for t in body.tools or ()
    ]
    parallel = body.parallel_tool_calls is not False
    names = frozenset(t.name for t in tools)
    structured = user
    constrained: frozenset[str] = frozenset()
    from_tools = False
    if mode in ("required", "named"):
        if fmt is None:
            raise ParamError(
                f"tool_choice {'required' if mode == 'required' else 'naming a tool'} needs to know how this "
                "model writes calls, and no tool call parser knows its chat template (start the server "
                "with --tool-call-parser)",
                "tool_choice",
            )
        name = body.tool_choice.function.name if isinstance(body.tool_choice, NamedToolChoice) else None
        structured = tool_call_constraint(fmt.syntax, tools, mode, name=name, parallel=parallel, think=think)
        constrained = frozenset([name]) if name is not None else names
        from_tools = True
    elif mode == "auto" and fmt is not None and user is None:
        structured = tool_call_constraint(fmt.syntax, tools, "auto", parallel=parallel, think=think)
        if structured is not None:
            all_calls = not parallel or fmt.syntax.marker is not None
            constrained = names if all_calls else frozenset(t.name for t in tools if t.strict)
            from_tools = True
    elif user is not None and think is not None:
        structured = answer_after_thinking(user, think)
    parse_calls = mode != "none" and fmt is not None
    hidden = settings.hidden_specials(skip_special_tokens, tools=parse_calls, reasoning=reasoning is not None)
    return ReplyPlan(
        structured=structured,
        hidden=hidden,
        tool_format=fmt,
        parser_config=ParserConfig({t.name: t.parameters for t in tools}, constrained)
        if parse_calls
        else None,
        reasoning=(reasoning, state) if reasoning is not None else None,
        named=mode == "named",
        tools_constrain=from_tools,
    )
