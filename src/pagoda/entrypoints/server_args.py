"""What `pagoda serve` sets beyond the engine: the HTTP server and its front end, declared once.

To add a server option: add a field to `ServerArgs` with `arg(default, help=...)` and validate it
in `__post_init__`. `pagoda serve` gets the flag `--field-name`; the value reaches the app as
`ServerArgs` (`run_server`, `build_state`), and replicas started by `--replicas` inherit it unless
it is listed in `serve_cli._ROUTER_OWNED`. Stdlib only, so that building the CLI stays fast.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from pagoda.cli_args import arg
from pagoda.limits import DEFAULT_KEEP_ALIVE_S, DEFAULT_MAX_BODY_SIZE

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
# By vLLM's names; kept equal to the parsers of openai/tool_parsers and openai/reasoning (a test
# checks it) without importing them here. "none": off.
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "qwen3_xml", "none")
REASONING_PARSERS = ("qwen3", "deepseek_r1", "none")


@dataclass(frozen=True)
class ServerArgs:
    host: str = arg("127.0.0.1", help="address to listen on")
    port: int = arg(8000, help="port to listen on")
    api_key: str | None = arg(
        None,
        help="require 'Authorization: Bearer KEY' on every endpoint but /health",
        default_text="$PAGODA_API_KEY",
    )
    served_model_name: str | None = arg(None, help="model name clients use", default_text="MODEL")
    max_waiting_requests: int | None = arg(
        None, help="answer 503 while this many requests wait to be scheduled", default_text="no limit"
    )
    shutdown_timeout: float = arg(
        30.0, help="seconds in-flight requests may run on after SIGINT/SIGTERM before they are aborted"
    )
    # uvicorn also knows "trace"; the flag offers the levels both it and logging know.
    log_level: str = arg("info", help="log level", choices=LOG_LEVELS)
    replicas: int | None = arg(
        None,
        help="start N engine processes on ports PORT+1.. and a router on PORT in front of them",
        default_text="one engine in this process",
    )
    max_body_size: int = arg(
        DEFAULT_MAX_BODY_SIZE, help="largest request body in bytes; larger ones get a 413", metavar="BYTES"
    )
    timeout_keep_alive: float = arg(
        DEFAULT_KEEP_ALIVE_S,
        help="seconds an idle HTTP connection stays open (above clients' pool expiry, e.g. httpx's 5 s)",
        metavar="SECONDS",
    )
    # Chat replies.
    tool_call_parser: str | None = arg(
        None,
        help="how the model writes tool calls (none: calls are not parsed)",
        choices=TOOL_CALL_PARSERS,
        default_text="chosen from the chat template",
    )
    enable_auto_tool_choice: bool = arg(
        False,
        help="accepted for vLLM command lines; pagoda always serves tool_choice auto when it parses calls",
    )
    reasoning_parser: str | None = arg(
        None,
        help="split <think> reasoning into reasoning_content",
        choices=REASONING_PARSERS,
        default_text="when the chat template has <think>",
    )
    default_chat_template_kwargs: dict[str, Any] = arg(
        default_factory=dict,
        metavar="JSON",
        help="chat template variables for every request, e.g. '{\"enable_thinking\": false}' "
        "(a request's chat_template_kwargs win)",
    )

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be an integer in [0, 65535], got {self.port!r}")
        if self.max_waiting_requests is not None and (
            not isinstance(self.max_waiting_requests, int) or self.max_waiting_requests < 1
        ):
            raise ValueError(
                f"max_waiting_requests must be an integer >= 1, got {self.max_waiting_requests!r}"
            )
        if isinstance(self.timeout_keep_alive, bool) or not (
            isinstance(self.timeout_keep_alive, int | float) and 0 < self.timeout_keep_alive < float("inf")
        ):
            raise ValueError(
                f"timeout_keep_alive must be a number of seconds > 0, got {self.timeout_keep_alive!r}"
            )
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("served_model_name must not be empty")
        if self.log_level not in (*LOG_LEVELS, "trace"):
            raise ValueError(f"unknown log level {self.log_level!r}")
        if self.replicas is not None and (not isinstance(self.replicas, int) or self.replicas < 1):
            raise ValueError(f"replicas must be an integer >= 1, got {self.replicas!r}")
        if (
            isinstance(self.max_body_size, bool)
            or not isinstance(self.max_body_size, int)
            or self.max_body_size < 1
        ):
            raise ValueError(f"max_body_size must be an integer >= 1 (bytes), got {self.max_body_size!r}")
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise ValueError(
                f"unknown tool call parser {self.tool_call_parser!r}; choose one of {', '.join(TOOL_CALL_PARSERS)}"
            )
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(
                f"unknown reasoning parser {self.reasoning_parser!r}; choose one of {', '.join(REASONING_PARSERS)}"
            )
        if not isinstance(self.default_chat_template_kwargs, dict):
            raise ValueError("default_chat_template_kwargs must be a JSON object")

    def resolved_api_key(self) -> str | None:
        return self.api_key or os.environ.get("PAGODA_API_KEY") or None
