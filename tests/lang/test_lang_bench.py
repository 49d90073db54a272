"""`pagoda bench lang --workload select` on a tiny server: every variant runs and gives the same answers."""

from __future__ import annotations

import json

import pytest

from pagoda.entrypoints.cli import main


@pytest.mark.slow  # about 3 minutes on 2 busy cores: the workload is built through /tokenize
def test_bench_lang_select_runs_and_agrees(lang_server, tmp_path) -> None:
    result = tmp_path / "lang.json"
    flags = {
        "--base-url": lang_server.base_url,
        "--workload": "select",
        "--num-questions": "2",
        "--num-shots": "2",
        "--prompt-tokens": "120",
        "--question-tokens": "8",
        "--repeats": "1",
        "--warmup": "0",
        "--result-file": str(result),
    }
    assert main(["bench", "lang", *(x for kv in flags.items() for x in kv)]) == 0
    data = json.loads(result.read_text())
    assert data["notes"]["select"] == {"same_answers": True}
    variants = {r["variant"]: r for r in data["results"]}
    assert set(variants) == {"openai", "requests", "requests start", "lang", "lang gen 1"}
    # The plain-API program scores whole prompts (echo + logprobs): nothing is a cache hit.
    assert variants["openai"]["median_computed_tokens"] == variants["requests"]["median_computed_tokens"]
    assert variants["lang"]["speedup_vs_openai"] > 0
    assert data["notes"]["lang_speedup_vs_openai"]["select"] > 0
    # Scored from the first token, the independent requests compute every prompt whole; with a
    # start position, and in the language, the shared prompt is a cache hit.
    assert (
        variants["requests start"]["median_computed_tokens"] < variants["requests"]["median_computed_tokens"]
    )
    assert variants["lang"]["median_computed_tokens"] < variants["requests"]["median_computed_tokens"]
    assert data["notes"]["select_over_gen_of_one_token"] > 0
