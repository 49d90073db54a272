"""Turns a SchedulerOutput into model inputs, runs the model and samples."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagoda.attention.metadata import AttentionMetadata
from pagoda.models.loader import load_model
from pagoda.request import Request
from pagoda.sample import Sampler, SamplingMetadata, SamplingRow
from pagoda.scheduler.scheduler import ScheduledRequest, SchedulerOutput


@dataclass
class ModelOutput:
    # request id -> sampled token id, for the requests that reached their last known token.
    sampled: dict[str, int]
    # request id -> {token id: Logprob} for the requests that asked for logprobs.
    logprobs: dict[str, dict]


class ModelRunner:
    def __init__(
        self,
        model_dir: str,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int,
        seed: int,
    ) -> None:
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.model = load_model(model_dir, dtype, device)
        self.arch = self.model.config
        self.vocab_size = self.arch.vocab_size
        self.sampler = Sampler(torch.Generator(device=device).manual_seed(seed))
        self.kv_caches: list[torch.Tensor] = []

    # ---- KV cache --------------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        a = self.arch
        return 2 * a.num_layers * self.block_size * a.num_kv_heads * a.head_dim * self.dtype.itemsize

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = self.model.allocate_kv_caches(num_blocks, self.block_size)
        self.model.bind_kv_cache(self.kv_caches)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        backend = self.model.attn_backend
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for cache in self.kv_caches:
            backend.copy_blocks(cache, src, dst)

    # ---- one step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, token_bitmask_fn: Callable[[list[Request]], torch.Tensor | None] | None = None
    ) -> ModelOutput:
        if out.block_copies:
            self._copy_blocks(out.block_copies)
        # Decodes (one new token) first: the attention backend batches them in one call.
        batch = sorted(out.scheduled, key=lambda s: s.num_new_tokens != 1)
        input_ids, positions, meta, sample_idx = self._prepare(batch)
        hidden = self.model(input_ids, positions, meta)

        sampling = [s for s in batch if s.samples]
        if not sampling:
            return ModelOutput({}, {})
        logits = self.model.compute_logits(hidden[torch.tensor(sample_idx, device=self.device)])
        rows = [
            SamplingRow(r.params, r.prompt_token_ids, r.output_token_ids, r.generator)
            for r in (s.request for s in sampling)
        ]
        smeta = SamplingMetadata.build(rows, self.vocab_size, self.device)
        bitmask = token_bitmask_fn([s.request for s in sampling]) if token_bitmask_fn else None
        result = self.sampler(logits, smeta, bitmask)
        ids = [s.request.request_id for s in sampling]
        sampled = dict(zip(ids, result.sampled_token_ids.tolist(), strict=True))
        logprobs = {}
        if result.logprobs is not None:
            logprobs = {ids[row]: entry for row, entry in result.logprobs.to_dicts().items()}
        return ModelOutput(sampled, logprobs)

    def _prepare(
        self, batch: list[ScheduledRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        seq_lens: list[int] = []
        query_start = [0]
        sample_idx: list[int] = []
        for s in batch:
            req, n = s.request, s.num_new_tokens
            start = req.num_computed_tokens
            input_ids.extend(req.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            seq_lens.append(start + n)
            query_start.append(query_start[-1] + n)
            if s.samples:
                sample_idx.append(query_start[-1] - 1)
        num_decodes = sum(s.num_new_tokens == 1 for s in batch)  # sorted: decodes come first
        max_blocks = max(-(-sl // bs) for sl in seq_lens)
        tables = [
            s.request.block_ids[:max_blocks] + [0] * (max_blocks - len(s.request.block_ids)) for s in batch
        ]

        dev = self.device
        pos = torch.tensor(positions, dtype=torch.int64)
        block_tables = torch.tensor(tables, dtype=torch.int32)
        row = torch.repeat_interleave(
            torch.arange(len(batch)), torch.tensor([s.num_new_tokens for s in batch])
        )
        slot_mapping = block_tables[row, pos // bs].long() * bs + pos % bs
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(dev, non_blocking=True),
            block_tables=block_tables.to(dev, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev, non_blocking=True),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32).to(dev, non_blocking=True),
            num_decodes=num_decodes,
            seq_lens_cpu=seq_lens,
            query_start_loc_cpu=query_start,
            block_size=bs,
        )
        return torch.tensor(input_ids, dtype=torch.int64).to(dev), pos.to(dev), meta, sample_idx
