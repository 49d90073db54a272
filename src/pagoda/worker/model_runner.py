"""Turns a SchedulerOutput into model inputs, runs the model and samples."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pagoda.attention.metadata import AttentionMetadata
from pagoda.config import CacheConfig, ModelConfig
from pagoda.models.loader import load_model
from pagoda.outputs import Logprob
from pagoda.request import Request
from pagoda.sample import Sampler, SamplingMetadata, SamplingRow
from pagoda.step import ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass
class ModelOutput:
    # request id -> sampled token id, for the requests that reached their last known token.
    sampled: dict[str, int]
    # request id -> {token id: Logprob} for the requests that asked for logprobs.
    logprobs: dict[str, dict[int, Logprob]]
    # request id -> float32 logits [k + 1, V] at the positions that predict each of its k
    # jump-forward drafts and the token after them; the engine core verifies them in order.
    draft_logits: dict[str, torch.Tensor] = field(default_factory=dict)


class ModelRunner:
    """Loads the model and allocates its KV cache (`cache.num_blocks` blocks) on construction."""

    def __init__(self, model: ModelConfig, cache: CacheConfig) -> None:
        self.device = model.device
        self.dtype = model.dtype
        self.block_size = cache.block_size
        self.model = load_model(model.path, model.dtype, model.device, quantization=model.quantization)
        self.weight_format: str = self.model.weight_format
        logger.info(
            "loaded %s (%s activations): %s",
            model.path,
            str(model.dtype).removeprefix("torch."),
            self.weight_format,
        )
        self.arch = self.model.config
        self.vocab_size = self.arch.vocab_size
        self.sampler = Sampler(torch.Generator(device=model.device).manual_seed(model.seed))
        self.kv_caches = self.model.allocate_kv_caches(cache.num_blocks, cache.block_size)
        self.model.bind_kv_cache(self.kv_caches)

    # ---- KV cache --------------------------------------------------------------------------------

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        backend = self.model.attn_backend
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for cache in self.kv_caches:
            backend.copy_blocks(cache, src, dst)

    # ---- one step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(
        self,
        out: SchedulerOutput,
        token_bitmask_fn: Callable[[list[Request]], torch.Tensor | None] | None = None,
    ) -> ModelOutput:
        if out.block_copies:
            self._copy_blocks(out.block_copies)
        # Decodes (one new token) first: the attention backend batches them in one call.
        batch = sorted(out.scheduled, key=lambda s: s.num_new_tokens != 1)
        input_ids, positions, meta = self._prepare(batch)
        hidden = self.model(input_ids, positions, meta)

        sampling = [s for s in batch if s.samples and not s.request.num_draft_tokens]
        drafted = [s for s in batch if s.samples and s.request.num_draft_tokens]
        ends = dict(zip((s.request.request_id for s in batch), meta.query_start_loc_cpu[1:], strict=True))
        rows = [ends[s.request.request_id] - 1 for s in sampling]
        for s in drafted:
            end = ends[s.request.request_id]
            rows.extend(range(end - s.request.num_draft_tokens - 1, end))
        if not rows:
            return ModelOutput({}, {})
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        output = ModelOutput({}, {})
        offset = len(sampling)
        for s in drafted:
            k = s.request.num_draft_tokens
            output.draft_logits[s.request.request_id] = logits[offset : offset + k + 1]
            offset += k + 1
        if sampling:
            requests = [s.request for s in sampling]
            bitmask = token_bitmask_fn(requests) if token_bitmask_fn else None
            output.sampled, output.logprobs = self.sample(logits[: len(sampling)], requests, bitmask)
        return output

    @torch.inference_mode()
    def sample(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        bitmask: torch.Tensor | None,
        output_token_ids: list[list[int]] | None = None,
    ) -> tuple[dict[str, int], dict[str, dict[int, Logprob]]]:
        """Sample one token per row (row i for requests[i], whose generated tokens so far are
        `output_token_ids[i]`, by default its verified outputs)."""
        if output_token_ids is None:
            output_token_ids = [r.output_token_ids for r in requests]
        rows = [
            SamplingRow(r.params, r.prompt_token_ids, out, r.stop_token_ids, r.generator)
            for r, out in zip(requests, output_token_ids, strict=True)
        ]
        meta = SamplingMetadata.build(rows, self.vocab_size, self.device)
        result = self.sampler(logits, meta, bitmask)
        ids = [r.request_id for r in requests]
        sampled = dict(zip(ids, result.sampled_token_ids.tolist(), strict=True))
        logprobs = {}
        if result.logprobs is not None:
            logprobs = {ids[row]: entry for row, entry in result.logprobs.to_dicts().items()}
        return sampled, logprobs

    def _prepare(self, batch: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        seq_lens: list[int] = []
        query_start = [0]
        for s in batch:
            req, n = s.request, s.num_new_tokens
            start = req.num_computed_tokens
            input_ids.extend(req.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            seq_lens.append(start + n)
            query_start.append(query_start[-1] + n)
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
        return torch.tensor(input_ids, dtype=torch.int64).to(dev), pos.to(dev), meta
