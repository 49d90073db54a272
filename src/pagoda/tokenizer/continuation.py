"""Token ids of texts that continue one head text, with the head tokenized once.

A select scores each choice by the tokens of prompt + choice tokenized whole, so four choices
after a 1,500-token prompt are four 1,500-token tokenizations, where a gen of one token is one.
`HeadTokenizer` gives the same ids (`tokenizer(head + tail)["input_ids"]`) from the head's ids
and a tokenization of the head's last line + tail alone, for the tokenizers where that is exact
by construction (`splices_exactly`), and tokenizes whole otherwise.

Why the splice is exact: the head is cut at a position c just after a newline and before an
ASCII letter. For a `tokenizers` pipeline of
- no normalizer or a Unicode normal form (an ASCII letter is a starter that composes with
  nothing before it, so the text normalizes in two independent parts),
- added tokens with no lstrip / rstrip / single_word and no newline in them (none can span c),
- GPT-2's byte-level pre-tokenizer (its regex) or a Split by the regex of GPT-2, Llama 3 or
  Qwen2 then a byte-level mapping with no prefix space: in these regexes no alternative joins a
  newline to a following letter, so the pre-token holding the newline ends at c, and every match
  before c is decided by characters up to c (a run stops at the first character outside it); a
  match starting at c does not depend on what precedes (no lookbehind, anchors or \\b),
- a BPE model (it tokenizes each pre-token alone), and a post-processor that adds nothing after
  the text,
the ids of head + tail are the head's ids before c followed by those of head[c:] + tail
tokenized without special tokens. As a check, head[c:] alone must tokenize to the head's last
ids (else the head is tokenized whole).
"""

from __future__ import annotations

import json
import string
import weakref
from typing import Any

# The Split regexes of the pre-tokenizers the splice is proven for (GPT-2, Llama 3, Qwen2).
_KNOWN_SPLITS = frozenset(
    {
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    }
)
_NORMAL_FORMS = frozenset({"NFC", "NFD", "NFKC", "NFKD"})
_LETTERS = frozenset(string.ascii_letters)

_exact: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def splices_exactly(tokenizer: Any) -> bool:
    """Whether `tokenizer`'s pipeline is one the module's splice is exact for (worked out once
    per tokenizer object: it reads the whole pipeline, vocabulary included)."""
    result = _exact.get(tokenizer)
    if result is None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        try:
            result = backend is not None and _pipeline_ok(json.loads(backend.to_str()))
        except (ValueError, KeyError, TypeError, AttributeError):
            result = False
        _exact[tokenizer] = result
    return result


def _pipeline_ok(spec: dict) -> bool:
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("dropout") not in (None, 0, 0.0):
        return False
    return (
        _normalizer_ok(spec.get("normalizer"))
        and _pre_tokenizer_ok(spec.get("pre_tokenizer"))
        and _post_processor_ok(spec.get("post_processor"))
        and all(
            not (t.get("lstrip") or t.get("rstrip") or t.get("single_word")) and "\n" not in t["content"]
            for t in spec.get("added_tokens") or []
        )
    )


def _normalizer_ok(n: dict | None) -> bool:
    if n is None:
        return True
    if n.get("type") == "Sequence":
        return all(_normalizer_ok(x) for x in n.get("normalizers", []))
    return n.get("type") in _NORMAL_FORMS


def _pre_tokenizer_ok(p: dict | None) -> bool:
    if p is None:
        return False
    if p.get("type") == "ByteLevel":  # alone: GPT-2's regex inside
        return not p.get("add_prefix_space") and p.get("use_regex", True)
    if p.get("type") != "Sequence":
        return False
    parts = p.get("pretokenizers", [])
    if len(parts) != 2:
        return False
    split, byte_level = parts
    return (
        split.get("type") == "Split"
        and (split.get("pattern") or {}).get("Regex") in _KNOWN_SPLITS
        and split.get("behavior") == "Isolated"
        and not split.get("invert")
        and byte_level.get("type") == "ByteLevel"
        and not byte_level.get("add_prefix_space")
        and not byte_level.get("use_regex", True)
    )


def _post_processor_ok(p: dict | None) -> bool:
    if p is None or p.get("type") == "ByteLevel":
        return True
    if p.get("type") == "Sequence":
        return all(_post_processor_ok(x) for x in p.get("processors", []))
    if p.get("type") == "TemplateProcessing":
        single = p.get("single") or []
        return bool(single) and "Sequence" in single[-1]  # nothing after the text
    return False


def _cut(head: str) -> int | None:
    """The last position just after a newline and before an ASCII letter, if any."""
    j = head.rfind("\n")
    while j >= 0:
        if j + 1 < len(head) and head[j + 1] in _LETTERS:
            return j + 1
        j = head.rfind("\n", 0, j)
    return None


class HeadTokenizer:
    """`tokenizer(text)["input_ids"]` for texts, with those continuing `head` spliced onto the
    head's ids (see the module's doc). Callable as the tokenizer is, for `tokenize_prompt`."""

    def __init__(self, tokenizer: Any, head: str) -> None:
        self._tokenizer = tokenizer
        self.head = head
        self.head_ids: list[int] = list(tokenizer(head)["input_ids"])
        self._base: list[int] = []
        self._window: str | None = None  # head[c:], when the splice is exact
        c = _cut(head) if splices_exactly(tokenizer) else None
        if c is not None:
            window = head[c:]
            ids = self._tail_ids(window)
            n = len(self.head_ids) - len(ids)
            if ids and n >= 0 and self.head_ids[n:] == ids:
                self._base, self._window = self.head_ids[:n], window

    @property
    def splices(self) -> bool:
        """Whether texts continuing the head are spliced (else they are tokenized whole)."""
        return self._window is not None

    def ids(self, text: str) -> list[int]:
        if self._window is not None and text.startswith(self.head):
            return self._base + self._tail_ids(self._window + text[len(self.head) :])
        return list(self._tokenizer(text)["input_ids"])

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": self.ids(text)}

    def _tail_ids(self, text: str) -> list[int]:
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])
