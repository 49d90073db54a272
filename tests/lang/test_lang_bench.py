"""`pagoda bench lang` on a tiny server: every variant runs, counts what it should and gives the same answers."""

from __future__ import annotations

import json

import pytest

from pagoda.entrypoints.cli import main


@pytest.mark.slow  # about a minute on 2 busy cores (48 s in session 24)
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


def test_bench_lang_tree_of_thought_shape(lang_server, tmp_path) -> None:
    """SGLang's tree shape, small: the plain-API walk asks one request per node (its branches as
    n samples), the language a gen per branch; all generate the same tokens, greedy answers agree."""
    result = tmp_path / "tree.json"
    width, depth, thought = 2, 2, 3
    flags = {
        "--base-url": lang_server.base_url,
        "--workload": "tree-of-thought",
        "--num-trees": "1",
        "--width": str(width),
        "--depth": str(depth),
        "--context-tokens": "16",
        "--thought-tokens": str(thought),
        "--thought-temperature": "0",
        "--repeats": "1",
        "--warmup": "0",
        "--result-file": str(result),
    }
    assert main(["bench", "lang", *(x for kv in flags.items() for x in kv)]) == 0
    data = json.loads(result.read_text())
    assert data["notes"]["tree-of-thought"] == {"same_answers": True}
    variants = {r["variant"]: r for r in data["results"]}
    assert set(variants) == {"openai", "requests", "lang"}
    nodes = 1 + width  # depth 2: the root and its children
    thoughts = width + width * width
    assert variants["openai"]["median_requests"] == nodes
    assert variants["requests"]["median_requests"] == nodes
    assert variants["openai"]["median_generated_tokens"] == thoughts * thought
    # The language's branches are a request each, and its commits (prompt-only) generate nothing.
    assert variants["lang"]["median_requests"] >= thoughts
    assert variants["lang"]["median_generated_tokens"] == thoughts * thought


def test_bench_lang_rejects_negative_temperature(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "lang", "--base-url", "http://127.0.0.1:1", "--thought-temperature", "-1"])
    assert "--thought-temperature" in capsys.readouterr().err
