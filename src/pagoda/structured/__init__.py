"""Structured output: grammar backends behind one small interface, batch bitmask, jump-forward."""

from pagoda.structured.interface import CompiledGrammar, GrammarBackend, GrammarMatcher
from pagoda.structured.jump_forward import JumpForward
from pagoda.structured.manager import GrammarConfig, GrammarManager
from pagoda.structured.spec import choice_grammar, parse_json_schema, spec_key
from pagoda.structured.xgrammar_backend import XGrammarBackend

__all__ = [
    "CompiledGrammar",
    "GrammarBackend",
    "GrammarConfig",
    "GrammarManager",
    "GrammarMatcher",
    "JumpForward",
    "XGrammarBackend",
    "choice_grammar",
    "parse_json_schema",
    "spec_key",
]
