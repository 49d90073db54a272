"""Masking cost (slow; prints timings, asserts only correctness)."""

from __future__ import annotations

import random
import string
import time

import numpy as np
import pytest
from grammar_helpers import (
    EOS,
    JSON_SCHEMAS,
    REGEXES,
    allowed_ids,
)
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from pagoda.sampling_params import StructuredOutputs
from pagoda.structured import GrammarManager

# ---- masking cost (slow; prints timings, asserts only correctness) --------------------------------------


def build_synthetic_tokenizer(vocab_size: int, seed: int = 0) -> PreTrainedTokenizerFast:
    """A byte-level BPE with ``vocab_size`` tokens made by growing random words one merge at a time:
    cheap to build at real-model sizes (32k, 152k), unlike training one."""
    rng = random.Random(seed)
    chars = bytes_to_unicode()
    vocab = {EOS: 0} | {chars[b]: b + 1 for b in range(256)}
    merges: list[tuple[str, str]] = []
    alphabet = string.ascii_lowercase * 4 + string.ascii_uppercase + string.digits + '"{}[]:,._-'
    growable = [chars[ord(c)] for c in string.ascii_letters + string.digits + '"{}[]:,']
    for c in string.ascii_lowercase:
        merges.append((chars[32], chars[ord(c)]))
        vocab[chars[32] + chars[ord(c)]] = len(vocab)
        growable.append(chars[32] + chars[ord(c)])
    while len(vocab) < vocab_size:
        base = rng.choice(growable)
        token = base + chars[ord(rng.choice(alphabet))]
        if token in vocab:
            continue
        vocab[token] = len(vocab)
        merges.append((base, token[-1]))
        if len(token) < 12:
            growable.append(token)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)


_TIMING_MIXES = {
    "json schemas": [StructuredOutputs(json=JSON_SCHEMAS[n]) for n in ("nested", "numbers", "array_enum")],
    "json_object": [StructuredOutputs(json_object=True)],
    "regex [a-z]{1,8}@...": [StructuredOutputs(regex=REGEXES[2])],
}


@pytest.mark.slow
@pytest.mark.parametrize("vocab_size", [32_000, 152_000])
def test_fill_bitmask_timing_batch_64(vocab_size: int) -> None:
    tokenizer = build_synthetic_tokenizer(vocab_size)
    mgr = GrammarManager.from_tokenizer(tokenizer, vocab_size=vocab_size + 64)
    try:
        for mix, specs in _TIMING_MIXES.items():
            compiled = [mgr.compile(spec) for spec in specs]
            matchers = [compiled[i % len(compiled)].new_matcher() for i in range(64)]
            bitmask = mgr.allocate_bitmask(64)
            rng = np.random.default_rng(0)
            fills = []
            for _ in range(50):
                start = time.perf_counter()
                mgr.fill_bitmask(bitmask, matchers)
                fills.append(time.perf_counter() - start)
                for row, matcher in enumerate(matchers):
                    token = int(rng.choice(allowed_ids(bitmask, row)))
                    assert matcher.accept_token(token)
                    if matcher.is_terminated():
                        matcher.reset()
            fills_ms = sorted(f * 1e3 for f in fills[1:])
            print(
                f"\nfill_bitmask batch=64 V={vocab_size + 64} {mix}: median {fills_ms[len(fills_ms) // 2]:.2f} ms,"
                f" p90 {fills_ms[int(0.9 * len(fills_ms))]:.2f} ms, max {fills_ms[-1]:.2f} ms"
            )
    finally:
        mgr.shutdown()
