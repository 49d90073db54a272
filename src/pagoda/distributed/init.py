"""Process-group setup: every rank calls `init_distributed` with the same master address, port
and size; gloo on the CPU, NCCL on CUDA. A rank that never joins makes the others fail within
`timeout_s` with `DistributedInitError`, never hang; collectives keep the same bound."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from pagoda.distributed.group import SINGLE, ParallelGroup


class DistributedInitError(RuntimeError):
    """The tensor-parallel group could not be formed (a rank did not join in time, a bad address)."""


def default_backend(device: torch.device | str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_distributed(
    rank: int,
    world_size: int,
    master_addr: str = "127.0.0.1",
    master_port: int = 29500,
    *,
    device: torch.device | str = "cpu",
    timeout_s: float = 60.0,
) -> ParallelGroup:
    """Join the group of `world_size` ranks as `rank`; the whole world is the tensor-parallel
    group. Size 1 needs no process group (`SINGLE`)."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in 0..{world_size - 1}, got {rank!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
    if world_size == 1:
        return SINGLE
    if dist.is_initialized():
        raise DistributedInitError("torch.distributed is already initialized in this process")
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = default_backend(device)
    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        # Every rank has connected to every other before any goes on (a rank that finished and
        # left early would otherwise break a peer still connecting).
        dist.barrier()
    except (RuntimeError, ValueError, OSError) as err:
        destroy_distributed()
        raise DistributedInitError(
            f"rank {rank} of {world_size}: the {backend} group at {master_addr}:{master_port} did not "
            f"form within {timeout_s:g} s (did every rank start, with the same address, port and "
            f"size?): {str(err).splitlines()[0] if str(err) else type(err).__name__}"
        ) from None
    return ParallelGroup(rank=rank, size=world_size, group=dist.group.WORLD)


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# Waiting for the next step is not a collective that should time out: an idle server waits as long
# as it has no requests. A dead peer still fails it at once (its connections close).
_CONTROL_TIMEOUT = datetime.timedelta(days=365)


def control_group(group: ParallelGroup) -> ParallelGroup:
    """A second group of the same ranks (gloo, also next to NCCL) for the step messages rank 0
    broadcasts: it waits without a deadline, while the model's collectives keep `timeout_s`.
    Every rank calls it, in the same order."""
    if group.size == 1:
        return group
    return ParallelGroup(group.rank, group.size, dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT))
