"""HeadTokenizer: texts continuing a head get exactly the ids of a whole tokenization."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from pagoda.models.synthetic import build_byte_level_tokenizer
from pagoda.tokenizer.continuation import HeadTokenizer, splices_exactly

WORDS = ["the", "and", "yes", "no", "maybe", "unknown", "Answer:", "Question:", "café", "naïve", "你好"]
TAILS = [
    " yes",
    " no",
    " maybe",
    " unknown",
    "yes",
    "\n",
    " \n\nQ",
    "e\u0301",
    "'s",
    "  ",
    "<|im_end|>",
    "12345",
    "",
]


def _saved_and_loaded(tmp_path, tokenizer: PreTrainedTokenizerFast) -> PreTrainedTokenizerFast:
    tokenizer.save_pretrained(tmp_path)
    return PreTrainedTokenizerFast.from_pretrained(tmp_path)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> PreTrainedTokenizerFast:
    """The synthetic models' tokenizer as a server loads it (a Split regex then byte level)."""
    return _saved_and_loaded(tmp_path_factory.mktemp("tok"), build_byte_level_tokenizer())


def _gpt2_style() -> PreTrainedTokenizerFast:
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def _texts(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 30)):
            parts.append(rng.choice(WORDS))
            parts.append(rng.choice([" ", " ", "\n", "\n\n", "  ", ": ", "\nQuestion: ", "\n "]))
        out.append("".join(parts) + rng.choice(["\nAnswer:", "\nA", "", "\n", " x\nb"]))
    return out


def test_the_synthetic_and_gpt2_pipelines_splice():
    assert splices_exactly(build_byte_level_tokenizer())
    assert splices_exactly(_gpt2_style())


def test_other_pipelines_tokenize_whole():
    """A normalizer or pre-tokenizer the splice is not proven for: every text tokenized whole."""
    tok = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "\u2581": 2}, merges=[], unk_token=None))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    assert not splices_exactly(fast)
    head = HeadTokenizer(fast, "ab\nab")
    assert not head.splices
    assert head.ids("ab\nab b") == fast("ab\nab b")["input_ids"]


@pytest.mark.parametrize("which", ["synthetic", "gpt2"])
def test_spliced_ids_are_the_whole_tokenization(which, synthetic):
    tokenizer = synthetic if which == "synthetic" else _gpt2_style()
    spliced = 0
    for head in _texts(0, 150):
        h = HeadTokenizer(tokenizer, head)
        spliced += h.splices
        assert h.head_ids == tokenizer(head)["input_ids"]
        for tail in TAILS:
            assert h.ids(head + tail) == tokenizer(head + tail)["input_ids"], (head, tail)
        other = "Q" + head  # not a continuation: tokenized whole
        assert h.ids(other) == tokenizer(other)["input_ids"]
    assert spliced > 100


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    head=st.text(st.sampled_from(list("ab \n\t:.'sé\u0301你😀A1")), max_size=40),
    tail=st.text(st.sampled_from(list("ab \n\t:.'sé\u0301你😀A1")), max_size=8),
)
def test_spliced_ids_on_any_text(synthetic, head, tail):
    h = HeadTokenizer(synthetic, head)
    assert h.ids(head + tail) == synthetic(head + tail)["input_ids"]
