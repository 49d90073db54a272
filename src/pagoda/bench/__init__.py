"""Benchmarks: `serve` (an OpenAI-compatible endpoint over HTTP), `sweep` (serve over several loads, charted)
and `offline` (the engine in-process). They share the prompts of `pagoda.bench.datasets`."""
