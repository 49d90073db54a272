#!/usr/bin/env python3
"""Benchmark `pagoda router` routing policies in front of two `pagoda serve` replicas (issue 8).

For each policy (round-robin, then cache-aware by default) the script starts two fresh replicas, so that
every policy starts with cold caches, and a router in front of them; it runs the serving benchmark
(`pagoda.bench.serve.run_benchmark`, what `pagoda bench serve` runs) through the router on a
shared-prefix workload, reads both replicas' `/metrics` before and after to get the prefix-cache hit rate
of that run, then measures the router's added latency: the same light sequential workload sent directly
to the replicas and through the router, alternately, comparing the p50 time to first token.

Workload and cache size. G system prompts ("groups") of --prefix-len tokens, --prompts-per-group
requests each, each request being its group's prompt plus its own --input-len-token question. The
requests are shuffled, so groups interleave in time at random (--order cyclic keeps the dataset's
strict rotation 0, 1, ..., G-1, 0, ..., which with an even G hands round-robin a perfect
group-to-replica affinity by accident). Each replica gets just enough KV blocks to hold
--cache-fraction (0.5) of the G distinct prefixes, plus headroom for --max-concurrency requests in flight,
so the working set fits in the two caches together but not in one.

Every child process is on a free loopback port, logs to --log-dir, and is stopped on exit (SIGTERM,
then SIGKILL), including on errors and Ctrl-C; every wait is bounded.

Usage:

    python scripts/bench_router.py                      # demo model, a few minutes on 2 CPU cores
    python scripts/bench_router.py --num-groups 16 --prompts-per-group 50 --max-concurrency 8 \
        --result-file router-bench.json
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import json
import math
import os
import platform
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

    from pagoda.bench.datasets import BenchRequest

POLICIES = ("round-robin", "least-load", "power-of-two", "cache-aware")
ORDERS = ("shuffled", "cyclic")
MODEL_NAME = "bench-model"  # --served-model-name of the replicas
HOST = "127.0.0.1"
_POLL_S = 0.25
_STOP_GRACE_S = 15.0
_METRICS_SETTLE_S = 15.0  # longest wait for the replicas' counters to count every finished request
_OVERHEAD_WARMUP = 5  # leading pairs of the overhead measurement that are not counted
_OVERHEAD_PROMPT_TOKENS = 8  # under one KV block, so no overhead request ever hits a prefix cache
# Counters read from each replica's /metrics (vLLM names; prefix-cache figures count tokens).
_COUNTERS = {
    "queried_tokens": "vllm:prefix_cache_queries_total",
    "hit_tokens": "vllm:prefix_cache_hits_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
    "preemptions": "vllm:num_preemptions_total",
    "finished_requests": "vllm:request_success_total",
}


@dataclass(frozen=True)
class BenchRouterConfig:
    model: str
    num_groups: int = 8
    prompts_per_group: int = 20
    prefix_len: int = 384
    input_len: int = 32
    output_len: int = 16
    max_concurrency: int = 4
    request_rate: float = math.inf
    order: str = "shuffled"
    cache_fraction: float = 0.5
    block_size: int = 16
    num_kv_blocks: int | None = None
    policies: tuple[str, ...] = ("round-robin", "cache-aware")
    overhead_requests: int = 100
    realtime_overhead: bool = False
    threads_per_replica: int = 1
    seed: int = 0
    startup_timeout_s: float = 180.0
    request_timeout_s: float = 120.0
    serve_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in (
            "num_groups",
            "prompts_per_group",
            "prefix_len",
            "input_len",
            "output_len",
            "max_concurrency",
            "block_size",
            "threads_per_replica",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.prompts_per_group < 2:
            raise ValueError("prompts_per_group must be >= 2: a prefix used once can never be a cache hit")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.overhead_requests < 0:
            raise ValueError(f"overhead_requests must be >= 0, got {self.overhead_requests}")
        if math.isnan(self.request_rate) or self.request_rate <= 0:
            raise ValueError(f"request_rate must be > 0 (or inf), got {self.request_rate}")
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {self.order!r}")
        if not 0 < self.cache_fraction <= 1:
            raise ValueError(f"cache_fraction must be in (0, 1], got {self.cache_fraction}")
        if not self.policies or len(set(self.policies)) != len(self.policies):
            raise ValueError(f"policies must be distinct and non-empty, got {self.policies}")
        for policy in self.policies:
            if policy not in POLICIES:
                raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
        if not self.startup_timeout_s > 0 or not self.request_timeout_s > 0:
            raise ValueError("startup_timeout_s and request_timeout_s must be > 0")
        reserved = ("--port", "--host", "--num-kv-blocks", "--block-size", "--served-model-name")
        for arg in self.serve_args:
            if arg.split("=")[0] in reserved:
                raise ValueError(f"--serve-args must not set {arg.split('=')[0]}: this script sets it")
        for arg in self.router_args:
            if arg.split("=")[0] in ("--port", "--host", "--policy", "--backend", "--config"):
                raise ValueError(f"--router-args must not set {arg.split('=')[0]}: this script sets it")

    @property
    def num_prompts(self) -> int:
        return self.num_groups * self.prompts_per_group


@dataclass(frozen=True)
class CachePlan:
    """How big each replica's KV cache is, in blocks, and why."""

    shared_prefix_tokens: tuple[int, ...]  # per group: leading tokens common to all its prompts
    prefix_blocks: int  # full blocks of the shortest group prefix: what a prefix hit can serve
    private_blocks: int  # blocks a request needs beyond its prefix, at its longest (prompt + output)
    headroom_blocks: int  # private blocks of max_concurrency requests in flight
    num_kv_blocks: int
    max_prompt_tokens: int

    @property
    def prefixes_per_replica(self) -> float:
        return (self.num_kv_blocks - self.headroom_blocks) / self.prefix_blocks


def _common_prefix_len(sequences: Sequence[Sequence[int]]) -> int:
    first, length = sequences[0], min(len(s) for s in sequences)
    for other in sequences[1:]:
        length = next((i for i in range(length) if other[i] != first[i]), length)
    return length


def plan_cache(config: BenchRouterConfig, requests: Sequence[BenchRequest], tokenizer: Any) -> CachePlan:
    """Size each replica's cache to hold cache_fraction of the distinct prefixes plus in-flight headroom.

    Prompts are tokenized as the server tokenizes a completions prompt (with special tokens)."""
    by_group: dict[int, list[list[int]]] = {}
    for request in requests:
        ids = tokenizer(request.completion_prompt())["input_ids"]
        by_group.setdefault(int(request.group_id or 0), []).append(ids)
    shared = [_common_prefix_len(by_group[group]) for group in sorted(by_group)]
    bs = config.block_size
    prefix_blocks = min(shared) // bs
    if prefix_blocks < 1:
        raise ValueError(f"the shared prefixes ({min(shared)} tokens) are shorter than one KV block ({bs})")
    max_prompt = max(len(p) for prompts in by_group.values() for p in prompts)
    private = -(-(max_prompt + config.output_len) // bs) - prefix_blocks
    headroom = config.max_concurrency * private
    planned = math.ceil(config.cache_fraction * config.num_groups * prefix_blocks) + headroom
    num_kv_blocks = config.num_kv_blocks or planned
    if num_kv_blocks < prefix_blocks + private:
        raise ValueError(f"num_kv_blocks {num_kv_blocks} cannot hold one request ({prefix_blocks + private})")
    return CachePlan(tuple(shared), prefix_blocks, private, headroom, num_kv_blocks, max_prompt)


# ---- child processes ------------------------------------------------------------------------------------
def _die_with_parent() -> None:  # runs in the child between fork and exec (Linux only)
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


class Processes:
    """The child processes of this script. `stop` and `stop_all` are safe to call at any time, repeatedly."""

    def __init__(self, log_dir: Path, env: dict[str, str]) -> None:
        self.log_dir = log_dir
        self.env = env
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: Sequence[str], extra_env: dict[str, str] | None = None) -> str:
        log = self.log_path(name)
        with log.open("wb") as out:  # the child keeps its own copy of the descriptor
            self._procs[name] = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**self.env, **(extra_env or {})},
                start_new_session=True,  # Ctrl-C reaches only this script, which stops the children in order
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            )
        return name

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def pid(self, name: str) -> int:
        return self._procs[name].pid

    def exit_code(self, name: str) -> int | None:
        return self._procs[name].poll()

    def tail(self, name: str, lines: int = 15) -> str:
        with contextlib.suppress(OSError):
            text = self.log_path(name).read_text(encoding="utf-8", errors="replace")
            return "\n".join(text.splitlines()[-lines:])
        return ""

    def stop(self, names: Sequence[str], grace_s: float = _STOP_GRACE_S) -> None:
        procs = [self._procs.pop(n) for n in names if n in self._procs]
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=5.0)

    def stop_all(self) -> None:
        self.stop(list(self._procs))


def free_ports(count: int) -> list[int]:
    """Ports free on the loopback address now (held open together so that they differ)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(count)]
        for sock in socks:
            sock.bind((HOST, 0))
        return [sock.getsockname()[1] for sock in socks]


def wait_healthy(client: httpx.Client, procs: Processes, name: str, url: str, timeout_s: float) -> None:
    """Until GET url/health answers 200; RuntimeError if the process exits or time runs out."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        code = procs.exit_code(name)
        if code is not None:
            raise RuntimeError(
                f"{name} exited with code {code} during startup; its log ends:\n{procs.tail(name)}"
            )
        with contextlib.suppress(httpx.HTTPError):
            if client.get(url + "/health", timeout=2.0).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{name} not healthy after {timeout_s:.0f}s; its log ends:\n{procs.tail(name)}"
            )
        time.sleep(_POLL_S)


def scrape_counters(client: httpx.Client, url: str) -> dict[str, float]:
    """The _COUNTERS of one replica, summed over their labels."""
    from prometheus_client.parser import text_string_to_metric_families

    response = client.get(url + "/metrics", timeout=10.0)
    response.raise_for_status()
    totals = dict.fromkeys(_COUNTERS, 0.0)
    names = {name: key for key, name in _COUNTERS.items()}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name in names:
                totals[names[sample.name]] += sample.value
    return totals


@contextlib.contextmanager
def realtime_priority(pids: Sequence[int]) -> Iterator[None]:
    """Every thread of `pids` at SCHED_FIFO priority 1 inside the block, back to SCHED_OTHER after: keeps
    other processes' load out of a latency measurement. Needs CAP_SYS_NICE (PermissionError otherwise)."""
    tids = [int(t) for pid in pids for t in os.listdir(f"/proc/{pid}/task")]
    changed = []
    try:
        for tid in tids:
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                os.sched_setscheduler(tid, os.SCHED_FIFO, os.sched_param(1))
                changed.append(tid)
        yield
    finally:
        for tid in changed:
            with contextlib.suppress(ProcessLookupError):
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))


def check_realtime_allowed() -> None:
    """ValueError unless this process may use real-time scheduling."""
    try:
        with realtime_priority([os.getpid()]):
            pass
    except (PermissionError, AttributeError, OSError) as exc:
        raise ValueError(
            f"--realtime-overhead needs real-time scheduling (Linux, CAP_SYS_NICE): {exc}"
        ) from exc


def scrape_router_decisions(client: httpx.Client, url: str) -> dict[str, float]:
    """The router's routing decisions so far, by reason (cache_hit, cache_miss, balance, ...)."""
    from prometheus_client.parser import text_string_to_metric_families

    response = client.get(url + "/metrics", timeout=10.0)
    response.raise_for_status()
    decisions: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name == "pagoda_router_policy_decisions_total":
                reason = sample.labels.get("reason", "")
                decisions[reason] = decisions.get(reason, 0.0) + sample.value
    return decisions


# ---- measurements ---------------------------------------------------------------------------------------
def _stream_ttft(client: httpx.Client, url: str, prompt: str) -> float:
    """Seconds from sending one streamed completion to its first chunk (the server sends one per step that
    produced a token; the text may be empty, e.g. for a special token)."""
    payload = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": 2,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    start = time.perf_counter()
    first: float | None = None
    done = False
    with client.stream("POST", url + "/v1/completions", json=payload) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {response.status_code}: {response.read()[:300]!r}")
        for line in response.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                done = True
                break
            if first is None and json.loads(data).get("choices"):
                first = time.perf_counter()
    if not done or first is None:
        raise RuntimeError(f"{url}: stream ended without a token or without [DONE]")
    return first - start


def measure_overhead(
    client: httpx.Client, router_url: str, replica_urls: Sequence[str], prompts: Sequence[str]
) -> dict[str, Any]:
    """Sequential requests, in pairs: one directly to a replica (alternating between them) and one through
    the router, in alternating order so that drifting machine load hits both paths alike. Each request has
    its own prompt of under one KV block, so none is served from a prefix cache."""
    import numpy as np

    direct, routed = [], []
    for i in range(len(prompts) // 2):
        legs = [("direct", replica_urls[i % len(replica_urls)]), ("router", router_url)]
        if i % 2:
            legs.reverse()
        times = {path: _stream_ttft(client, url, prompts[2 * i + j]) for j, (path, url) in enumerate(legs)}
        if i >= _OVERHEAD_WARMUP:
            direct.append(times["direct"])
            routed.append(times["router"])
    if not direct:
        return {"pairs": 0}
    d, r = np.asarray(direct) * 1e3, np.asarray(routed) * 1e3
    return {
        "pairs": len(d),
        "direct_ttft_p50_ms": float(np.median(d)),
        "router_ttft_p50_ms": float(np.median(r)),
        "added_p50_ms": float(np.median(r) - np.median(d)),
        "paired_difference_p50_ms": float(np.median(r - d)),
        "direct_ttft_mean_ms": float(d.mean()),
        "router_ttft_mean_ms": float(r.mean()),
    }


@dataclass
class PolicyRun:
    policy: str
    replica_counters: list[dict[str, float]] = field(default_factory=list)  # deltas of this run
    summary: dict[str, Any] = field(default_factory=dict)
    overhead: dict[str, Any] = field(default_factory=dict)
    router_decisions: dict[str, float] = field(default_factory=dict)  # of the benchmark requests
    loadavg_before: tuple[float, ...] = ()
    loadavg_after: tuple[float, ...] = ()

    def hit_rate(self, replica: int | None = None) -> float | None:
        counters = self.replica_counters if replica is None else [self.replica_counters[replica]]
        queried = sum(c["queried_tokens"] for c in counters)
        return sum(c["hit_tokens"] for c in counters) / queried if queried else None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["hit_rate"] = self.hit_rate()
        data["replica_hit_rates"] = [self.hit_rate(i) for i in range(len(self.replica_counters))]
        return data


def _serve_argv(config: BenchRouterConfig, plan: CachePlan, port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pagoda.entrypoints.cli",
        "serve",
        config.model,
        "--host",
        HOST,
        "--port",
        str(port),
        "--served-model-name",
        MODEL_NAME,
        "--num-kv-blocks",
        str(plan.num_kv_blocks),
        "--block-size",
        str(config.block_size),
        "--log-level",
        "warning",
        *config.serve_args,
    ]


def _router_argv(config: BenchRouterConfig, policy: str, port: int, backends: Sequence[str]) -> list[str]:
    argv = [sys.executable, "-m", "pagoda.entrypoints.cli", "router", "--host", HOST, "--port", str(port)]
    argv += ["--policy", policy, "--seed", str(config.seed)]
    for url in backends:
        argv += ["--backend", f"{url},model={MODEL_NAME}"]
    return argv + list(config.router_args)


def run_policy(
    config: BenchRouterConfig,
    plan: CachePlan,
    policy: str,
    requests: Sequence[BenchRequest],
    overhead_prompts: Sequence[str],
    tokenizer: Any,
    procs: Processes,
) -> PolicyRun:
    """Fresh replicas and router, the shared-prefix benchmark through the router, then the overhead pairs."""
    import httpx

    from pagoda.bench.serve import ServeConfig, run_benchmark

    run = PolicyRun(policy, loadavg_before=os.getloadavg())
    ports = free_ports(3)
    replica_urls = [f"http://{HOST}:{p}" for p in ports[:2]]
    router_url = f"http://{HOST}:{ports[2]}"
    threads = {"OMP_NUM_THREADS": str(config.threads_per_replica)}
    names = [
        procs.start(f"{policy}-replica{i}", _serve_argv(config, plan, port), threads)
        for i, port in enumerate(ports[:2])
    ]
    try:
        with httpx.Client(timeout=config.request_timeout_s, trust_env=False) as client:
            for name, url in zip(names, replica_urls, strict=True):
                wait_healthy(client, procs, name, url, config.startup_timeout_s)
            for url in replica_urls:  # first requests pay one-off costs; keep them out of the figures
                for prompt in overhead_prompts[:2]:
                    _stream_ttft(client, url, prompt)
            router_argv = _router_argv(config, policy, ports[2], replica_urls)
            names.append(procs.start(f"{policy}-router", router_argv))
            wait_healthy(client, procs, names[-1], router_url, config.startup_timeout_s)
            before = [scrape_counters(client, url) for url in replica_urls]
            serve_config = ServeConfig(
                base_url=router_url,
                model=MODEL_NAME,
                request_rate=config.request_rate,
                max_concurrency=config.max_concurrency,
                seed=config.seed,
                ignore_eos=True,
                request_timeout_s=config.request_timeout_s,
                show_progress=False,
            )
            result = run_benchmark(serve_config, requests, tokenizer)
            run.summary = result.summary.to_dict()
            # The counters move on the engine thread after each step; wait until they count every request.
            deadline = time.monotonic() + _METRICS_SETTLE_S
            while True:
                after = [scrape_counters(client, url) for url in replica_urls]
                finished = sum(
                    a["finished_requests"] - b["finished_requests"]
                    for a, b in zip(after, before, strict=True)
                )
                if finished >= result.summary.completed or time.monotonic() > deadline:
                    break
                time.sleep(_POLL_S)
            run.replica_counters = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before, strict=True)]
            run.router_decisions = scrape_router_decisions(client, router_url)
            if config.overhead_requests:
                priority = (
                    realtime_priority([os.getpid(), *(procs.pid(n) for n in names)])
                    if config.realtime_overhead
                    else contextlib.nullcontext()
                )
                with priority:
                    run.overhead = measure_overhead(client, router_url, replica_urls, overhead_prompts[4:])
                run.overhead["realtime_priority"] = config.realtime_overhead
    finally:
        run.loadavg_after = os.getloadavg()
        procs.stop(names)
    return run


# ---- report ---------------------------------------------------------------------------------------------
def hit_rate_ceiling(
    plan: CachePlan, requests: Sequence[BenchRequest], tokenizer: Any, block_size: int
) -> float:
    """Hit rate if every request but each group's first found its group's full prefix blocks cached."""
    seen: set[int] = set()
    hits = queried = 0
    for request in requests:
        group = int(request.group_id or 0)
        queried += len(tokenizer(request.completion_prompt())["input_ids"])
        if group in seen:
            hits += plan.shared_prefix_tokens[group] // block_size * block_size
        seen.add(group)
    return hits / queried


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def format_report(runs: Sequence[PolicyRun], ceiling: float) -> str:
    header = (
        "policy",
        "done",
        "hit rate",
        "replica hit rates",
        "requests/replica",
        "preempt",
        "TTFT mean",
        "TTFT p50",
        "E2E mean",
        "req/s",
        "router +p50",
    )
    rows = [header]
    for run in runs:
        s = run.summary
        counters = run.replica_counters
        rows.append(
            (
                run.policy,
                f"{s['completed']}/{s['num_requests']}",
                _pct(run.hit_rate()),
                " / ".join(_pct(run.hit_rate(i)) for i in range(len(counters))),
                " / ".join(f"{c['finished_requests']:.0f}" for c in counters),
                f"{sum(c['preemptions'] for c in counters):.0f}",
                _ms(s["ttft_ms"]["mean"]),
                _ms(s["ttft_ms"]["median"]),
                _ms(s["e2el_ms"]["mean"]),
                f"{s['request_throughput']:.2f}",
                _ms(run.overhead.get("added_p50_ms")),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(
        "(times in ms; hit rate = prefix-cache hit tokens / queried tokens from the replicas' /metrics)"
    )
    lines.append(
        f"hit-rate ceiling (every request but each group's first hits its whole prefix): {_pct(ceiling)}"
    )
    for run in runs:
        extra = sum(c["queried_tokens"] - c["prompt_tokens"] for c in run.replica_counters)
        if extra > 0:  # the engine counts a lookup each time it tries to schedule a waiting request
            lines.append(
                f"note: {run.policy}: the replicas looked up {extra:.0f} prompt tokens more than once (requests "
                "that waited for KV blocks, or were preempted); its hit rate counts those lookups too"
            )
    return "\n".join(lines)


def verdict(runs: Sequence[PolicyRun]) -> dict[str, Any]:
    """The issue's targets, where both policies ran."""
    by_policy = {run.policy: run for run in runs}
    out: dict[str, Any] = {}
    rr, ca = by_policy.get("round-robin"), by_policy.get("cache-aware")
    if rr and ca:
        rr_rate, ca_rate = rr.hit_rate(), ca.hit_rate()
        if rr_rate is None or ca_rate is None:  # no request reached a replica
            ratio = None
        else:
            ratio = ca_rate / rr_rate if rr_rate else (math.inf if ca_rate else None)
        out["hit_rate_ratio"] = ratio
        out["hit_rate_ratio_target_met"] = ratio is not None and ratio >= 1.5
        rr_ttft, ca_ttft = rr.summary["ttft_ms"]["mean"], ca.summary["ttft_ms"]["mean"]
        out["mean_ttft_ms"] = {"round-robin": rr_ttft, "cache-aware": ca_ttft}
        out["lower_mean_ttft_target_met"] = ca_ttft is not None and rr_ttft is not None and ca_ttft < rr_ttft
    added = {run.policy: run.overhead["added_p50_ms"] for run in runs if "added_p50_ms" in run.overhead}
    if added:
        out["router_added_p50_ms"] = added
        out["router_added_target_met"] = all(v < 2.0 for v in added.values())
        out["router_added_realtime_priority"] = any(run.overhead.get("realtime_priority") for run in runs)
    return out


def _ratio(value: float | None) -> str:
    if value is None:
        return "-"
    return "unbounded (round-robin had no hits)" if math.isinf(value) else f"{value:.2f}x"


def _format_verdict(v: dict[str, Any]) -> str:
    lines = []
    if "hit_rate_ratio" in v:
        met = "met" if v["hit_rate_ratio_target_met"] else "NOT met"
        lines.append(
            f"cache-aware / round-robin hit rate: {_ratio(v['hit_rate_ratio'])} (target >= 1.5x: {met})"
        )
        t = v["mean_ttft_ms"]
        met = "met" if v["lower_mean_ttft_target_met"] else "NOT met"
        lines.append(
            f"mean TTFT: cache-aware {_ms(t['cache-aware'])} ms vs round-robin {_ms(t['round-robin'])} ms "
            f"(target lower: {met})"
        )
    if "router_added_p50_ms" in v:
        met = "met" if v["router_added_target_met"] else "NOT met"
        figures = ", ".join(f"{p} {ms:.2f} ms" for p, ms in v["router_added_p50_ms"].items())
        lines.append(
            f"router added latency, p50 TTFT through the router - direct: {figures} (target < 2 ms: {met})"
            + (", measured at real-time priority" if v["router_added_realtime_priority"] else "")
        )
    return "\n".join(lines)


# ---- main -----------------------------------------------------------------------------------------------
def _repo_src() -> Path | None:
    src = Path(__file__).resolve().parents[1] / "src"
    return src if (src / "pagoda").is_dir() else None


def _child_env() -> dict[str, str]:
    """This environment, with the checkout's src first on PYTHONPATH so children run the same pagoda."""
    env = dict(os.environ)
    src = _repo_src()
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(src), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _max_model_len(model: str) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        data = json.loads((Path(model) / "config.json").read_text(encoding="utf-8"))
        value = data.get("max_position_embeddings")
        return value if isinstance(value, int) else None
    return None


def parse_args(argv: Sequence[str] | None = None) -> tuple[BenchRouterConfig, argparse.Namespace]:
    doc = __doc__ or ""
    parser = argparse.ArgumentParser(
        description=doc.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--model", help="model folder (default: pagoda's built-in demo model)")
    parser.add_argument("--num-groups", type=int, default=8, help="distinct shared prefixes")
    parser.add_argument("--prompts-per-group", type=int, default=20, help="requests per shared prefix")
    parser.add_argument("--prefix-len", type=int, default=384, help="tokens of each shared prefix")
    parser.add_argument("--input-len", type=int, default=32, help="tokens of each request's own question")
    parser.add_argument("--output-len", type=int, default=16, help="tokens generated per request")
    parser.add_argument("--max-concurrency", type=int, default=4, help="requests in flight at most")
    parser.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (inf: closed loop)")
    parser.add_argument("--order", choices=ORDERS, default="shuffled", help="how groups interleave in time")
    parser.add_argument(
        "--cache-fraction",
        type=float,
        default=0.5,
        help="fraction of the distinct prefixes one replica holds",
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument(
        "--num-kv-blocks", type=int, help="KV blocks per replica (default: from --cache-fraction)"
    )
    parser.add_argument("--policies", nargs="+", default=["round-robin", "cache-aware"], choices=POLICIES)
    parser.add_argument(
        "--overhead-requests",
        type=int,
        default=100,
        help="requests per path for the router overhead (0: skip)",
    )
    parser.add_argument(
        "--realtime-overhead",
        action="store_true",
        help="run the overhead measurement with this script, the router and the replicas at real-time "
        "priority (SCHED_FIFO 1; Linux, needs CAP_SYS_NICE), to keep other processes' load out of it",
    )
    parser.add_argument("--threads-per-replica", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts, their order and arrivals")
    parser.add_argument("--startup-timeout", type=float, default=180.0, help="seconds for a server to start")
    parser.add_argument("--request-timeout", type=float, default=120.0, help="seconds a request may stall")
    parser.add_argument("--serve-args", default="", help="extra `pagoda serve` flags, one quoted string")
    parser.add_argument("--router-args", default="", help="extra `pagoda router` flags, one quoted string")
    parser.add_argument("--result-file", default="router-bench.json", help="JSON result")
    parser.add_argument("--log-dir", help="folder for the servers' logs (default: a new temporary folder)")
    args = parser.parse_args(argv)
    if args.model is None:
        from pagoda.assets import default_model_path

        args.model = str(default_model_path())
    config = BenchRouterConfig(
        model=args.model,
        num_groups=args.num_groups,
        prompts_per_group=args.prompts_per_group,
        prefix_len=args.prefix_len,
        input_len=args.input_len,
        output_len=args.output_len,
        max_concurrency=args.max_concurrency,
        request_rate=args.request_rate,
        order=args.order,
        cache_fraction=args.cache_fraction,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        policies=tuple(args.policies),
        overhead_requests=args.overhead_requests,
        realtime_overhead=args.realtime_overhead,
        threads_per_replica=args.threads_per_replica,
        seed=args.seed,
        startup_timeout_s=args.startup_timeout,
        request_timeout_s=args.request_timeout,
        serve_args=tuple(shlex.split(args.serve_args)),
        router_args=tuple(shlex.split(args.router_args)),
    )
    return config, args


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    src = _repo_src()
    if src is not None and str(src) not in sys.path:
        sys.path.insert(0, str(src))
    import httpx

    from pagoda.bench.datasets import DatasetConfig, load_tokenizer, sample_requests

    try:
        config, args = parse_args(argv)
        if not Path(args.result_file).resolve().parent.is_dir():
            raise ValueError(f"the folder of --result-file {args.result_file!r} does not exist")
        if config.realtime_overhead:
            check_realtime_allowed()
        tokenizer = load_tokenizer(config.model)
        dataset = DatasetConfig(
            name="shared-prefix",
            num_prompts=config.num_prompts,
            input_len=config.input_len,
            output_len=config.output_len,
            seed=config.seed,
            prefix_len=config.prefix_len,
            num_groups=config.num_groups,
        )
        requests = sample_requests(dataset, tokenizer)
        if config.order == "shuffled":
            random.Random(config.seed).shuffle(requests)
        plan = plan_cache(config, requests, tokenizer)
        limit = _max_model_len(config.model)
        if limit is not None and plan.max_prompt_tokens + config.output_len > limit:
            raise ValueError(
                f"prompts of up to {plan.max_prompt_tokens} tokens plus {config.output_len} output tokens exceed "
                f"the model's {limit}-token context; lower --prefix-len, --input-len or --output-len"
            )
        # Two overhead prompts per pair, four for the replicas' warm-up.
        overhead = DatasetConfig(
            name="random",
            num_prompts=2 * (config.overhead_requests + _OVERHEAD_WARMUP) + 4,
            input_len=_OVERHEAD_PROMPT_TOKENS,
            output_len=2,
            seed=config.seed + 1,
        )
        overhead_prompts = [r.prompt for r in sample_requests(overhead, tokenizer)]
    except ValueError as exc:
        print(f"bench_router: error: {exc}", file=sys.stderr)
        return 2

    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="bench-router-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(
        f"{config.num_prompts} requests: {config.num_groups} groups x {config.prompts_per_group}, prefix "
        f"{config.prefix_len} + question {config.input_len} tokens, output {config.output_len}, "
        f"{config.order} order, max concurrency {config.max_concurrency}\n"
        f"each replica: {plan.num_kv_blocks} KV blocks of {config.block_size} = {plan.prefixes_per_replica:.2f} "
        f"prefixes of {plan.prefix_blocks} blocks (of {config.num_groups}) + {plan.headroom_blocks} blocks for "
        f"{config.max_concurrency} requests in flight\nserver logs in {log_dir}",
        flush=True,
    )
    procs = Processes(log_dir, _child_env())
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    runs: list[PolicyRun] = []
    started_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    try:
        for policy in config.policies:
            print(
                f"[{policy}] starting replicas and router, then {config.num_prompts} requests ...", flush=True
            )
            t0 = time.monotonic()
            runs.append(run_policy(config, plan, policy, requests, overhead_prompts, tokenizer, procs))
            print(f"[{policy}] done in {time.monotonic() - t0:.0f}s", flush=True)
    except (RuntimeError, OSError, httpx.HTTPError) as exc:
        print(f"bench_router: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench_router: interrupted; servers stopped", file=sys.stderr)
        return 130
    finally:
        procs.stop_all()
        signal.signal(signal.SIGTERM, previous)

    ceiling = hit_rate_ceiling(plan, requests, tokenizer, config.block_size)
    print()
    print(format_report(runs, ceiling))
    summary = verdict(runs)
    print(_format_verdict(summary))
    result = {
        "started_at": started_at,
        "command": " ".join(shlex.quote(a) for a in [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]),
        "config": asdict(config),
        "cache_plan": {**asdict(plan), "prefixes_per_replica": plan.prefixes_per_replica},
        "hit_rate_ceiling": ceiling,
        "environment": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
        },
        "runs": [run.to_dict() for run in runs],
        "verdict": summary,
    }
    from pagoda.bench.serve import write_json

    write_json(result, args.result_file)
    print(f"result written to {args.result_file}")
    failed = sum(run.summary["failed"] for run in runs)
    if failed:
        errors = [e for run in runs for e in run.summary["errors"]]
        print(
            f"bench_router: {failed} requests failed (first error: {errors[0]}); see {args.result_file} and the "
            f"server logs in {log_dir}",
            file=sys.stderr,
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
