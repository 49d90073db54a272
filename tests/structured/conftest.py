"""Fixtures of the structured-output tests: one tokenizer and grammar manager for the package."""

from __future__ import annotations

import pytest
from grammar_helpers import MODEL_VOCAB, TOKENIZER_VOCAB, build_tokenizer
from transformers import PreTrainedTokenizerFast

from pagoda.structured import GrammarManager


@pytest.fixture(scope="package")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerFast:
    tok = build_tokenizer(tmp_path_factory.mktemp("bpe"))
    assert len(tok) == TOKENIZER_VOCAB < MODEL_VOCAB
    return tok


@pytest.fixture(scope="package")
def manager(tokenizer: PreTrainedTokenizerFast):
    mgr = GrammarManager.from_tokenizer(tokenizer, vocab_size=MODEL_VOCAB)
    # One token per byte value, so that any byte sequence, valid UTF-8 or not, can be generated.
    assert set(mgr.backend.token_bytes) >= {bytes([b]) for b in range(256)}
    yield mgr
    mgr.shutdown()
