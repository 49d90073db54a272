"""Grammar backend on xgrammar: compile specs, one matcher per sequence, batched bitmask fill."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from pagoda.sampling_params import StructuredOutputs
from pagoda.structured.dead_ends import check_no_dead_ends
from pagoda.structured.spec import choice_grammar, is_ebnf, parse_json_schema, parse_structural_tag
from pagoda.structured.valid_utf8 import valid_utf8_ebnf, valid_utf8_grammar

# xgrammar errors start with "[hh:mm:ss] /path/file.cc:123: " and sometimes "Check failed: (...) is false: "
# (ours may quote one after some context).
_XGR_ERROR_PREFIX = re.compile(r"\[[\d:]+\]\s+\S+:\d+:\s*(Check failed: .*? is false:\s*)?")


# xgrammar 0.2.9 writes the characters of length-limited JSON strings (minLength / maxLength) as this
# class, which lets raw control characters (tab, 0x00-0x1f) into a string: invalid JSON. We swap in the
# class its unlimited strings use, minus escapes, which it does not allow there either.
_LOOSE_JSON_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\]"


def _json_schema_grammar(schema: dict, any_whitespace: bool, strict_mode: bool) -> xgr.Grammar:
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=any_whitespace, strict_mode=strict_mode)
    # Every JSON string's characters are a negated class, so the text always changes: always reparse.
    ebnf, _ = valid_utf8_ebnf(str(grammar).replace(_LOOSE_JSON_STRING_CHAR, _JSON_STRING_CHAR))
    return xgr.Grammar.from_ebnf(ebnf)


def _clean_error(error: Exception) -> str:
    return _XGR_ERROR_PREFIX.sub("", str(error).strip()) or type(error).__name__


class XGrammarMatcher:
    """One sequence's grammar state, wrapping ``xgrammar.GrammarMatcher``."""

    __slots__ = ("_matcher", "_num_accepted", "_stop_token_ids")

    def __init__(self, compiled: xgr.CompiledGrammar, stop_token_ids: tuple[int, ...]) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)
        self._num_accepted = 0
        self._stop_token_ids = stop_token_ids

    @property
    def num_accepted_tokens(self) -> int:
        return self._num_accepted

    def accept_token(self, token_id: int) -> bool:
        if self._matcher.is_terminated() or not self._matcher.accept_token(token_id):
            return False
        self._num_accepted += 1
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._matcher.is_terminated():
            self._fill_stop_only(bitmask, row)
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)

    def _fill_stop_only(self, bitmask: torch.Tensor, row: int) -> None:
        # xgrammar refuses to fill after the stop token; past the end only stop tokens stay allowed.
        bitmask[row].zero_()
        words = bitmask[row].numpy().view(np.uint32)
        for token_id in self._stop_token_ids:
            words[token_id // 32] |= np.uint32(1 << (token_id % 32))

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        if not isinstance(num_tokens, int) or not 0 <= num_tokens <= self._num_accepted:
            raise ValueError(
                f"cannot roll back {num_tokens!r} tokens: the matcher has accepted {self._num_accepted}"
            )
        if num_tokens:
            self._matcher.rollback(num_tokens)
            self._num_accepted -= num_tokens

    def jump_forward_string(self) -> str:
        if self._matcher.is_terminated():
            return ""
        return self._matcher.find_jump_forward_string()

    def reset(self) -> None:
        self._matcher.reset()
        self._num_accepted = 0


class XGrammarCompiled:
    """A compiled grammar; immutable, shared by all matchers of the requests that use the same spec."""

    __slots__ = ("_compiled", "_stop_token_ids")

    def __init__(self, compiled: xgr.CompiledGrammar, stop_token_ids: tuple[int, ...]) -> None:
        self._compiled = compiled
        self._stop_token_ids = stop_token_ids

    @property
    def memory_size_bytes(self) -> int:
        return self._compiled.memory_size_bytes

    def new_matcher(self) -> XGrammarMatcher:
        return XGrammarMatcher(self._compiled, self._stop_token_ids)


class XGrammarBackend:
    """xgrammar behind the ``GrammarBackend`` interface.

    ``vocab_size`` is the model's (lm_head rows); ids past the tokenizer's vocabulary are never allowed.
    ``eos_token_ids`` are the stop tokens the grammar allows exactly where it may end (default: the
    tokenizer's EOS). ``any_whitespace=False`` makes JSON schemas compact (no free whitespace between
    tokens), which stops models from padding JSON with endless whitespace.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        vocab_size: int | None = None,
        eos_token_ids: Sequence[int] | None = None,
        any_whitespace: bool = True,
        compile_threads: int = 1,
        fill_threads: int = 1,
    ) -> None:
        if vocab_size is not None and (not isinstance(vocab_size, int) or vocab_size <= 0):
            raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
        if compile_threads < 1 or fill_threads < 1:
            raise ValueError(
                f"compile_threads and fill_threads must be >= 1, got {compile_threads} and {fill_threads}"
            )
        if eos_token_ids is None:
            if tokenizer.eos_token_id is None:
                raise ValueError("the tokenizer has no eos_token_id; pass eos_token_ids explicitly")
            eos_token_ids = [tokenizer.eos_token_id]
        stop = tuple(dict.fromkeys(eos_token_ids))
        if not stop or any(not isinstance(t, int) or t < 0 for t in stop):
            raise ValueError(f"eos_token_ids must be a non-empty list of token ids, got {list(stop)}")
        self._info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop)
        )
        if any(not 0 <= t < self._info.vocab_size for t in stop):
            raise ValueError(f"eos_token_ids {list(stop)} must lie in [0, {self._info.vocab_size})")
        self._stop_token_ids = stop
        self._any_whitespace = any_whitespace
        # Our GrammarManager caches by canonical spec, so xgrammar's own cache would only duplicate memory.
        self._compiler = xgr.GrammarCompiler(self._info, max_threads=compile_threads, cache_enabled=False)
        self._batch_matcher = xgr.BatchGrammarMatcher(fill_threads) if fill_threads > 1 else None
        unusable = set(self._info.special_token_ids) | set(stop)
        self._decoded_vocab = tuple(bytes(b) for b in self._info.decoded_vocab)
        self._token_bytes = tuple(b"" if i in unusable else b for i, b in enumerate(self._decoded_vocab))

    @property
    def vocab_size(self) -> int:
        return self._info.vocab_size

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return self._stop_token_ids

    @property
    def token_bytes(self) -> Sequence[bytes]:
        return self._token_bytes

    def compile(self, spec: StructuredOutputs) -> XGrammarCompiled:
        kind = spec.kind
        schema = parse_json_schema(spec.json) if spec.json is not None else None
        if spec.grammar is not None and not is_ebnf(spec.grammar):
            kind = "grammar (read as Lark: it has no '::=' rules)"
        try:
            grammar = self._valid_utf8_grammar(spec, schema)
            if spec.grammar is not None:  # a request's own rules may contain a dead end
                check_no_dead_ends(str(grammar))
            compiled = self._compiler.compile_grammar(grammar)
        except RecursionError:  # RequestLimits bounds nesting; this is the last line of defence
            raise ValueError(f"invalid structured_outputs.{kind}: it is nested too deeply") from None
        except (RuntimeError, TypeError, ValueError) as e:
            raise ValueError(f"invalid structured_outputs.{kind}: {_clean_error(e)}") from None
        result = XGrammarCompiled(compiled, self._stop_token_ids)
        # A grammar with no way to start (e.g. `root ::= a  a ::= root`) would leave the sampler no
        # token at all; refuse it here instead.
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        result.new_matcher().fill_bitmask(bitmask, 0)
        if not bitmask.any():
            raise ValueError(f"invalid structured_outputs.{kind}: it matches no output at all")
        return result

    def _valid_utf8_grammar(self, spec: StructuredOutputs, schema: dict | None) -> xgr.Grammar:
        """The spec's grammar, matching only valid UTF-8 (see ``valid_utf8``)."""
        if spec.structural_tag is not None:
            tag = parse_structural_tag(spec.structural_tag)
            tag = {**tag, "format": self._constraints_as_ebnf(tag["format"])}
            grammar = xgr.Grammar.from_structural_tag(json.dumps(tag))
            return valid_utf8_grammar(grammar, self._decoded_vocab, allow_free_text=True)
        if schema is not None:
            return _json_schema_grammar(schema, self._any_whitespace, strict_mode=True)
        if spec.json_object:
            # Any JSON object (the builtin JSON grammar would also allow a top-level array).
            return _json_schema_grammar({"type": "object"}, self._any_whitespace, strict_mode=False)
        if spec.regex is not None:
            grammar = xgr.Grammar.from_regex(spec.regex)
        elif spec.choice is not None:
            grammar = xgr.Grammar.from_ebnf(choice_grammar(spec.choice))
        elif spec.grammar is None:
            raise ValueError("no constraint is set")  # StructuredOutputs requires exactly one
        elif is_ebnf(spec.grammar):
            grammar = xgr.Grammar.from_ebnf(spec.grammar)
        else:
            grammar = xgr.Grammar.from_lark(spec.grammar, tokenizer_info=self._info)
        return valid_utf8_grammar(grammar, self._decoded_vocab)

    def _constraints_as_ebnf(self, node: Any) -> Any:
        """A structural-tag format with its JSON-schema, regex and grammar parts replaced by the EBNF
        the same spec gets on its own (compact JSON as configured, strict schemas, valid UTF-8), so a
        schema means the same inside a structural tag as in ``response_format``."""
        if isinstance(node, list):
            return [self._constraints_as_ebnf(item) for item in node]
        if not isinstance(node, dict):
            return node
        kind = node.get("type")
        plain = {"type", kind}
        spec: StructuredOutputs | None = None
        json_style = node.get("style", "json") == "json"
        if kind == "json_schema" and json_style and set(node) <= plain | {"json_schema", "style"}:
            schema = node.get("json_schema")
            spec = StructuredOutputs(json={} if schema is True else schema)
        elif kind == "regex" and set(node) <= plain | {"pattern"}:
            spec = StructuredOutputs(regex=node.get("pattern"))
        elif kind == "grammar" and set(node) <= plain | {"grammar", "syntax"}:
            spec = StructuredOutputs(grammar=node.get("grammar"))
        if spec is not None:
            schema = parse_json_schema(spec.json) if spec.json is not None else None
            return {"type": "grammar", "grammar": str(self._valid_utf8_grammar(spec, schema))}
        return {key: self._constraints_as_ebnf(value) for key, value in node.items()}

    def fill_bitmasks(
        self, matchers: Sequence[XGrammarMatcher], bitmask: torch.Tensor, rows: Sequence[int]
    ) -> None:
        if len(matchers) != len(rows):
            raise ValueError(f"got {len(matchers)} matchers for {len(rows)} bitmask rows")
        if self._batch_matcher is None:
            for matcher, row in zip(matchers, rows, strict=True):
                matcher.fill_bitmask(bitmask, row)
            return
        live = [(m, r) for m, r in zip(matchers, rows, strict=True) if not m.is_terminated()]
        for matcher, row in zip(matchers, rows, strict=True):
            if matcher.is_terminated():
                matcher.fill_bitmask(bitmask, row)
        if live:
            self._batch_matcher.batch_fill_next_token_bitmask(
                [m._matcher for m, _ in live], bitmask, [r for _, r in live]
            )
