"""Metric arithmetic of the serving benchmark on synthetic timelines, and its arrival process."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pagoda.bench.metrics import (
    RequestResult,
    distribution_ms,
    format_summary,
    meets_slos,
    parse_slos,
    summarize,
    timeline_metrics,
)
from pagoda.bench.serve import arrival_times


def ok(
    index: int,
    ttft: float,
    e2el: float,
    output_tokens: int,
    itl=(),
    prompt_tokens: int | None = 10,
    source="usage",
):
    return RequestResult(
        index=index,
        success=True,
        error=None,
        scheduled_s=0.0,
        start_s=0.0,
        ttft_s=ttft,
        e2el_s=e2el,
        itl_s=tuple(itl),
        num_chunks=len(itl) + 1,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        token_source=source,
    )


def failed(index: int, error: str = "HTTP 500: boom") -> RequestResult:
    return RequestResult(index=index, success=False, error=error, scheduled_s=0.0, start_s=0.0)


# --- timelines -------------------------------------------------------------------------------------------


def test_timeline_metrics_ttft_itl_e2el():
    ttft, itl, e2el = timeline_metrics(10.0, [10.25, 10.5, 11.0], 11.5)
    assert ttft == pytest.approx(0.25)
    assert itl == pytest.approx((0.25, 0.5))
    assert e2el == pytest.approx(1.5)


def test_timeline_without_chunks_has_no_ttft():
    assert timeline_metrics(1.0, [], 2.0) == (None, (), 1.0)


def test_timeline_must_be_ordered():
    with pytest.raises(ValueError, match="non-decreasing"):
        timeline_metrics(1.0, [1.5, 1.2], 2.0)
    with pytest.raises(ValueError, match="non-decreasing"):
        timeline_metrics(1.0, [1.5], 1.4)


def test_tpot_excludes_the_first_token():
    assert ok(0, ttft=0.1, e2el=1.1, output_tokens=11).tpot_s == pytest.approx(0.1)
    assert ok(0, ttft=0.1, e2el=0.1, output_tokens=1).tpot_s is None
    assert failed(0).tpot_s is None


def test_result_error_iff_failed():
    with pytest.raises(ValueError, match="error exactly when"):
        RequestResult(index=0, success=True, error="x", scheduled_s=0, start_s=0)
    with pytest.raises(ValueError, match="error exactly when"):
        RequestResult(index=0, success=False, error=None, scheduled_s=0, start_s=0)
    with pytest.raises(ValueError, match="token_source"):
        RequestResult(index=0, success=True, error=None, scheduled_s=0, start_s=0, token_source="guess")


# --- percentiles -------------------------------------------------------------------------------------------


def test_distribution_percentiles_in_ms():
    # 1..100 ms: linear interpolation puts p90 at 90 + 0.1 and p99 at 99 + 0.01.
    dist = distribution_ms([i / 1000 for i in range(1, 101)])
    assert dist["mean"] == pytest.approx(50.5)
    assert dist["median"] == pytest.approx(50.5)
    assert dist["p90"] == pytest.approx(90.1)
    assert dist["p99"] == pytest.approx(99.01)
    assert dist["count"] == 100


def test_distribution_of_nothing_is_none():
    assert distribution_ms([]) == {"mean": None, "median": None, "p90": None, "p99": None, "count": 0}


# --- summary -------------------------------------------------------------------------------------------------


def test_summarize_counts_failures_and_pools_itl():
    results = [
        ok(0, ttft=0.1, e2el=0.4, output_tokens=4, itl=(0.1, 0.1, 0.1), prompt_tokens=5),
        ok(1, ttft=0.2, e2el=0.8, output_tokens=4, itl=(0.2, 0.2, 0.2), prompt_tokens=7),
        failed(2),
        failed(3, "stream ended before 'data: [DONE]'"),
        failed(4),
    ]
    s = summarize(results, duration_s=2.0)
    assert (s.num_requests, s.completed, s.failed) == (5, 2, 3)
    assert s.total_input_tokens == 12
    assert s.total_output_tokens == 8
    assert s.request_throughput == pytest.approx(1.0)
    assert s.output_throughput == pytest.approx(4.0)
    assert s.total_token_throughput == pytest.approx(10.0)
    assert s.ttft_ms["mean"] == pytest.approx(150.0)
    assert s.tpot_ms["mean"] == pytest.approx(150.0)  # (0.3 / 3 + 0.6 / 3) / 2
    assert s.itl_ms["count"] == 6
    assert s.itl_ms["median"] == pytest.approx(150.0)
    assert s.e2el_ms["p90"] == pytest.approx(760.0)
    assert s.errors == {"HTTP 500: boom": 2, "stream ended before 'data: [DONE]'": 1}
    assert s.token_count_sources == {"usage": 2}
    assert s.token_count_source == "usage"
    assert s.goodput is None and s.good_requests is None


def test_summarize_unknown_prompt_counts_leave_input_totals_open():
    s = summarize(
        [ok(0, 0.1, 0.2, 2, (0.1,), prompt_tokens=None, source="chunks"), ok(1, 0.1, 0.2, 2, (0.1,))], 1.0
    )
    assert s.total_input_tokens is None
    assert s.total_token_throughput is None
    assert s.token_count_source == "mixed"
    assert s.to_dict()["token_count_source"] == "mixed"


def test_summarize_rejects_empty_duration():
    with pytest.raises(ValueError, match="duration_s"):
        summarize([], 0.0)


# --- goodput -------------------------------------------------------------------------------------------------


def test_parse_slos():
    assert parse_slos(["ttft:500", "TPOT:50", "e2el:2000.5"]) == {"ttft": 500.0, "tpot": 50.0, "e2el": 2000.5}
    assert parse_slos([]) == {}


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        (["ttft500"], "METRIC:MILLISECONDS"),
        (["itl:5"], "metric must be one of"),
        (["ttft:fast"], "not a number"),
        (["ttft:-1"], "positive"),
        (["ttft:inf"], "positive"),
        (["ttft:1", "ttft:2"], "twice"),
    ],
)
def test_parse_slos_rejects(specs, message):
    with pytest.raises(ValueError, match=message):
        parse_slos(specs)


def test_goodput_counts_requests_meeting_every_slo():
    slos = {"ttft": 200.0, "tpot": 50.0}
    fast = ok(0, ttft=0.1, e2el=0.37, output_tokens=7)  # tpot 45 ms
    slow_first = ok(1, ttft=0.3, e2el=0.5, output_tokens=5)  # ttft 300 ms
    slow_rest = ok(2, ttft=0.1, e2el=1.1, output_tokens=11)  # tpot 100 ms
    single = ok(3, ttft=0.15, e2el=0.15, output_tokens=1)  # no tpot: meets it
    assert [meets_slos(r, slos) for r in (fast, slow_first, slow_rest, single)] == [True, False, False, True]
    assert not meets_slos(failed(4), slos)
    s = summarize([fast, slow_first, slow_rest, single, failed(4)], duration_s=4.0, slos=slos)
    assert s.good_requests == 2
    assert s.goodput == pytest.approx(0.5)
    assert s.slos_ms == slos


def test_goodput_requires_a_first_token():
    empty = ok(0, ttft=None, e2el=0.1, output_tokens=0)
    assert not meets_slos(empty, {"tpot": 50.0})
    assert not meets_slos(empty, {"ttft": 50.0})
    assert meets_slos(empty, {"e2el": 500.0})


def test_format_summary_is_readable():
    results = [ok(0, 0.1, 0.4, 4, (0.1, 0.1, 0.1)), failed(1)]
    text = format_summary(summarize(results, 1.0, {"ttft": 500.0}), [("Model", "tiny")])
    assert "Model:" in text and "tiny" in text
    assert "Failed requests:" in text
    assert "ttft<=500ms" in text
    assert "Token counts from:" in text and "server usage (1)" in text
    assert "1 x HTTP 500: boom" in text
    for row in ("TTFT", "TPOT", "ITL", "E2E"):
        assert any(line.startswith(row) for line in text.splitlines())


# --- arrivals -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rate", [2.0, 50.0])
def test_poisson_arrivals_have_the_requested_mean_rate(rate):
    times = arrival_times(20_001, rate, burstiness=1.0, seed=3)
    gaps = np.diff(times)
    assert times[0] == 0.0
    assert np.all(gaps >= 0)
    assert 1.0 / gaps.mean() == pytest.approx(rate, rel=0.03)
    # Exponential gaps: the coefficient of variation is 1.
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_burstiness_keeps_the_rate_and_shapes_the_gaps(burstiness):
    gaps = np.diff(arrival_times(40_001, 10.0, burstiness=burstiness, seed=5))
    assert 1.0 / gaps.mean() == pytest.approx(10.0, rel=0.05)
    # Gamma gaps of shape k: squared coefficient of variation is 1 / k.
    assert (gaps.var() / gaps.mean() ** 2) == pytest.approx(1.0 / burstiness, rel=0.15)


def test_infinite_rate_sends_everything_at_once():
    assert arrival_times(5, math.inf) == [0.0] * 5
    assert arrival_times(0, 3.0) == []


def test_arrivals_are_reproducible_by_seed():
    assert arrival_times(50, 4.0, seed=1) == arrival_times(50, 4.0, seed=1)
    assert arrival_times(50, 4.0, seed=1) != arrival_times(50, 4.0, seed=2)


@pytest.mark.parametrize(
    ("num", "rate", "burstiness"), [(-1, 1.0, 1.0), (3, 0.0, 1.0), (3, math.nan, 1.0), (3, 1.0, 0.0)]
)
def test_arrivals_reject_bad_parameters(num, rate, burstiness):
    with pytest.raises(ValueError):
        arrival_times(num, rate, burstiness)
