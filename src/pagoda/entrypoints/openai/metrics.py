"""Prometheus metrics with vLLM's names, so existing dashboards work. One registry per app.

`on_step` runs on the engine thread after every step (and abort) with what the step did: the core's
stats snapshot and each touched request's token counts and timings (engine/messages.py); it reads
nothing else of the engine. Prometheus client objects are thread-safe, so the HTTP thread can render
them at any time.
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

from pagoda.engine.messages import RequestStepStats, StepStats
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
        # Speculative decoding (every proposer, grammar-forced drafts included), counted when verified.
        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Draft spans verified.")
        self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_accepted = counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Time between outputs of a request.", _ITL_BUCKETS
        )
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to finish.", _E2E_BUCKETS)
        self._success = Counter(
            "vllm:request_success", "Finished requests.", [*labels, "finished_reason"], registry=self.registry
        )
        self.model_name = model_name
        self._seen = (0,) * 6  # the totals below, as already counted

    def on_step(self, outputs: list[RequestOutput], stats: StepStats) -> None:
        for req in stats.requests:
            self._observe(req)
        engine = stats.engine
        self.running.set(engine.num_running)
        self.waiting.set(engine.num_waiting)
        self.kv_usage.set(engine.kv_usage)
        totals = (
            engine.num_preemptions,
            engine.prefix_cache_queries,
            engine.prefix_cache_hits,
            engine.spec_num_drafts,
            engine.spec_num_draft_tokens,
            engine.spec_num_accepted_tokens,
        )
        counters = (
            self.preemptions,
            self.prefix_queries,
            self.prefix_hits,
            self.spec_drafts,
            self.spec_draft_tokens,
            self.spec_accepted,
        )
        for counter, new, old in zip(counters, totals, self._seen, strict=True):
            if new > old:
                counter.inc(new - old)
        self._seen = totals

    def _observe(self, req: RequestStepStats) -> None:
        self.generation_tokens.inc(req.num_new_tokens)
        if req.ttft is not None:
            self.ttft.observe(req.ttft)
            self.prompt_tokens.inc(req.num_prompt_tokens)
        if req.itl is not None:
            self.itl.observe(req.itl)
        for reason in req.finish_reasons:  # each sample reports its finish reason once
            self._success.labels(self.model_name, reason).inc()
        if req.e2e is not None:
            self.e2e.observe(req.e2e)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
