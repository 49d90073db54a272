"""Random-weight checkpoints of the supported architectures, for tests and offline benchmarks.

The folder is what a hub download looks like: `config.json`, safetensors weights (optionally
sharded with an index), `generation_config.json` and a byte-level BPE tokenizer with ChatML
special tokens and chat template, all written by transformers / tokenizers themselves.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import GenerationConfig, PreTrainedTokenizerFast

from pagoda.models.registry import supported_architectures

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Words whose byte-level spellings become merges (prefix by prefix), so common text gets
# multi-byte tokens while every other byte sequence still falls back to single bytes.
_MERGE_WORDS = (
    " the", " and", " of", " to", " in", " is", " that", " it", " for", " you", " with", " on",
    " hello", " world", " this", " a", " be", " are", " was", "The", "Hello", "ing", "ed", "er",
    " user", " assistant", " system", "\n\n", "  ", "    ",
)  # fmt: skip

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_byte_level_tokenizer(merge_words: Sequence[str] = ()) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer: 256 byte tokens, a few merges, ChatML specials and template.
    `merge_words` get merges too, so that each becomes one token (as a real BPE vocabulary makes
    common words: e.g. a benchmark's own words, with their leading space)."""
    to_bytes = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    vocab = {char: index for index, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    merges: list[tuple[str, str]] = []
    for word in (*_MERGE_WORDS, *merge_words):
        ((spelled, _),) = to_bytes.pre_tokenize_str(word)
        prefix = spelled[0]
        for char in spelled[1:]:
            if prefix + char not in vocab:
                vocab[prefix + char] = len(vocab)
                merges.append((prefix, char))
            prefix += char
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def build_random_model(
    out_dir: str | Path,
    architecture: str,
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    vocab_size: int,
    tie_word_embeddings: bool,
    dtype: torch.dtype | str,
    shards: int = 1,
    seed: int = 0,
    merge_words: Sequence[str] = (),
    **extra_config: Any,
) -> str:
    """Write a random-weight checkpoint of `architecture` to `out_dir`; returns the folder path.

    Weights come from transformers' own initialization under `seed`; norm weights and biases
    (which transformers initializes to ones and zeros) are randomized too, so that loading
    mistakes change the logits. `extra_config` goes to the HF config class (e.g. `head_dim`,
    `rope_parameters`, `initializer_range`, `max_position_embeddings`). `merge_words`: words the
    tokenizer makes one token each (build_byte_level_tokenizer).
    """
    if architecture not in supported_architectures():
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(supported_architectures())}"
        )
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; supported: {', '.join(_DTYPES)}")
        dtype = _DTYPES[dtype]
    if dtype not in _DTYPES.values():
        raise ValueError(f"unsupported dtype {dtype}; supported: {', '.join(_DTYPES)}")
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")

    tokenizer = build_byte_level_tokenizer(merge_words)
    if vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size ({vocab_size}) is smaller than the tokenizer's {len(tokenizer)} tokens")
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    im_end_id = tokenizer.convert_tokens_to_ids(IM_END)

    model_cls = getattr(transformers, architecture)
    config = model_cls.config_class(
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        **extra_config,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
        _randomize_norms_and_biases(model)
    model = model.to(dtype)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    max_shard_size: int | str = "50GB"
    if shards > 1:
        total_bytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())
        max_shard_size = math.ceil(total_bytes / shards)
    model.save_pretrained(out, max_shard_size=max_shard_size)
    GenerationConfig(
        bos_token_id=None, eos_token_id=[eos_id, im_end_id], pad_token_id=eos_id
    ).save_pretrained(out)
    tokenizer.save_pretrained(out, save_jinja_files=False)
    return str(out)


@torch.no_grad()
def _randomize_norms_and_biases(model: torch.nn.Module) -> None:
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.copy_(1.0 + 0.2 * torch.randn_like(param))
        elif name.endswith(".bias"):
            param.copy_(0.2 * torch.randn_like(param))
