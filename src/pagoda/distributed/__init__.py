"""Tensor parallelism on torch.distributed: process groups, collectives, shard arithmetic,
per-rank CPU pinning, and a launcher that runs a function on every rank.

`ParallelGroup` (group.py) is what the parallel layers take: rank, size and the collectives they
need (all-reduce after a row-parallel layer, gather of vocab-parallel logits). Size 1 (`SINGLE`)
needs no process group, so a single-process model runs the same layers without torch.distributed.
"""

from pagoda.distributed.affinity import pin_rank, rank_cores
from pagoda.distributed.group import SINGLE, ParallelGroup
from pagoda.distributed.init import (
    DistributedInitError,
    control_group,
    default_backend,
    destroy_distributed,
    init_distributed,
)
from pagoda.distributed.launch import RankFailed, free_port, run_on_ranks
from pagoda.distributed.sharding import even_split, kv_head_shard, vocab_shard

__all__ = [
    "SINGLE",
    "DistributedInitError",
    "ParallelGroup",
    "RankFailed",
    "control_group",
    "default_backend",
    "destroy_distributed",
    "even_split",
    "free_port",
    "init_distributed",
    "kv_head_shard",
    "pin_rank",
    "rank_cores",
    "run_on_ranks",
    "vocab_shard",
]
