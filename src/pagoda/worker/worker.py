"""One rank's model: its shard of the weights and a KV pool of its own KV heads, run on a batch.

Every rank of a tensor-parallel group holds one `Worker` and runs the same `ForwardBatch`es in
the same order (the collectives inside the layers pair up); rank 0 gets the logits, the others
None. The KV pool has the same block ids on every rank (the scheduler's, on rank 0), each rank
holding its own KV heads of each block.
"""

from __future__ import annotations

import logging

import torch

from pagoda.config import CacheConfig, ModelConfig
from pagoda.distributed import SINGLE, ParallelGroup
from pagoda.models.loader import load_model
from pagoda.worker.batch import ForwardBatch

logger = logging.getLogger(__name__)


class Worker:
    """Loads this rank's shard and allocates its KV pool (`cache.num_blocks` blocks) on construction."""

    def __init__(self, model: ModelConfig, cache: CacheConfig, tp: ParallelGroup = SINGLE) -> None:
        self.device = model.device
        self.tp = tp
        self.model = load_model(model.path, model.dtype, model.device, quantization=model.quantization, tp=tp)
        self.weight_format: str = self.model.weight_format
        if tp.is_first:
            shard = f" (rank 0 of {tp.size}: its shard)" if tp.size > 1 else ""
            logger.info(
                "loaded %s (%s activations): %s%s",
                model.path,
                str(model.dtype).removeprefix("torch."),
                self.weight_format,
                shard,
            )
        self.kv_caches = self.model.allocate_kv_caches(cache.num_blocks, cache.block_size)
        self.model.bind_kv_cache(self.kv_caches)
        self._hidden: torch.Tensor | None = None  # the last forward pass's, for more logits rows

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Run the forward pass; the logits of `batch.logits_rows` (`[N, vocab]` float32) on rank
        0, None elsewhere (and None when no row needs logits)."""
        if batch.block_copies:
            self._copy_blocks(batch.block_copies)
        dev = self.device
        meta = batch.attention_metadata(dev)
        hidden = self.model(batch.input_ids.to(dev), batch.positions.to(dev), meta)
        self._hidden = hidden
        if not len(batch.logits_rows):
            return None
        return self.model.compute_logits(hidden[batch.logits_rows.to(dev)])

    @torch.inference_mode()
    def compute_logits(self, rows: torch.Tensor) -> torch.Tensor | None:
        """More rows of the last forward pass's hidden states through the LM head."""
        return self.model.compute_logits(self._hidden[rows.to(self.device)])

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        backend = self.model.attn_backend
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for cache in self.kv_caches:
            backend.copy_blocks(cache, src, dst)
