"""`pagoda bench sweep`: the serving benchmark over several request rates or concurrencies, for one or more
endpoints, and a latency–throughput chart that puts the endpoints side by side."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from pagoda.bench.datasets import BenchRequest
from pagoda.bench.serve import BenchmarkResult, ServeConfig, run_benchmark, write_json

SWEEP_PARAMETERS = ("request_rate", "max_concurrency")
# (title, SweepPoint attribute) of each panel; every panel plots against output throughput.
_PANELS = (
    ("TTFT p50 (ms)", "ttft_p50_ms"),
    ("TTFT p99 (ms)", "ttft_p99_ms"),
    ("TPOT p50 (ms)", "tpot_p50_ms"),
)


@dataclass(frozen=True)
class SweepPoint:
    """One benchmark run of a sweep: which endpoint, which setting, and the figures the chart shows."""

    label: str
    parameter: str
    value: float
    completed: int
    failed: int
    request_throughput: float
    output_throughput: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    result_file: str | None = None

    @classmethod
    def from_result(
        cls, label: str, parameter: str, value: float, result: BenchmarkResult, result_file: str | None = None
    ) -> SweepPoint:
        s = result.summary
        return cls(
            label=label,
            parameter=parameter,
            value=value,
            completed=s.completed,
            failed=s.failed,
            request_throughput=s.request_throughput,
            output_throughput=s.output_throughput,
            ttft_p50_ms=s.ttft_ms["median"],
            ttft_p99_ms=s.ttft_ms["p99"],
            tpot_p50_ms=s.tpot_ms["median"],
            result_file=result_file,
        )


def _value_text(value: float) -> str:
    return "inf" if math.isinf(value) else f"{value:g}"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "endpoint"


def run_sweep(
    endpoints: Sequence[tuple[str, ServeConfig]],
    parameter: str,
    values: Sequence[float],
    requests: Sequence[BenchRequest],
    tokenizer: Any | None = None,
    *,
    output_dir: str | Path | None = None,
    dataset: dict | None = None,
    tokenizer_name: str | None = None,
    log: Callable[[str], None] | None = None,
) -> list[SweepPoint]:
    """Run the benchmark for each (label, config) endpoint at each value of `parameter`, in order.

    With output_dir, each run's full result goes to its own JSON file there, and the points to sweep.json.
    """
    if parameter not in SWEEP_PARAMETERS:
        raise ValueError(f"parameter must be one of {', '.join(SWEEP_PARAMETERS)}, got {parameter!r}")
    if not endpoints:
        raise ValueError("a sweep needs at least one endpoint")
    if not values:
        raise ValueError("a sweep needs at least one value")
    labels = [label for label, _ in endpoints]
    if len(set(labels)) != len(labels):
        raise ValueError(f"endpoint labels must be distinct, got {labels}")
    if len(set(values)) != len(values):
        raise ValueError(f"sweep values must be distinct, got {list(values)}")
    # Validate every configuration before the first (possibly long) run.
    runs = [
        (label, value, replace(config, **{parameter: value}))
        for label, config in endpoints
        for value in values
    ]
    out = None if output_dir is None else Path(output_dir)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    points = []
    for label, value, config in runs:
        result = run_benchmark(config, requests, tokenizer, dataset=dataset, tokenizer_name=tokenizer_name)
        result_file = None
        if out is not None:
            path = out / f"{_slug(label)}_{parameter}_{_value_text(value)}.json"
            data = result.to_dict()
            data["sweep"] = {"label": label, "parameter": parameter, "value": value}
            write_json(data, path)
            result_file = str(path)
        point = SweepPoint.from_result(label, parameter, value, result, result_file)
        points.append(point)
        if log is not None:
            log(
                f"{label} {parameter}={_value_text(value)}: {point.completed} ok, {point.failed} failed, "
                f"{point.output_throughput:.1f} output tok/s, TTFT p50 {_ms(point.ttft_p50_ms)}, "
                f"TPOT p50 {_ms(point.tpot_p50_ms)}"
            )
    if out is not None:
        write_json({"parameter": parameter, "points": [asdict(p) for p in points]}, out / "sweep.json")
    return points


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f} ms"


def plot_sweep(points: Sequence[SweepPoint], path: str | Path, title: str | None = None) -> None:
    """Draw TTFT p50, TTFT p99 and TPOT p50 against output throughput as a PNG, one line per endpoint label,
    each point marked with its request rate or concurrency."""
    if not points:
        raise ValueError("no sweep points to plot")
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(
            "the sweep chart needs matplotlib: pip install matplotlib (or pagoda[plot])"
        ) from exc

    parameter = points[0].parameter
    series: dict[str, list[SweepPoint]] = {}
    for point in points:
        series.setdefault(point.label, []).append(point)
    figure = Figure(figsize=(6 * len(_PANELS), 4.8), layout="constrained")
    axes = figure.subplots(1, len(_PANELS))
    for ax, (panel_title, attribute) in zip(axes, _PANELS, strict=True):
        for label, line in series.items():
            xs = [p.output_throughput for p in line]
            ys = [math.nan if getattr(p, attribute) is None else getattr(p, attribute) for p in line]
            ax.plot(xs, ys, marker="o", label=label)
            for x, y, p in zip(xs, ys, line, strict=True):
                if not math.isnan(y):
                    ax.annotate(
                        _value_text(p.value), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7
                    )
        ax.set_title(panel_title)
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel("ms")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    figure.suptitle(
        title or f"pagoda bench sweep over {parameter.replace('_', ' ')} (points labelled by value)"
    )
    figure.savefig(path, dpi=110, format="png")
