"""Tokenizers and GGUF files: build one from a file's `tokenizer.ggml.*` metadata (transformers
does it), read its end-of-generation ids, and write a Hugging Face tokenizer into a new file the
way llama.cpp's converter does.

Byte-level BPE vocabularies (`tokenizer.ggml.model = "gpt2"`: Qwen, Llama 3, GPT-2 style) and
sentencepiece-style ones (`"llama"`: Llama 2, Mistral) are written; `tokenizer.ggml.pre` names
the pre-tokenizer by the split regex the tokenizer uses.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from pagoda.json_input import read_json_object
from pagoda.quant.gguf_file import GGUFFile

# Control tokens llama.cpp also treats as end of generation (besides eos / eot / eom ids).
_END_OF_GENERATION_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "<|end_of_text|>",
    "<|return|>",
    "<|call|>",
)

# The Split regexes of known byte-level pre-tokenizers → llama.cpp's `tokenizer.ggml.pre` name.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS = {_LLAMA3_SPLIT: "llama-bpe", _QWEN2_SPLIT: "qwen2"}


def load_gguf_tokenizer(path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """The fast tokenizer a GGUF file describes, with its chat template."""
    file = Path(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(file.parent), gguf_file=file.name, local_files_only=True
        )
    except Exception as exc:  # transformers raises many types for files it cannot convert
        raise ValueError(f"could not build a tokenizer from GGUF file {str(file)!r}: {exc}") from exc
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise ValueError(f"the tokenizer of GGUF file {str(file)!r} is not a fast tokenizer")
    return tokenizer


def gguf_eos_token_ids(path: str | os.PathLike[str], tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """End-of-generation ids as llama.cpp takes them: eos, eot and eom ids, and control tokens
    whose text marks the end of a turn."""
    f = GGUFFile(path)
    ids: list[int] = []
    for key in ("eos", "eot", "eom"):
        value = f.get(f"tokenizer.ggml.{key}_token_id")
        if isinstance(value, int) and value >= 0:
            ids.append(value)
    types = f.get("tokenizer.ggml.token_type") or []
    tokens = f.get("tokenizer.ggml.tokens") or []
    for index, (token, token_type) in enumerate(zip(tokens, types, strict=False)):
        if token_type == gguf.TokenType.CONTROL and token in _END_OF_GENERATION_TEXTS:
            ids.append(index)
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(ids))


# ---- writing ------------------------------------------------------------------------------------
def _pre_tokenizer_name(pre: dict | None) -> str:
    """llama.cpp's name for a byte-level pre-tokenizer, from its tokenizer.json entry."""
    if pre is None:
        raise ValueError("the tokenizer has no pre-tokenizer; llama.cpp needs to know how it splits text")
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    if pre.get("type") == "Sequence":
        steps = pre.get("pretokenizers", [])
        splits = [s for s in steps if s.get("type") == "Split"]
        byte_level = [s for s in steps if s.get("type") == "ByteLevel"]
        if len(splits) == 1 and len(byte_level) == 1 and not byte_level[0].get("use_regex", True):
            regex = splits[0].get("pattern", {}).get("Regex")
            if regex in _PRE_TOKENIZER_SPLITS:
                return _PRE_TOKENIZER_SPLITS[regex]
    raise ValueError(
        f"pre-tokenizer {json.dumps(pre)[:200]} is not one llama.cpp names (gpt-2, llama-bpe, qwen2)"
    )


def add_tokenizer_to_gguf(
    writer: gguf.GGUFWriter, tokenizer_dir: str | os.PathLike[str], vocab_size: int
) -> None:
    """Write the tokenizer in `tokenizer_dir` (a Hugging Face folder with tokenizer.json) as
    `tokenizer.ggml.*` metadata for a model with `vocab_size` embedding rows."""
    folder = Path(tokenizer_dir)
    tokenizer_json = folder / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise ValueError(f"no tokenizer.json in {str(folder)!r}: pagoda quantize writes fast tokenizers only")
    spec = read_json_object(tokenizer_json)
    model_type = spec.get("model", {}).get("type")
    if model_type != "BPE":
        raise ValueError(f"tokenizer model {model_type!r} cannot be written to GGUF (BPE only)")
    if spec.get("model", {}).get("byte_fallback"):
        _add_sentencepiece_vocab(writer, folder, vocab_size)
    else:
        _add_byte_level_vocab(writer, folder, spec, vocab_size)
    special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=vocab_size)
    eos = _generation_eos_ids(folder)
    if len(eos) > 1 and "eos" in special.special_token_ids:
        others = [i for i in eos if i != special.special_token_ids["eos"]]
        if len(others) == 1 and others[0] < vocab_size:
            writer.add_eot_token_id(others[0])
    special.add_to_gguf(writer, quiet=True)


def _generation_eos_ids(folder: Path) -> list[int]:
    path = folder / "generation_config.json"
    if not path.is_file():
        return []
    value = read_json_object(path).get("eos_token_id")
    return [v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int)]


def _add_byte_level_vocab(writer: gguf.GGUFWriter, folder: Path, spec: dict, vocab_size: int) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    if len(tokenizer) > vocab_size:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens, more than the model's {vocab_size}")
    added = {entry["id"]: entry for entry in spec.get("added_tokens", [])}
    tokens: list[str] = []
    types: list[int] = []
    for index in range(vocab_size):
        if index >= len(tokenizer):
            tokens.append(f"[PAD{index}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        if index in added:
            entry = added[index]
            tokens.append(entry["content"])
            types.append(gguf.TokenType.CONTROL if entry.get("special") else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(tokenizer.convert_ids_to_tokens(index))
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer_name(spec.get("pre_tokenizer")))
    writer.add_token_list(tokens)
    writer.add_token_types(types)


def _add_sentencepiece_vocab(writer: gguf.GGUFWriter, folder: Path, vocab_size: int) -> None:
    vocab = gguf.LlamaHfVocab(folder)
    tokens, scores, types = [], [], []
    for text, score, token_type in vocab.all_tokens():
        tokens.append(text)
        scores.append(score)
        types.append(token_type)
    if len(tokens) > vocab_size:
        raise ValueError(f"the tokenizer has {len(tokens)} tokens, more than the model's {vocab_size}")
    for index in range(len(tokens), vocab_size):
        tokens.append(f"[PAD{index}]".encode())
        scores.append(-1000.0)
        types.append(gguf.TokenType.UNUSED)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
