"""Prometheus metrics with vLLM's names, so existing dashboards work. One registry per app.

`on_step` runs on the engine thread after every step with that step's delta outputs; prometheus
client objects are thread-safe, so the HTTP thread can render them at any time.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

from pagoda.engine.llm_engine import LLMEngine
from pagoda.outputs import RequestOutput


def _buckets(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split())


# Histogram bucket bounds in seconds, as vLLM's.
_TTFT_BUCKETS = _buckets("0.001 0.005 0.01 0.02 0.04 0.06 0.08 0.1 0.25 0.5 0.75 1 2.5 5 7.5 10 20 40 80")
_ITL_BUCKETS = _buckets("0.01 0.025 0.05 0.075 0.1 0.15 0.2 0.3 0.4 0.5 0.75 1 2.5 5 7.5 10 20 40 80")
_E2E_BUCKETS = _buckets("0.3 0.5 0.8 1 1.5 2 2.5 5 10 15 20 30 40 50 60 120 240 480 960")


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        # process_resident_memory_bytes and friends, as in vLLM (the soak watches memory with them).
        ProcessCollector(registry=self.registry)
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=self.registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        self.running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks held by requests (0 to 1).")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of the requests started.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.preemptions = counter("vllm:num_preemptions", "Requests preempted (recomputed later).")
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens served by the prefix cache.")
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Time between outputs of a request.", _ITL_BUCKETS
        )
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to finish.", _E2E_BUCKETS)
        self._success = Counter(
            "vllm:request_success", "Finished requests.", [*labels, "finished_reason"], registry=self.registry
        )
        self.model_name = model_name
        self._last_output: dict[str, float] = {}  # request id -> time of its last output with tokens
        self._seen = (0, 0, 0)  # preemptions, prefix queries, prefix hits: totals already counted

    def on_step(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self._observe(out)
        core = engine.core
        self.running.set(len(core.scheduler.running))
        self.waiting.set(len(core.scheduler.waiting))
        self.kv_usage.set(core.kv.usage)
        totals = (
            core.scheduler.stats.num_preemptions,
            core.kv.stats.queried_tokens,
            core.kv.stats.hit_tokens,
        )
        for counter, new, old in zip(
            (self.preemptions, self.prefix_queries, self.prefix_hits), totals, self._seen, strict=True
        ):
            if new > old:
                counter.inc(new - old)
        self._seen = totals

    def _observe(self, out: RequestOutput) -> None:
        times = out.metrics
        now = times.get("now")
        num_new = sum(len(c.token_ids) for c in out.outputs)
        self.generation_tokens.inc(num_new)
        rid = out.request_id
        if now is not None and num_new:
            last = self._last_output.get(rid)
            if last is None and "first_token_time" in times:
                self.ttft.observe(times["first_token_time"] - times["arrival_time"])
                self.prompt_tokens.inc(len(out.prompt_token_ids))
            elif last is not None:
                # One observation per step of the request: its n samples advance together.
                self.itl.observe(now - last)
            self._last_output[rid] = now
        for c in out.outputs:  # each sample reports its finish reason in exactly one delta
            if c.finish_reason is not None:
                self._success.labels(self.model_name, c.finish_reason).inc()
        if out.finished:
            self._last_output.pop(rid, None)
            if now is not None:
                self.e2e.observe(now - times["arrival_time"])

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
