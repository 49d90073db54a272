"""Shared fixtures: tiny random checkpoints of every supported architecture, and a hand-rolled
paged-KV harness that builds `AttentionMetadata` the way a model runner would."""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch

from kernel_variants import variant_params
from pagoda.attention.metadata import AttentionMetadata
from pagoda.kernels import build

# Every engine the tests start (here and in server subprocesses) checks the KV block accounting
# after every step, not only when it goes idle.
os.environ.setdefault("PAGODA_CHECK_INVARIANTS", "1")

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


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Architecture name → folder of a tiny float32 random checkpoint with tokenizer files."""
    from pagoda.models.synthetic import build_random_model

    root = tmp_path_factory.mktemp("tiny_models")
    dirs = {}
    for index, (arch, (tie, shards, extra)) in enumerate(TINY_VARIANTS.items()):
        dirs[arch] = build_random_model(
            root / arch,
            arch,
            **TINY_DIMS,
            tie_word_embeddings=tie,
            dtype=torch.float32,
            shards=shards,
            seed=index,
            initializer_range=0.1,
            max_position_embeddings=512,
            **extra,
        )
    return dirs


@pytest.fixture(params=variant_params())
def variant(request: pytest.FixtureRequest):
    """A CPU kernel variant: a test taking it runs once per variant this machine can execute, and
    every kernel call in it goes to that variant (see tests/kernel_variants.py)."""
    with build.use_variant(request.param):
        yield request.param


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_dirs: dict[str, str]) -> str:
    return tiny_model_dirs["LlamaForCausalLM"]


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


@pytest.fixture
def paged_harness() -> type[PagedKVHarness]:
    """The harness class; construct it with `(num_blocks, block_size, seed=...)`."""
    return PagedKVHarness


# ---- OpenAI server fixtures (tests/server_utils.py starts real `pagoda serve` processes) ----------
# Small KV pool and float32, so that a server on a tiny model starts fast and behaves the same everywhere.
PAGODA_SERVER_FLAGS = {"dtype": "float32", "num_kv_blocks": 512}


@pytest.fixture(scope="session")
def pagoda_server(tiny_llama_dir: str):
    """Base URL ("http://127.0.0.1:PORT") of a server on the tiny llama model, shared by the session.
    Stopped with SIGTERM at the end, which must exit with status 0."""
    from server_utils import start_server

    server = start_server(tiny_llama_dir, **PAGODA_SERVER_FLAGS)
    yield server.base_url
    code = server.stop()
    assert code == 0, f"pagoda serve exited with {code}; log:\n{server.log()[-3000:]}"


@pytest.fixture(scope="module")
def pagoda_server_factory():
    """`start(model_dir, **flags) -> base_url`: a server with `--flag value` per keyword (True: `--flag`,
    False: `--no-flag`), on top of float32 and a small KV pool. All are stopped (SIGTERM, exit 0) at the
    end of the module."""
    from server_utils import start_server

    servers = []

    def start(model_dir: str, **flags: object) -> str:
        server = start_server(model_dir, **{**PAGODA_SERVER_FLAGS, **flags})
        servers.append(server)
        return server.base_url

    yield start
    codes = [(server, server.stop()) for server in servers]
    bad = [(s.base_url, code, s.log()[-2000:]) for s, code in codes if code != 0]
    assert not bad, f"servers exited with non-zero status: {bad}"
