"""Serving-benchmark metrics: per-request figures, their summary and its table. Pure arithmetic, no I/O.

TTFT is the time to the first non-empty content chunk, ITL every gap between successive content chunks,
E2EL the time from sending the request to the end of its stream, and TPOT = (E2EL - TTFT) / (output tokens - 1).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from itertools import pairwise

import numpy as np

SLO_METRICS = ("ttft", "tpot", "e2el")
TOKEN_SOURCES = ("usage", "tokenizer", "chunks")
_TOKEN_SOURCE_WORDS = {
    "usage": "server usage",
    "tokenizer": "local tokenizer",
    "chunks": "streamed chunks (no usage, no tokenizer)",
}


@dataclass(frozen=True)
class RequestResult:
    """One request's figures. Times are seconds; scheduled_s / start_s count from the benchmark start."""

    index: int
    success: bool
    error: str | None
    scheduled_s: float
    start_s: float
    ttft_s: float | None = None
    e2el_s: float | None = None
    itl_s: tuple[float, ...] = ()
    num_chunks: int = 0
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    token_source: str | None = None
    expected_prompt_len: int | None = None
    expected_output_len: int | None = None
    group_id: int | None = None
    conversation_id: int | None = None
    turn_index: int = 0

    def __post_init__(self) -> None:
        if self.success == (self.error is not None):
            raise ValueError("a result has an error exactly when it did not succeed")
        if self.token_source is not None and self.token_source not in TOKEN_SOURCES:
            raise ValueError(f"token_source must be one of {TOKEN_SOURCES}, got {self.token_source!r}")

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None with fewer than two tokens or no first token."""
        if self.ttft_s is None or self.e2el_s is None or self.output_tokens is None or self.output_tokens < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["itl_s"] = list(self.itl_s)
        data["tpot_s"] = self.tpot_s
        return data


def timeline_metrics(
    start: float, chunk_times: Sequence[float], end: float
) -> tuple[float | None, tuple[float, ...], float]:
    """(TTFT, ITLs, E2EL) from the send time, the arrival times of the content chunks and the stream end."""
    if any(later < earlier for earlier, later in pairwise([start, *chunk_times, end])):
        raise ValueError("timeline must be non-decreasing: start <= chunk times <= end")
    ttft = chunk_times[0] - start if chunk_times else None
    itl = tuple(b - a for a, b in pairwise(chunk_times))
    return ttft, itl, end - start


def distribution_ms(values_s: Sequence[float]) -> dict[str, float | int | None]:
    """mean / median / p90 / p99 in milliseconds (None when there are no values) and the count."""
    if len(values_s) == 0:
        return {"mean": None, "median": None, "p90": None, "p99": None, "count": 0}
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {
        "mean": float(ms.mean()),
        "median": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "count": len(ms),
    }


def parse_slos(specs: Sequence[str]) -> dict[str, float]:
    """Parse SLOs such as ["ttft:500", "tpot:50"] (milliseconds) into {"ttft": 500.0, "tpot": 50.0}."""
    slos: dict[str, float] = {}
    for spec in specs:
        name, sep, value = spec.partition(":")
        name = name.strip().lower()
        if not sep:
            raise ValueError(f"goodput SLO {spec!r} must look like METRIC:MILLISECONDS, e.g. ttft:500")
        if name not in SLO_METRICS:
            raise ValueError(f"goodput SLO {spec!r}: metric must be one of {', '.join(SLO_METRICS)}")
        if name in slos:
            raise ValueError(f"goodput SLO for {name} given twice")
        try:
            limit = float(value)
        except ValueError:
            raise ValueError(f"goodput SLO {spec!r}: {value!r} is not a number of milliseconds") from None
        if not math.isfinite(limit) or limit <= 0:
            raise ValueError(f"goodput SLO {spec!r}: the limit must be a positive number of milliseconds")
        slos[name] = limit
    return slos


def meets_slos(result: RequestResult, slos: dict[str, float]) -> bool:
    """Whether a request succeeded within every SLO (ms). A request of one token has no TPOT and meets it."""
    if not result.success:
        return False
    values = {"ttft": result.ttft_s, "tpot": result.tpot_s, "e2el": result.e2el_s}
    for name, limit_ms in slos.items():
        value = values[name]
        if value is None:
            if name == "tpot" and result.ttft_s is not None:
                continue
            return False
        if value * 1000.0 > limit_ms:
            return False
    return True


@dataclass(frozen=True)
class Summary:
    num_requests: int
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int | None
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float | None
    ttft_ms: dict
    tpot_ms: dict
    itl_ms: dict
    e2el_ms: dict
    token_count_sources: dict[str, int]
    errors: dict[str, int]
    slos_ms: dict[str, float] = field(default_factory=dict)
    good_requests: int | None = None
    goodput: float | None = None

    @property
    def token_count_source(self) -> str:
        """'usage', 'tokenizer' or 'chunks' when every completed request agrees, else 'mixed' (or 'none')."""
        if not self.token_count_sources:
            return "none"
        if len(self.token_count_sources) == 1:
            return next(iter(self.token_count_sources))
        return "mixed"

    def to_dict(self) -> dict:
        data = asdict(self)
        data["token_count_source"] = self.token_count_source
        return data


def summarize(
    results: Sequence[RequestResult], duration_s: float, slos: dict[str, float] | None = None
) -> Summary:
    """Aggregate per-request results over a run of duration_s seconds. Failed requests count, never vanish."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    slos = dict(slos or {})
    done = [r for r in results if r.success]
    input_counts = [r.prompt_tokens for r in done]
    total_input = (
        None if any(c is None for c in input_counts) else sum(c for c in input_counts if c is not None)
    )
    total_output = sum(r.output_tokens or 0 for r in done)
    good = sum(meets_slos(r, slos) for r in done) if slos else None
    return Summary(
        num_requests=len(results),
        completed=len(done),
        failed=len(results) - len(done),
        duration_s=duration_s,
        total_input_tokens=total_input,
        total_output_tokens=total_output,
        request_throughput=len(done) / duration_s,
        output_throughput=total_output / duration_s,
        total_token_throughput=None if total_input is None else (total_input + total_output) / duration_s,
        ttft_ms=distribution_ms([r.ttft_s for r in done if r.ttft_s is not None]),
        tpot_ms=distribution_ms([t for r in done if (t := r.tpot_s) is not None]),
        itl_ms=distribution_ms([gap for r in done for gap in r.itl_s]),
        e2el_ms=distribution_ms([r.e2el_s for r in done if r.e2el_s is not None]),
        token_count_sources=dict(Counter(r.token_source for r in done if r.token_source is not None)),
        errors=dict(Counter(r.error for r in results if r.error is not None).most_common()),
        slos_ms=slos,
        good_requests=good,
        goodput=None if good is None else good / duration_s,
    )


def _fmt(value: float | int | None, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, int):
        return str(value)
    return f"{value:.{digits}f}"


def format_summary(summary: Summary, info: Sequence[tuple[str, str]] = (), max_errors: int = 5) -> str:
    """A readable table of a summary, after the given (label, value) lines describing the run."""
    width = 44
    rows: list[tuple[str, str]] = [*info]
    rows += [
        ("Successful requests", str(summary.completed)),
        ("Failed requests", str(summary.failed)),
        ("Benchmark duration (s)", _fmt(summary.duration_s)),
        ("Total input tokens", _fmt(summary.total_input_tokens)),
        ("Total output tokens", _fmt(summary.total_output_tokens)),
    ]
    sources = ", ".join(
        f"{_TOKEN_SOURCE_WORDS[name]} ({count})" for name, count in summary.token_count_sources.items()
    )
    rows.append(("Token counts from", sources or "n/a"))
    rows += [
        ("Request throughput (req/s)", _fmt(summary.request_throughput)),
        ("Output token throughput (tok/s)", _fmt(summary.output_throughput)),
        ("Total token throughput (tok/s)", _fmt(summary.total_token_throughput)),
    ]
    if summary.slos_ms:
        slo_text = " ".join(f"{name}<={limit:g}ms" for name, limit in summary.slos_ms.items())
        rows.append((f"Goodput (req/s) [{slo_text}]", _fmt(summary.goodput)))
        rows.append(("Requests within SLOs", f"{summary.good_requests}/{summary.num_requests}"))
    lines = [" pagoda serving benchmark ".center(width + 20, "=")]
    lines += [f"{label + ':':<{width}}{value}" for label, value in rows]
    lines.append(" latency (ms) ".center(width + 20, "-"))
    lines.append(f"{'':<8}{'mean':>12}{'median':>12}{'p90':>12}{'p99':>12}{'count':>8}")
    for name, dist in (
        ("TTFT", summary.ttft_ms),
        ("TPOT", summary.tpot_ms),
        ("ITL", summary.itl_ms),
        ("E2E", summary.e2el_ms),
    ):
        stats = "".join(f"{_fmt(dist[key]):>12}" for key in ("mean", "median", "p90", "p99"))
        lines.append(f"{name:<8}{stats}{dist['count']:>8}")
    if summary.errors:
        lines.append(" errors ".center(width + 20, "-"))
        for message, count in list(summary.errors.items())[:max_errors]:
            lines.append(f"{count:>6} x {message}")
        if len(summary.errors) > max_errors:
            lines.append(f"  ... and {len(summary.errors) - max_errors} more kinds (see the result file)")
    lines.append("=" * (width + 20))
    return "\n".join(lines)
