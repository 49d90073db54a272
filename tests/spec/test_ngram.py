"""Prompt lookup: the longest repeated suffix proposes what followed its latest occurrence."""

from __future__ import annotations

import random

import pytest

from pagoda.spec import ngram_propose
from pagoda.spec.ngram import NgramIndex


def test_longest_and_latest_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # suffix [2, 3] occurred at 1..2 (then 9) and 5..6 (then 7): the latest wins
    assert ngram_propose(tokens, 3, 1, 2) == [7, 8, 5]
    # a longer suffix [5, 2, 3] never occurred, [2, 3] did
    assert ngram_propose(tokens, 2, 2, 4) == [7, 8]
    loop = [4, 5, 6] * 3
    assert ngram_propose(loop, 4, 2, 3) == [4, 5, 6]  # only as many as follow the match


def test_no_match_or_too_short():
    assert ngram_propose([1, 2, 3, 4], 4, 1, 3) == []
    assert ngram_propose([1, 1], 4, 2, 3) == []  # a suffix of 2 needs an earlier occurrence
    assert ngram_propose([1, 1], 4, 1, 3) == [1]
    assert ngram_propose([], 4, 1, 3) == []
    assert ngram_propose([7, 7, 7], 0, 1, 3) == []
    # min_n = 3: the repeated pair [8, 9] is not enough
    assert ngram_propose([8, 9, 1, 8, 9], 2, 3, 3) == []


@pytest.mark.slow
def test_bench_offline_spec_workload(tiny_llama_dir, capsys):
    from pagoda.entrypoints.cli import main

    code = main(
        [
            "bench",
            "offline",
            "--model",
            tiny_llama_dir,
            "--workload",
            "spec",
            "--dtype",
            "float32",
            "--output-len",
            "24",
            "--input-len",
            "12",
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}',
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "outputs identical: True" in out
    assert "acceptance rate:" in out and "mean accepted length:" in out and "saved)" in out


@pytest.mark.parametrize("min_n, max_n", [(1, 1), (1, 3), (2, 4), (3, 3)])
def test_incremental_index_proposes_what_the_full_search_does(min_n, max_n):
    rng = random.Random(min_n * 10 + max_n)
    for _ in range(30):
        alphabet = rng.choice([2, 3, 5, 20])
        seq = [rng.randrange(alphabet) for _j in range(rng.randrange(1, 60))]
        index = NgramIndex(min_n, max_n)
        i = 0
        while i < len(seq):
            step = rng.randrange(1, 5)  # a step's verified tokens: one or several
            index.extend(seq[i : i + step])
            i += step
            prefix = seq[:i]
            for k in (1, 4):
                assert index.propose(k) == ngram_propose(prefix, k, min_n, max_n), (prefix, k)
            after = [rng.randrange(alphabet) for _j in range(rng.randrange(0, 3))]
            assert index.propose(3, after) == ngram_propose(prefix + after, 3, min_n, max_n)
