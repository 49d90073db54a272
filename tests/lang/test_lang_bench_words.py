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


def test_vocab_words_make_the_choices_one_token_each() -> None:
    """build_random_model(merge_words=VOCAB_WORDS): select's default choices are one token each
    after the bench's prompt (the byte-level default splits them 3, 3, 6 and 7)."""
    from pagoda.models.synthetic import build_byte_level_tokenizer

    tokenizer = build_byte_level_tokenizer(bench.VOCAB_WORDS)
    base = len(tokenizer("\nAnswer:")["input_ids"])
    assert [len(tokenizer("\nAnswer:" + c)["input_ids"]) - base for c in bench.CHOICES] == [1, 1, 1, 1]
    default = build_byte_level_tokenizer()
    assert [len(default("\nAnswer:" + c)["input_ids"]) - base for c in bench.CHOICES] != [1, 1, 1, 1]
