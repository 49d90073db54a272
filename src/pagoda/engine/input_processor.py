"""Turns a user prompt into validated token ids."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from transformers import PreTrainedTokenizerBase

# A text, token ids, or vLLM's dict forms: {"prompt": text} and {"prompt_token_ids": [ids]}.
Prompt = str | Sequence[int] | Mapping[str, object]
_PROMPT_KEYS = {"prompt": str, "prompt_token_ids": list}


def normalize_prompt(prompt: Prompt) -> str | Sequence[int]:
    """vLLM's dict prompts as the text or token ids they hold; anything else is returned as is.
    A dict with another key, both keys or a wrong type is a ValueError naming it."""
    if not isinstance(prompt, Mapping):
        return prompt
    unknown = sorted(set(prompt) - set(_PROMPT_KEYS))
    if unknown:
        raise ValueError(
            f"a prompt dict takes 'prompt' (text) or 'prompt_token_ids' (a list of token ids); "
            f"{', '.join(map(repr, unknown))} is not supported"
        )
    if len(prompt) != 1:
        raise ValueError("a prompt dict needs exactly one of 'prompt' and 'prompt_token_ids'")
    ((key, value),) = prompt.items()
    if not isinstance(value, _PROMPT_KEYS[key]):
        kind = "a string" if key == "prompt" else "a list of token ids"
        raise ValueError(f"prompt dict: {key!r} must be {kind}, got {type(value).__name__}")
    return value


def tokenize_prompt(
    tokenizer: PreTrainedTokenizerBase, prompt: Prompt, vocab_size: int, max_model_len: int
) -> tuple[str | None, list[int]]:
    """Returns (prompt text or None, token ids). Raises ValueError naming what is wrong."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("the prompt is empty")
        text: str | None = prompt
        token_ids = tokenizer(prompt)["input_ids"]
    elif isinstance(prompt, Sequence) and not isinstance(prompt, bytes | bytearray):
        text = None
        token_ids = list(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty")
        # One pass over the types and min / max for the common case (a select's long prompts
        # come several times a request); the slow loop only to name a bad id.
        if not (
            all(type(t) is int for t in token_ids) and min(token_ids) >= 0 and max(token_ids) < vocab_size
        ):
            for t in token_ids:
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
                    raise ValueError(f"prompt token id {t!r} is not an integer in [0, {vocab_size})")
    else:
        raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    if not token_ids:
        raise ValueError("the prompt tokenizes to no tokens")
    if len(token_ids) >= max_model_len:
        raise ValueError(
            f"the prompt has {len(token_ids)} tokens, but max_model_len is {max_model_len} "
            "(room is needed for at least one generated token)"
        )
    return text, token_ids
