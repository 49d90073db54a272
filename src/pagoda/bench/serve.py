"""Serving benchmark: stream requests to an OpenAI-compatible endpoint on a Poisson (or gamma) schedule.

Each request's clock starts when it is sent, after it gets a concurrency slot: time spent waiting for a slot
is the client's, not the server's, and is not counted as latency.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import math
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np

from pagoda import http_client
from pagoda.bench.datasets import BenchRequest
from pagoda.bench.metrics import (
    SLO_METRICS,
    RequestResult,
    Summary,
    format_summary,
    summarize,
    timeline_metrics,
)

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
_MAX_ERROR_CHARS = 300


def normalize_base_url(base_url: str) -> str:
    """'http://host:port', with any trailing slash or '/v1' removed; ValueError if it is not an http(s) URL."""
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"base URL must look like http://host:port, got {base_url!r}")
    url = base_url.rstrip("/")
    return url.removesuffix("/v1")


@dataclass(frozen=True)
class ServeConfig:
    """How to drive one endpoint. request_rate is requests/s (math.inf sends everything at once); for
    multi-turn datasets it is the rate at which conversations start."""

    base_url: str
    model: str
    endpoint: str = "completions"
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    temperature: float = 0.0
    ignore_eos: bool = False
    api_key: str | None = field(default=None, repr=False)
    slos_ms: dict[str, float] = field(default_factory=dict)
    request_timeout_s: float = 600.0  # to connect, or between two reads of the stream
    show_progress: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "base_url", normalize_base_url(self.base_url))
        if not self.model:
            raise ValueError("model must be a non-empty name")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        if math.isnan(self.request_rate) or self.request_rate <= 0:
            raise ValueError(f"request_rate must be > 0 (or inf), got {self.request_rate}")
        if not math.isfinite(self.burstiness) or self.burstiness <= 0:
            raise ValueError(f"burstiness must be a finite number > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        for name, limit in self.slos_ms.items():
            if name not in SLO_METRICS or not limit > 0:
                raise ValueError(
                    f"bad SLO {name}:{limit}; metrics are {', '.join(SLO_METRICS)}, limits > 0 ms"
                )

    @property
    def url(self) -> str:
        return self.base_url + ENDPOINTS[self.endpoint]

    def to_dict(self) -> dict:
        data = {k: v for k, v in self.__dict__.items() if k != "api_key"}
        data["api_key_set"] = self.api_key is not None
        data["url"] = self.url
        return data


def arrival_times(num: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times (s from the start) of num requests: the first at 0, then gamma-distributed gaps with mean
    1 / request_rate and shape `burstiness` (1 is a Poisson process; below 1 burstier, above 1 steadier)."""
    if num < 0:
        raise ValueError(f"num must be >= 0, got {num}")
    if math.isnan(request_rate) or request_rate <= 0:
        raise ValueError(f"request_rate must be > 0 (or inf), got {request_rate}")
    if not math.isfinite(burstiness) or burstiness <= 0:
        raise ValueError(f"burstiness must be a finite number > 0, got {burstiness}")
    if num == 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * num
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (request_rate * burstiness), size=num - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def resolve_model(base_url: str, api_key: str | None = None, timeout_s: float = 30.0) -> str:
    """The first model the endpoint lists at /v1/models."""
    url = normalize_base_url(base_url) + "/v1/models"
    try:
        response = httpx.get(url, headers=_headers(api_key), timeout=timeout_s, trust_env=False)
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise ValueError(f"could not find a model name at {url} ({exc}); pass --model") from exc


def _headers(api_key: str | None) -> dict[str, str]:
    return {} if api_key is None else {"Authorization": f"Bearer {api_key}"}


def _shorten(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MAX_ERROR_CHARS else text[:_MAX_ERROR_CHARS] + "..."


class _ProtocolError(Exception):
    """The server's event stream broke the OpenAI streaming format, or reported an error inside it."""


@dataclass
class _Outcome:
    """What one HTTP request produced, before token counting."""

    start: float
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    answer: str = ""  # the content, resent as history in multi-turn
    generated: str = ""  # content and reasoning content: every generated token's text
    usage: dict | None = None
    error: str | None = None


def _chunk_text(chunk: Any, endpoint: str) -> tuple[str, str]:
    """(content, reasoning content) carried by one parsed stream chunk."""
    if not isinstance(chunk, dict):
        raise _ProtocolError(f"stream chunk is not a JSON object: {_shorten(str(chunk))}")
    if chunk.get("error") is not None:
        raise _ProtocolError(f"error in stream: {_shorten(json.dumps(chunk['error']))}")
    choices = chunk.get("choices")
    if not isinstance(choices, list):
        raise _ProtocolError(f"stream chunk without a 'choices' list: {_shorten(json.dumps(chunk))}")
    content, reasoning = "", ""
    for choice in choices:
        if not isinstance(choice, dict):
            raise _ProtocolError(f"stream choice is not a JSON object: {_shorten(json.dumps(choice))}")
        if endpoint == "completions":
            content += choice.get("text") or ""
        else:
            delta = choice.get("delta") or {}
            content += delta.get("content") or ""
            reasoning += delta.get("reasoning_content") or ""
    return content, reasoning


async def _post_streaming(
    client: httpx.AsyncClient, config: ServeConfig, payload: dict, headers: dict[str, str]
) -> _Outcome:
    outcome = _Outcome(start=time.perf_counter())
    try:
        async with client.stream("POST", config.url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", errors="replace")
                raise _ProtocolError(f"HTTP {response.status_code}: {_shorten(body)}")
            finished = False
            async for line in response.aiter_lines():
                now = time.perf_counter()
                if not line or line.startswith(":"):
                    continue
                if not line.startswith("data:"):
                    raise _ProtocolError(f"unexpected line in the event stream: {_shorten(line)}")
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    finished = True
                    break
                chunk = json.loads(data)
                content, reasoning = _chunk_text(chunk, config.endpoint)
                if content or reasoning:
                    outcome.chunk_times.append(now)
                    outcome.answer += content
                    outcome.generated += reasoning + content
                if isinstance(chunk.get("usage"), dict):
                    outcome.usage = chunk["usage"]
            if not finished:
                raise _ProtocolError("stream ended before 'data: [DONE]'")
    except _ProtocolError as exc:
        outcome.error = str(exc)
    except json.JSONDecodeError as exc:
        outcome.error = f"stream chunk is not valid JSON: {exc}"
    except httpx.HTTPError as exc:
        outcome.error = f"{type(exc).__name__}: {_shorten(str(exc)) or 'no detail'}"
    outcome.end = time.perf_counter()
    return outcome


def _payload(config: ServeConfig, request: BenchRequest, history: Sequence[tuple[str, str]]) -> dict:
    payload: dict[str, Any] = {
        "model": config.model,
        "max_tokens": request.output_len,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.endpoint == "completions":
        payload["prompt"] = request.completion_prompt(history)
    else:
        payload["messages"] = request.chat_messages(history)
    if config.ignore_eos:
        payload["ignore_eos"] = True
    return payload


def _count_tokens(
    outcome: _Outcome, payload: dict, tokenizer: Any | None
) -> tuple[int | None, int | None, str | None]:
    """(prompt tokens, output tokens, where they come from): the server's usage, else the tokenizer, else
    the number of content chunks (and no prompt count)."""
    usage = outcome.usage or {}
    completion_tokens, prompt_tokens = usage.get("completion_tokens"), usage.get("prompt_tokens")
    if isinstance(completion_tokens, int):
        return (prompt_tokens if isinstance(prompt_tokens, int) else None), completion_tokens, "usage"
    if tokenizer is not None:
        output = len(tokenizer.encode(outcome.generated, add_special_tokens=False))
        if "prompt" in payload:  # with special tokens, as a server tokenizes a completions prompt
            prompt = len(tokenizer.encode(payload["prompt"]))
        elif getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(
                payload["messages"], tokenize=False, add_generation_prompt=True
            )
            prompt = len(tokenizer.encode(text, add_special_tokens=False))
        else:
            prompt = sum(
                len(tokenizer.encode(m["content"], add_special_tokens=False)) for m in payload["messages"]
            )
        return prompt, output, "tokenizer"
    return None, len(outcome.chunk_times), "chunks"


@dataclass(frozen=True)
class BenchmarkResult:
    config: ServeConfig
    started_at: str
    results: tuple[RequestResult, ...]
    summary: Summary
    environment: dict
    dataset: dict = field(default_factory=dict)
    tokenizer: str | None = None

    def to_dict(self) -> dict:
        return {
            "started_at": self.started_at,
            "config": self.config.to_dict(),
            "dataset": self.dataset,
            "tokenizer": self.tokenizer,
            "environment": self.environment,
            "summary": self.summary.to_dict(),
            "requests": [r.to_dict() for r in self.results],
        }

    def format_table(self) -> str:
        c = self.config
        info = [
            ("Endpoint", c.url),
            ("Model", c.model),
            ("Request rate (req/s)", "inf" if math.isinf(c.request_rate) else f"{c.request_rate:g}"),
            ("Burstiness", f"{c.burstiness:g}"),
            ("Max concurrency", "unlimited" if c.max_concurrency is None else str(c.max_concurrency)),
        ]
        return format_summary(self.summary, info)


def collect_environment() -> dict:
    """Where the client ran (the server's own environment is not visible from here)."""
    try:
        pagoda_version = metadata.version("pagoda")
    except metadata.PackageNotFoundError:
        pagoda_version = "unknown (not installed)"
    return {
        "pagoda": pagoda_version,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "httpx": httpx.__version__,
        "numpy": np.__version__,
    }


def _sessions(requests: Sequence[BenchRequest]) -> list[list[int]]:
    """Request indices grouped into sessions sent one after another: a multi-turn conversation in turn order,
    or a single request."""
    sessions: list[list[int]] = []
    conversations: dict[int, list[int]] = {}
    for i, request in enumerate(requests):
        if request.conversation_id is None:
            sessions.append([i])
        elif request.conversation_id not in conversations:
            conversations[request.conversation_id] = [i]
            sessions.append(conversations[request.conversation_id])
        else:
            conversations[request.conversation_id].append(i)
    for session in sessions:
        turns = [requests[i].turn_index for i in session]
        if turns != sorted(turns) or len(set(turns)) != len(turns):
            raise ValueError(
                f"conversation {requests[session[0]].conversation_id} has turns out of order: {turns}"
            )
    return sessions


async def run_benchmark_async(
    config: ServeConfig,
    requests: Sequence[BenchRequest],
    tokenizer: Any | None = None,
    *,
    dataset: dict | None = None,
    tokenizer_name: str | None = None,
) -> BenchmarkResult:
    """Send every request on the arrival schedule and measure each one. Failures are recorded, not dropped."""
    if not requests:
        raise ValueError("no requests to send")
    from tqdm import tqdm

    sessions = _sessions(requests)
    arrivals = arrival_times(len(sessions), config.request_rate, config.burstiness, config.seed)
    semaphore = asyncio.Semaphore(config.max_concurrency or len(requests))
    headers = _headers(config.api_key)
    outcomes: dict[int, tuple[float, _Outcome, dict]] = {}  # index -> (scheduled time, outcome, payload)
    started_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    progress = tqdm(total=len(requests), disable=not config.show_progress, desc="requests", unit="req")

    async def run_session(client: httpx.AsyncClient, session: list[int], scheduled: float) -> None:
        history: list[tuple[str, str]] = []
        broken: str | None = None
        for index in session:
            request = requests[index]
            payload = _payload(config, request, history)
            if broken is not None:
                now = time.perf_counter()
                outcomes[index] = (scheduled, _Outcome(start=now, end=now, error=broken), payload)
            else:
                async with semaphore:
                    outcome = await _post_streaming(client, config, payload, headers)
                outcomes[index] = (scheduled, outcome, payload)
                if outcome.error is not None:
                    broken = f"not sent: turn {request.turn_index} of its conversation failed"
                elif request.conversation_id is not None:
                    history.append((request.prompt, outcome.answer))
            progress.update(1)

    timeout = httpx.Timeout(config.request_timeout_s)
    async with http_client.async_client(max_connections=config.max_concurrency, timeout=timeout) as client:
        bench_start = time.perf_counter()
        tasks = []
        for session, scheduled in zip(sessions, arrivals, strict=True):
            delay = bench_start + scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(run_session(client, session, scheduled)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - bench_start
    progress.close()

    results = []
    for index, request in enumerate(requests):
        scheduled, outcome, payload = outcomes[index]
        common = {
            "index": index,
            "scheduled_s": scheduled,
            "start_s": outcome.start - bench_start,
            "expected_prompt_len": request.prompt_len,
            "expected_output_len": request.output_len,
            "group_id": request.group_id,
            "conversation_id": request.conversation_id,
            "turn_index": request.turn_index,
        }
        if outcome.error is not None:
            results.append(RequestResult(success=False, error=outcome.error, **common))
            continue
        ttft, itl, e2el = timeline_metrics(outcome.start, outcome.chunk_times, outcome.end)
        prompt_tokens, output_tokens, source = _count_tokens(outcome, payload, tokenizer)
        results.append(
            RequestResult(
                success=True,
                error=None,
                ttft_s=ttft,
                e2el_s=e2el,
                itl_s=itl,
                num_chunks=len(outcome.chunk_times),
                prompt_tokens=prompt_tokens,
                output_tokens=output_tokens,
                token_source=source,
                **common,
            )
        )
    return BenchmarkResult(
        config=config,
        started_at=started_at,
        results=tuple(results),
        summary=summarize(results, duration, config.slos_ms),
        environment=collect_environment(),
        dataset=dict(dataset or {}),
        tokenizer=tokenizer_name,
    )


def run_benchmark(
    config: ServeConfig,
    requests: Sequence[BenchRequest],
    tokenizer: Any | None = None,
    *,
    dataset: dict | None = None,
    tokenizer_name: str | None = None,
) -> BenchmarkResult:
    """Synchronous wrapper of run_benchmark_async (starts its own event loop)."""
    return asyncio.run(
        run_benchmark_async(config, requests, tokenizer, dataset=dataset, tokenizer_name=tokenizer_name)
    )


def _json_safe(value: Any) -> Any:
    """Non-finite floats as strings ('inf'), so the file is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def write_json(data: dict, path: str | os.PathLike) -> None:
    Path(path).write_text(json.dumps(_json_safe(data), indent=2, allow_nan=False) + "\n", encoding="utf-8")
