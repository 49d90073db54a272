"""Shared helpers of the grammar-layer tests: a small byte-level BPE tokenizer and mask decoding."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from pagoda.structured import GrammarManager

EOS = "<|endoftext|>"
TOKENIZER_VOCAB = 400
MODEL_VOCAB = 448  # lm_head rows: more than the tokenizer's vocabulary, as in padded real models

_CORPUS = [
    '{"name": "Alice", "age": 30, "tags": ["a", "b"], "address": {"street": "Main St", "city": "Paris"}}',
    '{"id": 12, "valid": true, "score": -0.5e3, "items": [{"sku": "AB-123", "qty": 2}], "note": null}',
    "The quick brown fox jumps over the lazy dog; jumping foxes are quicker than dogs. 0123456789",
    "user@example.com admin@pagoda.org false true null key value string number integer",
]


def build_tokenizer(directory: Path, vocab_size: int = TOKENIZER_VOCAB) -> PreTrainedTokenizerFast:
    """A byte-level BPE (256 byte tokens + merges + an EOS special token) saved as a HF folder."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS).save_pretrained(str(directory))
    return AutoTokenizer.from_pretrained(str(directory))


def allowed_ids(bitmask: torch.Tensor, row: int = 0) -> np.ndarray:
    words = bitmask[row].numpy().view(np.uint32)
    bits = (words[:, None] >> np.arange(32, dtype=np.uint32)) & 1
    return np.nonzero(bits.reshape(-1))[0]


def utf8(data: bytes) -> str:
    return data.decode("utf-8")  # strict: no surrogates, overlong forms or stray bytes


# Every valid UTF-8 prefix becomes valid text with one of these appended (the second byte of a character
# is 80, 90 or A0 at the lowest; later ones 80).
_COMPLETIONS = [b""] + [first + b"\x80" * k for first in (b"\x80", b"\x90", b"\xa0") for k in range(3)]


@functools.lru_cache(maxsize=1 << 16)
def valid_utf8_prefix(data: bytes) -> bool:
    """Whether ``data`` is valid UTF-8 or the start of it. (Python's incremental decoder can't tell: it
    accepts b"\\xed\\xa0", the start of a surrogate, as an unfinished character.)"""
    for completion in _COMPLETIONS:
        try:
            (data + completion).decode("utf-8")
        except UnicodeDecodeError:
            continue
        return True
    return False


def text_of(manager: GrammarManager, ids: list[int]) -> str:
    return utf8(b"".join(manager.backend.token_bytes[t] for t in ids))


JSON_SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 6}, "zip": {"type": "integer"}},
                "required": ["city", "zip"],
            },
        },
        "required": ["name", "address"],
    },
    "array_enum": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue", 7, None]}, "maxItems": 4},
            "mode": {"const": "fast"},
        },
        "required": ["tags", "mode"],
    },
    "numbers": {
        "type": "object",
        "properties": {
            "count": {"type": "integer", "minimum": -5, "maximum": 120},
            "ratio": {"type": "number"},
            "ok": {"type": "boolean"},
        },
        "required": ["count", "ratio", "ok"],
    },
    "optional_fields": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "nickname": {"type": "string", "maxLength": 5},
            "extra": {"type": ["string", "null"], "maxLength": 4},
        },
        "required": ["id"],
    },
    "string_pattern": {
        "type": "object",
        "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
            "email": {"type": "string", "pattern": "^[a-z]{1,6}@[a-z]{1,6}\\.(com|org)$"},
        },
        "required": ["sku", "email"],
    },
    "array_of_objects_ref": {
        "type": "array",
        "items": {"$ref": "#/$defs/point"},
        "minItems": 1,
        "maxItems": 3,
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                "required": ["x", "y"],
            }
        },
    },
    "any_of": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}, {"type": "null"}]},
    "free_text": {
        "type": "object",
        "properties": {
            "note": {"type": "string"},
            "code": {"type": "string", "pattern": "^[^,]{1,6}$"},
        },
        "required": ["note", "code"],
    },
    "pattern_keys": {
        "type": "object",
        "patternProperties": {"^[^,]{1,4}$": {"type": "integer"}},
        "additionalProperties": False,
    },
    "property_names": {
        "type": "object",
        "propertyNames": {"pattern": "^[^,]{1,4}$"},
        "additionalProperties": {"type": "boolean"},
    },
}

REGEXES = [
    r"[0-9]{3}-[a-z]+",
    r"(cat|dog|bird)s?( and (cat|dog|bird)s?)*",
    r"[a-z]{1,8}@[a-z]{1,8}\.(com|org|net)",
    r"-?(0|[1-9][0-9]{0,5})(\.[0-9]{1,3})?",
    r"[A-Fa-f0-9]{8}",
    r"héllo (wörld|мир|世界)!",
    # Classes that take in U+D800-U+DFFF in xgrammar unless rewritten; Python reads them alike here.
    r".{1,6}",
    r"[^a-z]{2,5}",
    r"x[\u0080-\U0010ffff]{1,3}",
    r"\W{1,4}",
    r"<[\s\S]{0,4}>",
]
