"""Benchmark prompts, shared by the serving (HTTP) and offline (in-process) benchmarks.

Every dataset yields `BenchRequest`s. A request carries its prompt as text (what an HTTP client sends) and,
when a tokenizer is available, as token ids (what the offline benchmark feeds the engine): the ids are always
the tokenization of `completion_prompt()` without special tokens, so both forms say the same thing.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATASET_NAMES = ("random", "sharegpt", "shared-prefix", "multi-turn")

DEFAULT_INPUT_LEN = {"random": 1024, "shared-prefix": 128, "multi-turn": 128}
DEFAULT_OUTPUT_LEN = 128
DEFAULT_PREFIX_LEN = 1024
DEFAULT_NUM_GROUPS = 4
DEFAULT_NUM_TURNS = 3

# Re-tokenizing decoded random ids can merge or split tokens; a few rounds of trimming / topping up converge.
_MAX_LENGTH_ADJUSTMENTS = 8

# Words for prompts when no tokenizer is available: then lengths are counted in words, and token counts come
# from the server's usage.
_WORDS = (  # noqa: SIM905 (one string reads better than a hundred list items)
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city community "
    "name president team minute idea kid body information back parent face others level office door "
    "health person art war history party result change morning reason research girl guy moment air "
    "teacher force education river mountain garden window bridge market train letter music paper light "
    "stone bread"
).split()


@dataclass(frozen=True)
class BenchRequest:
    """One benchmark request (for multi-turn: one turn of one conversation).

    `prompt` is this request's own user text; `system_prompt` is the shared prefix of a shared-prefix group.
    `prompt_len` / `prompt_token_ids` describe `completion_prompt()` and are None without a tokenizer, and for
    multi-turn turns after the first, whose prompt holds answers known only at run time.
    """

    prompt: str
    output_len: int
    prompt_len: int | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    system_prompt: str | None = None
    group_id: int | None = None
    conversation_id: int | None = None
    turn_index: int = 0

    def __post_init__(self) -> None:
        if self.output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {self.output_len}")
        if self.turn_index < 0:
            raise ValueError(f"turn_index must be >= 0, got {self.turn_index}")
        if self.prompt_token_ids is not None and self.prompt_len != len(self.prompt_token_ids):
            raise ValueError("prompt_len must equal len(prompt_token_ids)")

    def completion_prompt(self, history: Sequence[tuple[str, str]] = ()) -> str:
        """The prompt for /v1/completions: system prompt, earlier (user, answer) pairs, then this turn."""
        parts = [] if self.system_prompt is None else [self.system_prompt]
        for user, answer in history:
            parts += [user, answer]
        parts.append(self.prompt)
        return "\n".join(parts)

    def chat_messages(self, history: Sequence[tuple[str, str]] = ()) -> list[dict[str, str]]:
        """The messages for /v1/chat/completions, with earlier (user, answer) pairs resent."""
        messages = [] if self.system_prompt is None else [{"role": "system", "content": self.system_prompt}]
        for user, answer in history:
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        messages.append({"role": "user", "content": self.prompt})
        return messages


@dataclass(frozen=True)
class DatasetConfig:
    """Which prompts to make. Options that a dataset does not use must stay None (they are rejected, not ignored).

    num_prompts counts requests, except for multi-turn, where it counts conversations of num_turns requests.
    """

    name: str
    num_prompts: int
    input_len: int | None = None
    output_len: int | None = None
    seed: int = 0
    dataset_path: str | None = None
    random_range_ratio: float | None = None
    prefix_len: int | None = None
    num_groups: int | None = None
    num_turns: int | None = None

    def __post_init__(self) -> None:
        if self.name not in DATASET_NAMES:
            raise ValueError(f"unknown dataset {self.name!r}; choose one of {', '.join(DATASET_NAMES)}")
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        for field_name in ("input_len", "output_len", "prefix_len", "num_groups", "num_turns"):
            value = getattr(self, field_name)
            if value is not None and value < 1:
                raise ValueError(f"{field_name} must be >= 1, got {value}")
        if self.random_range_ratio is not None and not 0.0 <= self.random_range_ratio < 1.0:
            raise ValueError(f"random_range_ratio must be in [0, 1), got {self.random_range_ratio}")
        if self.name == "sharegpt" and self.dataset_path is None:
            raise ValueError("the sharegpt dataset needs a dataset_path (a ShareGPT-format JSON file)")
        uses = {
            "dataset_path": ("sharegpt", "multi-turn"),
            "random_range_ratio": ("random",),
            "prefix_len": ("shared-prefix",),
            "num_groups": ("shared-prefix",),
            "num_turns": ("multi-turn",),
            "input_len": ("random", "shared-prefix", "multi-turn"),
        }
        for field_name, datasets in uses.items():
            if getattr(self, field_name) is not None and self.name not in datasets:
                raise ValueError(f"{field_name} does not apply to the {self.name} dataset")
        if self.name == "multi-turn" and self.dataset_path is not None and self.input_len is not None:
            raise ValueError("input_len does not apply to multi-turn prompts read from a dataset file")
        if self.name == "shared-prefix" and self.num_prompts < (self.num_groups or DEFAULT_NUM_GROUPS):
            raise ValueError(
                f"num_prompts ({self.num_prompts}) must be >= the number of groups "
                f"({self.num_groups or DEFAULT_NUM_GROUPS})"
            )


def load_tokenizer(name_or_path: str) -> Any:
    """A Hugging Face tokenizer from a local directory or the local cache; never downloads."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name_or_path, local_files_only=True)
    except (
        OSError,
        ValueError,
        KeyError,
        TypeError,
    ) as exc:  # what transformers raises for missing or bad files
        raise ValueError(f"no tokenizer found locally for {name_or_path!r}: {exc}") from exc


def sample_requests(config: DatasetConfig, tokenizer: Any | None = None) -> list[BenchRequest]:
    """Make the dataset's requests, reproducibly from config.seed. Without a tokenizer, lengths are in words."""
    rng = random.Random(config.seed)
    if config.name == "random":
        return _random_requests(config, tokenizer, rng)
    if config.name == "sharegpt":
        return _sharegpt_requests(config, tokenizer, rng)
    if config.name == "shared-prefix":
        return _shared_prefix_requests(config, tokenizer, rng)
    return _multi_turn_requests(config, tokenizer, rng)


class _TextSampler:
    """Random text of a given length: token ids from the vocabulary (no special or added tokens), or words."""

    def __init__(self, tokenizer: Any | None, rng: random.Random) -> None:
        self._tokenizer = tokenizer
        self._rng = rng
        if tokenizer is not None:
            excluded = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
            candidates = [i for i in range(len(tokenizer)) if i not in excluded]
            # Byte-level vocabularies hold fragments of multi-byte characters, which decode alone to U+FFFD and
            # re-encode as other tokens; sampling only tokens that are text by themselves keeps lengths stable.
            backend = getattr(tokenizer, "backend_tokenizer", None)  # the Rust tokenizer decodes in bulk fast
            decode_batch = tokenizer.batch_decode if backend is None else backend.decode_batch
            texts = decode_batch([[i] for i in candidates])
            self._token_ids = [
                i for i, text in zip(candidates, texts, strict=True) if text and "\ufffd" not in text
            ]
            if not self._token_ids:
                raise ValueError(
                    "the tokenizer has no ordinary (non-special, whole-character) tokens to sample"
                )

    def text(self, length: int) -> str:
        if self._tokenizer is None:
            return " ".join(self._rng.choices(_WORDS, k=length))
        tok = self._tokenizer
        ids = self._rng.choices(self._token_ids, k=length)
        for _ in range(_MAX_LENGTH_ADJUSTMENTS):
            text = tok.decode(ids)
            reencoded = tok.encode(text, add_special_tokens=False)
            if len(reencoded) == length:
                return text
            ids = reencoded[:length] + self._rng.choices(self._token_ids, k=max(0, length - len(reencoded)))
        return tok.decode(ids)  # close to `length`; BenchRequest.prompt_len records the true count


def _with_token_ids(request: BenchRequest, tokenizer: Any | None) -> BenchRequest:
    if tokenizer is None:
        return request
    ids = tuple(tokenizer.encode(request.completion_prompt(), add_special_tokens=False))
    return BenchRequest(
        prompt=request.prompt,
        output_len=request.output_len,
        prompt_len=len(ids),
        prompt_token_ids=ids,
        system_prompt=request.system_prompt,
        group_id=request.group_id,
        conversation_id=request.conversation_id,
        turn_index=request.turn_index,
    )


def _random_requests(config: DatasetConfig, tokenizer: Any | None, rng: random.Random) -> list[BenchRequest]:
    sampler = _TextSampler(tokenizer, rng)
    input_len = config.input_len or DEFAULT_INPUT_LEN["random"]
    output_len = config.output_len or DEFAULT_OUTPUT_LEN
    ratio = config.random_range_ratio or 0.0

    def vary(length: int) -> int:
        return max(1, rng.randint(math.floor(length * (1 - ratio)), math.ceil(length * (1 + ratio))))

    requests = []
    for _ in range(config.num_prompts):
        request = BenchRequest(prompt=sampler.text(vary(input_len)), output_len=vary(output_len))
        requests.append(_with_token_ids(request, tokenizer))
    return requests


def _shared_prefix_requests(
    config: DatasetConfig, tokenizer: Any | None, rng: random.Random
) -> list[BenchRequest]:
    sampler = _TextSampler(tokenizer, rng)
    num_groups = config.num_groups or DEFAULT_NUM_GROUPS
    prefixes = [sampler.text(config.prefix_len or DEFAULT_PREFIX_LEN) for _ in range(num_groups)]
    question_len = config.input_len or DEFAULT_INPUT_LEN["shared-prefix"]
    output_len = config.output_len or DEFAULT_OUTPUT_LEN
    # Groups take turns so that each group's requests are spread over the whole run.
    requests = [
        BenchRequest(
            prompt=sampler.text(question_len),
            output_len=output_len,
            system_prompt=prefixes[i % num_groups],
            group_id=i % num_groups,
        )
        for i in range(config.num_prompts)
    ]
    return [_with_token_ids(r, tokenizer) for r in requests]


def _multi_turn_requests(
    config: DatasetConfig, tokenizer: Any | None, rng: random.Random
) -> list[BenchRequest]:
    output_len = config.output_len or DEFAULT_OUTPUT_LEN
    if config.dataset_path is not None:
        conversations = [turns for turns, _ in _read_sharegpt(config.dataset_path) if turns]
        rng.shuffle(conversations)
        if len(conversations) < config.num_prompts:
            raise ValueError(
                f"{config.dataset_path} has {len(conversations)} usable conversations, "
                f"fewer than the {config.num_prompts} requested"
            )
        user_turns = [turns[: config.num_turns or None] for turns in conversations[: config.num_prompts]]
    else:
        sampler = _TextSampler(tokenizer, rng)
        turn_len = config.input_len or DEFAULT_INPUT_LEN["multi-turn"]
        num_turns = config.num_turns or DEFAULT_NUM_TURNS
        user_turns = [[sampler.text(turn_len) for _ in range(num_turns)] for _ in range(config.num_prompts)]
    requests = []
    for conversation_id, turns in enumerate(user_turns):
        for turn_index, text in enumerate(turns):
            request = BenchRequest(
                prompt=text, output_len=output_len, conversation_id=conversation_id, turn_index=turn_index
            )
            requests.append(_with_token_ids(request, tokenizer) if turn_index == 0 else request)
    return requests


_USER_ROLES = ("human", "user")
_ASSISTANT_ROLES = ("gpt", "assistant", "chatgpt", "bard", "model")


def _read_sharegpt(path: str) -> list[tuple[list[str], list[str]]]:
    """(user turns, assistant turns) of each conversation in a ShareGPT-format JSON file."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"dataset file {path!r} does not exist")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"dataset file {path!r} is not valid JSON: {exc}") from exc
    if not isinstance(data, list):
        raise ValueError(f"dataset file {path!r} must hold a JSON list of conversations")
    conversations = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list):
            raise ValueError(
                f"dataset file {path!r}: each entry needs a 'conversations' list (ShareGPT format)"
            )
        users, answers = [], []
        for turn in turns:
            if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
                raise ValueError(f"dataset file {path!r}: each turn needs 'from' and a string 'value'")
            role = str(turn.get("from", "")).lower()
            if role in _USER_ROLES and turn["value"].strip():
                users.append(turn["value"])
            elif role in _ASSISTANT_ROLES and len(answers) < len(users):
                answers.append(turn["value"])
        conversations.append((users, answers))
    return conversations


def _sharegpt_requests(
    config: DatasetConfig, tokenizer: Any | None, rng: random.Random
) -> list[BenchRequest]:
    if config.output_len is None and tokenizer is None:
        raise ValueError(
            "sharegpt output lengths come from the reference answers, which needs a tokenizer; "
            "pass a tokenizer or a fixed output_len"
        )
    pairs = [(users[0], answers[0]) for users, answers in _read_sharegpt(str(config.dataset_path)) if answers]
    rng.shuffle(pairs)
    requests = []
    for prompt, answer in pairs:
        if len(requests) == config.num_prompts:
            break
        if config.output_len is not None:
            output_len = config.output_len
        else:
            output_len = len(tokenizer.encode(answer, add_special_tokens=False))
            if output_len < 1:
                continue
        requests.append(_with_token_ids(BenchRequest(prompt=prompt, output_len=output_len), tokenizer))
    if len(requests) < config.num_prompts:
        raise ValueError(
            f"{config.dataset_path} has {len(requests)} usable conversations (a user turn followed by an "
            f"answer), fewer than the {config.num_prompts} requested"
        )
    return requests
