"""Loading a model folder's Hugging Face tokenizer (or a GGUF file's) and its end-of-sequence ids."""

from __future__ import annotations

import os
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from pagoda.json_input import read_json_object
from pagoda.quant.gguf_file import is_gguf_path
from pagoda.tokenizer.gguf import gguf_eos_token_ids, load_gguf_tokenizer

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(model_dir: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """Loads the fast tokenizer saved in ``model_dir`` (or described by a ``.gguf`` file), without
    network access."""
    if is_gguf_path(model_dir):
        return load_gguf_tokenizer(model_dir)
    path = Path(model_dir)
    if not path.is_dir():
        raise ValueError(f"tokenizer folder {str(model_dir)!r} does not exist or is not a folder")
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise ValueError(f"no tokenizer in {str(model_dir)!r}: expected one of {', '.join(_TOKENIZER_FILES)}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # transformers raises many types (OSError, KeyError, ...) for a broken folder
        raise ValueError(f"could not load a tokenizer from {str(model_dir)!r}: {exc}") from exc
    if not getattr(tokenizer, "is_fast", False) or getattr(tokenizer, "backend_tokenizer", None) is None:
        raise ValueError(
            f"the tokenizer in {str(model_dir)!r} is not a fast (tokenizers-backed) tokenizer; "
            "save it with a tokenizer.json"
        )
    return tokenizer


def check_same_tokenizer(target: PreTrainedTokenizerBase, draft: PreTrainedTokenizerBase, what: str) -> None:
    """ValueError unless `draft` maps the same strings to the same ids as `target`, special tokens
    included (a draft model's tokens are the target's tokens)."""
    if target.get_vocab() != draft.get_vocab():
        a, b = target.get_vocab(), draft.get_vocab()
        diff = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])[:3]
        raise ValueError(
            f"{what}: the draft model's tokenizer differs from the target's ({len(b)} vs {len(a)} "
            f"tokens; e.g. {diff}); a draft must share the target's tokenizer"
        )
    special_a = dict(zip(target.all_special_tokens, target.all_special_ids, strict=True))
    special_b = dict(zip(draft.all_special_tokens, draft.all_special_ids, strict=True))
    if special_a != special_b:
        raise ValueError(
            f"{what}: the draft model's special tokens {special_b} differ from the target's {special_a}"
        )


def eos_token_ids(tokenizer: PreTrainedTokenizerBase, model_dir: str | os.PathLike[str]) -> tuple[int, ...]:
    """End-of-sequence ids: generation_config.json's ``eos_token_id`` (int or list), then the tokenizer's;
    for a ``.gguf`` model, the file's end-of-generation tokens (see ``gguf_eos_token_ids``)."""
    if is_gguf_path(model_dir):
        return gguf_eos_token_ids(model_dir, tokenizer)
    ids: list[int] = []
    gen_path = Path(model_dir) / "generation_config.json"
    if gen_path.is_file():
        value = read_json_object(gen_path).get("eos_token_id")
        values = value if isinstance(value, list) else [] if value is None else [value]
        for v in values:
            if not _is_token_id(v):
                raise ValueError(
                    f"eos_token_id in {gen_path.name} must be a non-negative integer or a list of them, got {value!r}"
                )
            ids.append(v)
    tok_eos = tokenizer.eos_token_id
    if tok_eos is not None:
        ids.append(tok_eos)
    return tuple(dict.fromkeys(ids))


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
