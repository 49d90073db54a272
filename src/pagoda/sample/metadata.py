"""Per-step sampling metadata: the batch's SamplingParams turned into tensors once per step."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from pagoda.sampling_params import SamplingParams

_SEED_MODULUS = 2**64


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A request's own generator. Any Python int is accepted; it is reduced modulo 2**64."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed % _SEED_MODULUS)
    return generator


@dataclass(frozen=True)
class SamplingRow:
    """What the model runner knows about one row of the logits."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # generated so far
    # The ids that end the sequence (the request's: stop_token_ids and the model's EOS ids unless
    # ignore_eos), banned until min_tokens are generated.
    stop_token_ids: frozenset[int]
    generator: torch.Generator | None = None  # the request's own (seeded); None: the batch's shared one


@dataclass(frozen=True, eq=False)
class TokenUpdate:
    """Sparse (row, token) positions of the logits, with a value for each."""

    rows: torch.Tensor  # [N] int64
    token_ids: torch.Tensor  # [N] int64
    values: torch.Tensor  # [N] float32


@dataclass(frozen=True, eq=False)
class PenaltyTensors:
    """Penalties as sparse updates: only tokens already in a sequence are touched."""

    repetition: TokenUpdate | None  # each distinct (row, prompt-or-output token), values: the penalty
    additive: TokenUpdate | None  # each distinct (row, output token): -(frequency * count + presence)


@dataclass(frozen=True, eq=False)
class RandomRows:
    """The rows that are sampled rather than argmaxed, and what their draw needs. Every tensor here
    is indexed by position among these rows, not by batch row."""

    rows: torch.Tensor  # [R] int64 batch rows, ascending
    is_whole_batch: bool
    temperature: torch.Tensor | None  # [R, 1] float32; None when every row has 1.0
    top_k: torch.Tensor | None  # [R] int64, vocab_size where disabled; None when no row uses it
    max_top_k: int  # largest enabled top_k (0 when none)
    top_p: torch.Tensor | None  # [R] float32, 1.0 where disabled; None when no row uses it
    top_p_within_top_k: bool  # every row with top-p also has top-k: its cut-off is among the top max_top_k
    min_p: torch.Tensor | None  # [R] float32, 0.0 where disabled; None when no row uses it
    shared_positions: torch.Tensor | None  # [S] int64 positions drawing from the shared generator
    seeded: tuple[tuple[int, torch.Generator], ...]  # (position, the row's own generator)


@dataclass(frozen=True, eq=False)
class SamplingMetadata:
    """Tensors for one step's batch. Fields that no row needs are None, so their stage is skipped."""

    num_rows: int
    vocab_size: int
    device: torch.device
    random: RandomRows | None  # None when every row is greedy
    logit_bias: TokenUpdate | None
    penalties: PenaltyTensors | None
    banned: TokenUpdate | None  # stop ids banned by min_tokens (values are -inf)
    logprob_rows: torch.Tensor | None  # [L] int64 batch rows that asked for logprobs, ascending
    num_logprobs: tuple[int, ...]  # N for each logprob row

    @property
    def all_greedy(self) -> bool:
        return self.random is None

    @classmethod
    def build(
        cls, rows: Sequence[SamplingRow], vocab_size: int, device: torch.device | str
    ) -> SamplingMetadata:
        if not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
        device = torch.device(device)
        logprob_rows = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        return cls(
            num_rows=len(rows),
            vocab_size=vocab_size,
            device=device,
            random=_random_rows(rows, vocab_size, device),
            logit_bias=_logit_bias(rows, vocab_size, device),
            penalties=_penalties(rows, vocab_size, device),
            banned=_min_tokens_bans(rows, vocab_size, device),
            logprob_rows=_ints(logprob_rows, device) if logprob_rows else None,
            num_logprobs=tuple(rows[i].params.logprobs or 0 for i in logprob_rows),
        )


def _ints(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _floats(values: Sequence[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _random_rows(rows: Sequence[SamplingRow], vocab_size: int, device: torch.device) -> RandomRows | None:
    picked = [i for i, row in enumerate(rows) if not row.params.greedy]
    if not picked:
        return None
    for i in picked:
        generator = rows[i].generator
        if generator is not None and generator.device.type != device.type:
            raise ValueError(
                f"row {i}: its generator is on {generator.device}, but sampling runs on {device}"
            )
    params = [rows[i].params for i in picked]
    temperatures = [p.temperature for p in params]
    top_ks = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
    enabled_ks = [k for k in top_ks if k < vocab_size]
    top_ps = [p.top_p for p in params]
    min_ps = [p.min_p for p in params]
    shared = [pos for pos, i in enumerate(picked) if rows[i].generator is None]
    return RandomRows(
        rows=_ints(picked, device),
        is_whole_batch=len(picked) == len(rows),
        temperature=_floats(temperatures, device).unsqueeze(1)
        if any(t != 1.0 for t in temperatures)
        else None,
        top_k=_ints(top_ks, device) if enabled_ks else None,
        max_top_k=max(enabled_ks, default=0),
        top_p=_floats(top_ps, device) if any(p < 1.0 for p in top_ps) else None,
        top_p_within_top_k=all(k < vocab_size for k, p in zip(top_ks, top_ps, strict=True) if p < 1.0),
        min_p=_floats(min_ps, device) if any(p > 0.0 for p in min_ps) else None,
        shared_positions=_ints(shared, device) if shared else None,
        seeded=tuple((pos, gen) for pos, i in enumerate(picked) if (gen := rows[i].generator) is not None),
    )


def _check_token(row: int, what: str, token_id: int, vocab_size: int) -> None:
    if not 0 <= token_id < vocab_size:
        raise ValueError(
            f"row {row}: {what} token id {token_id} is outside the vocabulary (size {vocab_size})"
        )


def _logit_bias(rows: Sequence[SamplingRow], vocab_size: int, device: torch.device) -> TokenUpdate | None:
    row_ids: list[int] = []
    token_ids: list[int] = []
    values: list[float] = []
    for i, row in enumerate(rows):
        for token_id, bias in (row.params.logit_bias or {}).items():
            _check_token(i, "logit_bias", token_id, vocab_size)
            row_ids.append(i)
            token_ids.append(token_id)
            values.append(bias)
    if not row_ids:
        return None
    return TokenUpdate(_ints(row_ids, device), _ints(token_ids, device), _floats(values, device))


def _min_tokens_bans(
    rows: Sequence[SamplingRow], vocab_size: int, device: torch.device
) -> TokenUpdate | None:
    row_ids: list[int] = []
    token_ids: list[int] = []
    for i, row in enumerate(rows):
        if len(row.output_token_ids) >= row.params.min_tokens:
            continue
        for token_id in sorted(row.stop_token_ids):
            _check_token(i, "stop", token_id, vocab_size)
            row_ids.append(i)
            token_ids.append(token_id)
    if not row_ids:
        return None
    values = torch.full((len(row_ids),), -math.inf, dtype=torch.float32, device=device)
    return TokenUpdate(_ints(row_ids, device), _ints(token_ids, device), values)


def _distinct_pairs(
    seqs: list[Sequence[int]], positions: list[int], vocab_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Distinct (position, token id) pairs of seqs (seqs[i] belongs to positions[i]), with counts.
    Worked out on the host, where the size of the result is known without a device sync."""
    lengths = [len(s) for s in seqs]
    owners = np.repeat(np.asarray(positions, dtype=np.int64), lengths)
    tokens = np.fromiter(chain.from_iterable(seqs), dtype=np.int64, count=sum(lengths))
    keys, counts = np.unique(owners * vocab_size + tokens, return_counts=True)
    return keys // vocab_size, keys % vocab_size, counts


def _update(
    rows: list[int], positions: np.ndarray, token_ids: np.ndarray, values: np.ndarray, device: torch.device
) -> TokenUpdate:
    """positions index into rows (the batch rows concerned)."""
    return TokenUpdate(
        rows=torch.from_numpy(np.asarray(rows, dtype=np.int64)[positions]).to(device),
        token_ids=torch.from_numpy(token_ids).to(device),
        values=torch.from_numpy(values.astype(np.float32)).to(device),
    )


def _penalties(rows: Sequence[SamplingRow], vocab_size: int, device: torch.device) -> PenaltyTensors | None:
    repeating = [i for i, row in enumerate(rows) if row.params.repetition_penalty != 1.0]
    additive = [
        i
        for i, row in enumerate(rows)
        if row.params.presence_penalty != 0.0 or row.params.frequency_penalty != 0.0
    ]
    repetition_update = None
    if repeating:
        seqs = [rows[i].prompt_token_ids for i in repeating] + [rows[i].output_token_ids for i in repeating]
        positions, token_ids, _ = _distinct_pairs(seqs, list(range(len(repeating))) * 2, vocab_size)
        if positions.size:
            penalty = np.array([rows[i].params.repetition_penalty for i in repeating])
            repetition_update = _update(repeating, positions, token_ids, penalty[positions], device)
    additive_update = None
    if additive:
        seqs = [rows[i].output_token_ids for i in additive]
        positions, token_ids, counts = _distinct_pairs(seqs, list(range(len(additive))), vocab_size)
        if positions.size:
            frequency = np.array([rows[i].params.frequency_penalty for i in additive])
            presence = np.array([rows[i].params.presence_penalty for i in additive])
            values = -(frequency[positions] * counts + presence[positions])
            additive_update = _update(additive, positions, token_ids, values, device)
    if repetition_update is None and additive_update is None:
        return None
    return PenaltyTensors(repetition=repetition_update, additive=additive_update)
