"""The bench's random texts: built with batched length queries, yet the same texts and random
stream as asking one length at a time."""

from __future__ import annotations

import random

import pytest

from pagoda.bench import lang as bench


class FakeTokenizer:
    """A tokenizer stand-in: a BOS, then one token per two characters."""

    def tokenize(self, text: str) -> list[int]:
        return [0] + [ord(c) for c in text[::2]]


def reference_words(rng: random.Random, backend, tokens: int) -> str:
    """One length query at a time (what the bench did before)."""
    text = ""
    while len(backend.tokenize(text or " ")) < tokens:
        text += " " + " ".join(rng.choices(bench.WORDS, k=8))
    while len(backend.tokenize(text)) > tokens:
        text = text.rsplit(" ", 1)[0]
    return text.strip()


@pytest.mark.parametrize("sizes", [[32] * 20, [4, 1, 2, 1500, 64, 7, 1024, 3]])
def test_words_same_texts_and_stream(sizes) -> None:
    fast_rng, slow_rng = random.Random(7), random.Random(7)
    fast, slow = FakeTokenizer(), FakeTokenizer()
    for n in sizes:
        text = bench._words(fast_rng, fast, n)
        assert text == reference_words(slow_rng, slow, n)
        assert len(fast.tokenize(text)) <= n
    assert fast_rng.random() == slow_rng.random()  # the stream goes on where it did


def test_few_shot_prompt_unchanged(monkeypatch) -> None:
    fast_rng, slow_rng = random.Random(0), random.Random(0)
    fast = bench.few_shot_prompt(fast_rng, FakeTokenizer(), 8, 1500)
    monkeypatch.setattr(bench, "_words", reference_words)  # as the one-at-a-time builder made it
    assert bench.few_shot_prompt(slow_rng, FakeTokenizer(), 8, 1500) == fast


def test_tokenize_all_keeps_order() -> None:
    texts = [f"text {i}" * (i % 5) for i in range(40)]
    tok = FakeTokenizer()
    assert bench.tokenize_all(tok, texts) == [tok.tokenize(t) for t in texts]
