"""Test constants and helpers that test modules import (a module with its own name: `conftest` is
ambiguous, as several test folders have one): tiny-model dimensions per architecture, and a
hand-rolled paged-KV harness that builds `AttentionMetadata` the way a model runner would."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagoda.attention.metadata import AttentionMetadata

TINY_DIMS = dict(
    hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=384
)

# Per architecture: (tie_word_embeddings, shards, extra HF config). Between them they cover tied
# and untied heads, llama3 rope scaling, an explicit head_dim and a sharded checkpoint.
TINY_VARIANTS: dict[str, tuple[bool, int, dict]] = {
    "LlamaForCausalLM": (
        True,
        2,
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),
    "MistralForCausalLM": (False, 1, {"sliding_window": None}),
    "Qwen2ForCausalLM": (False, 1, {}),
    "Qwen3ForCausalLM": (True, 1, {"head_dim": 32}),
}


@dataclass
class PagedStep:
    positions: torch.Tensor
    metadata: AttentionMetadata


class PagedKVHarness:
    """Owns a block allocator handing out blocks in shuffled order, and each sequence's block list.

    `step([(seq_id, n_new), ...])` appends `n_new` tokens to each sequence (in the given order, which
    must put decodes first) and returns their positions and the `AttentionMetadata` for the batch.
    """

    def __init__(self, num_blocks: int, block_size: int, seed: int = 0, device: str = "cpu") -> None:
        self.block_size = block_size
        self.device = device
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.blocks: dict[object, list[int]] = {}
        self.lens: dict[object, int] = {}

    def step(self, batch: Sequence[tuple[object, int]], num_decodes: int | None = None) -> PagedStep:
        if num_decodes is None:
            num_decodes = 0
            while num_decodes < len(batch) and batch[num_decodes][1] == 1:
                num_decodes += 1
        positions, slots, seq_lens, starts = [], [], [], [0]
        for seq_id, num_new in batch:
            start = self.lens.get(seq_id, 0)
            end = start + num_new
            blocks = self.blocks.setdefault(seq_id, [])
            while len(blocks) * self.block_size < end:
                blocks.append(self.free_blocks.pop())
            for pos in range(start, end):
                positions.append(pos)
                slots.append(blocks[pos // self.block_size] * self.block_size + pos % self.block_size)
            self.lens[seq_id] = end
            seq_lens.append(end)
            starts.append(starts[-1] + num_new)
        width = max(len(self.blocks[seq_id]) for seq_id, _ in batch)
        tables = [self.blocks[seq_id] + [0] * (width - len(self.blocks[seq_id])) for seq_id, _ in batch]
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=self.device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=self.device),
            num_decodes=num_decodes,
            seq_lens_cpu=seq_lens,
            query_start_loc_cpu=starts,
            block_size=self.block_size,
        )
        return PagedStep(torch.tensor(positions, dtype=torch.int64, device=self.device), metadata)


def structured_batch_params() -> list:
    """Speculation tests' structured-output batch: two greedy and two seeded requests constrained to
    one JSON schema (grammar-forced drafts appear at its fixed keys)."""
    from pagoda import SamplingParams
    from pagoda.sampling_params import StructuredOutputs

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "tags": {"type": "array", "maxItems": 4}},
        "required": ["name", "tags"],
        "additionalProperties": False,
    }
    spec = StructuredOutputs(json=schema)
    return [SamplingParams(temperature=0, max_tokens=120, structured_outputs=spec)] * 2 + [
        SamplingParams(temperature=1.0, seed=i, max_tokens=120, structured_outputs=spec) for i in range(2)
    ]
