"""Hugging Face tokenizer loading, chat templates, incremental detokenization and stop strings."""

from pagoda.tokenizer.chat import apply_chat_template, chat_template_text, validate_messages
from pagoda.tokenizer.detokenizer import IncrementalDetokenizer
from pagoda.tokenizer.loader import check_same_tokenizer, eos_token_ids, load_tokenizer
from pagoda.tokenizer.output_text import OutputTextState
from pagoda.tokenizer.stop import StopStringChecker

__all__ = [
    "IncrementalDetokenizer",
    "OutputTextState",
    "StopStringChecker",
    "apply_chat_template",
    "chat_template_text",
    "check_same_tokenizer",
    "eos_token_ids",
    "load_tokenizer",
    "validate_messages",
]
