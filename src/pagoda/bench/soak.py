"""`pagoda bench soak`: an abort soak against any OpenAI-compatible server.

Rounds of requests, `--concurrency` at a time: streams cut at random points (before the response,
right after its headers, i.e. during prefill, or after a few tokens), interleaved with complete
requests, streamed ones, n > 1, structured output (a few fixed schemas) and prefix-sharing ones.
After every round the server must be idle: no request running or waiting and no KV block held
(vLLM's metric names, which pagoda serves). At the end the resident memory (the server's
`process_resident_memory_bytes`) may have grown by at most `--max-memory-growth` between the
second round and the last, and a greedy request must give the same text as before the soak.
Exits non-zero when a check fails; `--result-file` keeps the figures as JSON.
"""

from __future__ import annotations

# Only the standard library's light modules at import time: `pagoda --help` registers this command.
import argparse
import contextlib
import json
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from pagoda.cli_args import add_arguments, arg, values_from

KINDS = {  # kind -> weight in the mix
    "abort_before_response": 2,
    "abort_in_prefill": 2,
    "abort_in_decode": 3,
    "complete": 1,
    "stream": 1,
    "n_samples": 1,
    "structured": 1,
    "shared_prefix": 1,
}
ABORTS = ("abort_before_response", "abort_in_prefill", "abort_in_decode")
_SCHEMAS = (
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name"],
    },
    {"type": "array", "items": {"type": "number"}, "maxItems": 4},
    {"enum": ["red", "green", "blue"]},
)
_WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "wise",
    "owls",
    "watch",
    "from",
    "old",
    "trees",
]
_REFERENCE_PROMPT = "The soak reference prompt: count slowly from one to ten and then"


@dataclass(frozen=True)
class SoakConfig:
    """What the soak does; the fields with help text are the flags of `pagoda bench soak`."""

    base_url: str = arg(help="the server, e.g. http://127.0.0.1:8000")
    model: str | None = arg(None, help="model name", default_text="the first one /v1/models lists")
    api_key: str | None = arg(
        None, help="sent as 'Authorization: Bearer KEY'", default_text="$PAGODA_API_KEY"
    )
    num_requests: int = arg(1000, help="requests in all")
    rounds: int = arg(10, help="rounds they are split into")
    concurrency: int = arg(16, help="requests in flight")
    max_tokens: int = arg(24, help="max_tokens of each request")
    # At most: fewer if the server's context is shorter (see _fit).
    prompt_words: int = arg(200, help="words per prompt")
    seed: int = arg(0, help="seed of the request mix (kinds, and where aborts fall)")
    max_memory_growth: float = arg(
        0.05, help="allowed growth of resident memory between the second round and the last"
    )
    idle_timeout_s: float = 60.0
    request_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        for name in ("num_requests", "rounds", "concurrency", "max_tokens", "prompt_words"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.num_requests < self.rounds:
            raise ValueError(f"num_requests ({self.num_requests}) must be at least rounds ({self.rounds})")
        if not self.max_memory_growth >= 0:
            raise ValueError(f"max_memory_growth must be >= 0, got {self.max_memory_growth}")


@dataclass
class RoundResult:
    index: int
    outcomes: dict[str, int]  # "kind:outcome" -> count
    seconds: float
    resident_memory_bytes: float | None
    running: float
    waiting: float
    kv_cache_usage: float


@dataclass
class SoakResult:
    config: dict[str, Any]
    rounds: list[RoundResult] = field(default_factory=list)
    reference_text: str = ""
    final_text: str = ""
    memory_growth: float | None = None  # between the second round and the last
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


async def run_soak(config: SoakConfig) -> SoakResult:
    import asyncio

    from pagoda import http_client

    result = SoakResult(config={k: v for k, v in asdict(config).items() if k != "api_key"})
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    async with http_client.async_client(
        max_connections=config.concurrency * 2,
        base_url=config.base_url.rstrip("/"),
        headers=headers,
        timeout=config.request_timeout_s,
    ) as client:
        model = config.model or (await client.get("/v1/models")).raise_for_status().json()["data"][0]["id"]
        config = await _fit(client, model, config)
        result.config["prompt_words"] = config.prompt_words
        result.reference_text = await _greedy_text(client, model, config)
        rng = random.Random(config.seed)
        kinds, weights = list(KINDS), list(KINDS.values())
        per_round = [config.num_requests // config.rounds] * config.rounds
        per_round[-1] += config.num_requests - sum(per_round)
        semaphore = asyncio.Semaphore(config.concurrency)

        async def one(kind: str, draw: float, i: int) -> str:
            async with semaphore:
                return await _request(client, model, config, kind, draw, i)

        for index, count in enumerate(per_round):
            started = time.perf_counter()
            plan = [(rng.choices(kinds, weights)[0], rng.random()) for _ in range(count)]
            outcomes = await asyncio.gather(
                *(one(k, d, index * 100_000 + i) for i, (k, d) in enumerate(plan))
            )
            counts = Counter(f"{kind}:{outcome}" for (kind, _), outcome in zip(plan, outcomes, strict=True))
            metrics = await _wait_idle(client, config.idle_timeout_s)
            result.rounds.append(
                RoundResult(
                    index=index,
                    outcomes=dict(sorted(counts.items())),
                    seconds=time.perf_counter() - started,
                    resident_memory_bytes=metrics.get("process_resident_memory_bytes"),
                    running=metrics.get("vllm:num_requests_running", 0.0),
                    waiting=metrics.get("vllm:num_requests_waiting", 0.0),
                    kv_cache_usage=metrics.get("vllm:kv_cache_usage_perc", 0.0),
                )
            )
            for key, n in counts.items():
                if key.split(":", 1)[1] not in ("ok", "aborted"):
                    result.problems.append(f"round {index}: {n} x {key}")
        result.final_text = await _greedy_text(client, model, config)
    _judge(result, config)
    return result


def _judge(result: SoakResult, config: SoakConfig) -> None:
    last = result.rounds[-1]
    if last.running or last.waiting or last.kv_cache_usage:
        result.problems.append(
            f"not idle after the soak: running={last.running} waiting={last.waiting} "
            f"kv_cache_usage={last.kv_cache_usage}"
        )
    if result.final_text != result.reference_text:
        result.problems.append(
            f"the greedy output changed: {result.reference_text!r} before, {result.final_text!r} after"
        )
    rss = [r.resident_memory_bytes for r in result.rounds]
    if len(rss) >= 2 and rss[1] and rss[-1]:
        result.memory_growth = rss[-1] / rss[1] - 1.0
        if result.memory_growth > config.max_memory_growth:
            result.problems.append(
                f"resident memory grew by {result.memory_growth:.1%} between the second round and the last "
                f"({rss[1] / 2**20:.1f} -> {rss[-1] / 2**20:.1f} MiB; allowed {config.max_memory_growth:.0%})"
            )


# ---- one request ------------------------------------------------------------------------------------
async def _request(client: Any, model: str, config: SoakConfig, kind: str, draw: float, i: int) -> str:
    """Send one request of `kind`; returns "ok", "aborted", or what went wrong."""
    import asyncio

    import httpx

    rng = random.Random(i)
    body: dict[str, Any] = {"model": model, "max_tokens": config.max_tokens, "prompt": _prompt(rng, config)}
    path = "/v1/completions"
    if kind == "n_samples":
        body.update(n=rng.choice((2, 3)), temperature=1.0, seed=i)
    elif kind == "structured":
        schema = _SCHEMAS[i % len(_SCHEMAS)]
        path = "/v1/chat/completions"
        body.pop("prompt")
        body.update(
            messages=[{"role": "user", "content": "Answer in JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
            max_tokens=config.max_tokens * 2,
        )
    elif kind == "shared_prefix":
        body["prompt"] = _shared_prefix(config) + " " + " ".join(rng.choices(_WORDS, k=8))
    if kind in ABORTS and rng.random() < 0.3:  # some aborted streams are chats
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
    streamed = kind in (*ABORTS, "stream", "shared_prefix")
    if streamed:
        body["stream"] = True
    try:
        if kind == "abort_before_response":
            task = asyncio.ensure_future(client.post(path, json=body))
            await asyncio.sleep(draw * 0.02)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                response = await task
                return "ok" if response.status_code == 200 else f"status {response.status_code}"
            return "aborted"
        if not streamed:
            response = await client.post(path, json=body)
            if response.status_code != 200:
                return f"status {response.status_code}"
            return "ok" if response.json().get("choices") else "no choices"
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return f"status {response.status_code}"
            if kind == "abort_in_prefill":
                return "aborted"  # the headers come before the first token is computed
            cut = 1 + int(draw * config.max_tokens // 2) if kind == "abort_in_decode" else None
            events = 0
            last = ""
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                events += 1
                last = line[6:]
                if cut is not None and events >= cut:
                    return "aborted"
                if last != "[DONE]" and '"error"' in last and json.loads(last).get("error"):
                    return "error event"
            return "ok" if last == "[DONE]" else "stream ended without [DONE]"
    except httpx.HTTPError as exc:
        return f"transport error {type(exc).__name__}"


async def _fit(client: Any, model: str, config: SoakConfig) -> SoakConfig:
    """Halve prompt_words until the longest prompt and max_tokens fit the server's context (long
    prompts keep prefill long enough to be cut in the middle)."""
    import dataclasses

    while True:
        prompt = _shared_prefix(config) + " " + " ".join(["lazy"] * 8)
        body = {"model": model, "prompt": prompt, "max_tokens": 2 * config.max_tokens, "temperature": 0}
        response = await client.post("/v1/completions", json={**body, "max_tokens": 2 * config.max_tokens})
        if response.status_code == 200:
            return config
        if response.status_code != 400 or config.prompt_words == 1:
            raise ValueError(
                f"the server refuses a soak request: {response.status_code} {response.text[:300]}"
            )
        config = dataclasses.replace(config, prompt_words=config.prompt_words // 2)


def _prompt(rng: random.Random, config: SoakConfig) -> str:
    return " ".join(rng.choices(_WORDS, k=config.prompt_words))


def _shared_prefix(config: SoakConfig) -> str:
    return "A system prompt that every prefix-sharing request of the soak begins with. " + " ".join(
        random.Random(7).choices(_WORDS, k=config.prompt_words)
    )


async def _greedy_text(client: Any, model: str, config: SoakConfig) -> str:
    body = {"model": model, "prompt": _REFERENCE_PROMPT, "max_tokens": config.max_tokens, "temperature": 0}
    response = (await client.post("/v1/completions", json=body)).raise_for_status()
    return response.json()["choices"][0]["text"]


async def _wait_idle(client: Any, timeout_s: float) -> dict[str, float]:
    """The /metrics sample once nothing runs or waits and no KV block is held (or at the timeout)."""
    import asyncio

    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + timeout_s
    while True:
        values: dict[str, float] = {}
        text = (await client.get("/metrics")).raise_for_status().text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
        idle = not any(values.get(k) for k in ("vllm:num_requests_running", "vllm:num_requests_waiting"))
        if (idle and not values.get("vllm:kv_cache_usage_perc")) or time.monotonic() > deadline:
            return values
        await asyncio.sleep(0.1)


# ---- the command ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SoakOutput:
    result_file: str | None = arg(None, help="write the rounds and checks as JSON here")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "soak",
        help="abort soak against a running server: nothing may be left running, held or leaked",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p, SoakConfig)
    add_arguments(p, SoakOutput)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import asyncio
    import os

    import httpx

    try:
        api_key = args.api_key or os.environ.get("PAGODA_API_KEY")
        config = SoakConfig(**values_from(SoakConfig, args, api_key=api_key))
        result = asyncio.run(run_soak(config))
    except ValueError as exc:
        print(f"pagoda bench soak: error: {exc}", file=sys.stderr)
        return 2
    except (OSError, httpx.HTTPError) as exc:
        print(f"pagoda bench soak: error: {args.base_url}: {exc}", file=sys.stderr)
        return 2
    for r in result.rounds:
        rss = f"{r.resident_memory_bytes / 2**20:.1f} MiB" if r.resident_memory_bytes else "n/a"
        print(f"round {r.index}: {sum(r.outcomes.values())} requests in {r.seconds:.1f}s, resident {rss}")
    if result.memory_growth is not None:
        print(f"resident memory growth, second round to last: {result.memory_growth:+.2%}")
    if args.result_file:
        from pagoda.bench.serve import write_json

        write_json(result.to_dict(), args.result_file)
    for problem in result.problems:
        print(f"FAIL: {problem}", file=sys.stderr)
    print("soak passed" if result.ok else "soak FAILED")
    return 0 if result.ok else 1
