"""Executors: where a step's `ForwardBatch` runs. `execute(batch) -> logits | None`.

- `UniprocExecutor`: one `Worker` in this process (tensor-parallel size 1).
- `MultiprocExecutor`: this process is global rank 0 of a tensor-parallel group; the other ranks
  of this node are spawned processes (`run_worker`), those of other nodes run `run_headless`
  there. Each step rank 0 broadcasts the batch over a gloo control group (torch.distributed's own
  object broadcast) and every rank runs it on its shard; rank 0 gets the gathered logits.

Faults: rank 0 checks the exit codes of its local workers before each step; a rank that dies
during a step closes its connections, so the collective in progress fails at once, and one that
hangs fails it after `ParallelConfig.timeout_s`. Either way `execute` raises `ExecutorError`
naming the rank, and the engine fails its requests (the server then exits).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import connection as mp_connection

import torch
import torch.distributed as dist

from pagoda.config import CacheConfig, ModelConfig, ParallelConfig
from pagoda.distributed import (
    DistributedInitError,
    ParallelGroup,
    control_group,
    destroy_distributed,
    free_port,
    init_distributed,
    pin_rank,
)
from pagoda.worker.batch import ForwardBatch, LogitsRows, Shutdown
from pagoda.worker.worker import Worker

logger = logging.getLogger(__name__)


class ExecutorError(RuntimeError):
    """A tensor-parallel rank died, hung past the timeout, or never joined."""


class Executor(ABC):
    vocab_size: int
    weight_format: str

    @abstractmethod
    def execute(self, batch: ForwardBatch) -> torch.Tensor | None:
        """The step's forward pass on every rank: the logits of `batch.logits_rows`, or None when
        it has none."""

    @abstractmethod
    def compute_logits(self, rows: torch.Tensor) -> torch.Tensor:
        """More rows of the last forward pass through the LM head."""

    def watch(self, on_failure: Callable[[str], None]) -> None:  # noqa: B027 (no other rank)
        """Call `on_failure(why)` from a watcher thread if another rank of this node exits while
        the executor runs (a server stops then, even when idle)."""

    def shutdown(self) -> None:  # noqa: B027 (nothing to release in-process)
        """Stop the other ranks and leave the process group (idempotent)."""


class UniprocExecutor(Executor):
    """One rank in this process; with `threads_per_rank` it is pinned to that many cores (given
    back at shutdown), as a rank of a larger group would be."""

    def __init__(self, model: ModelConfig, cache: CacheConfig, threads_per_rank: int | None = None) -> None:
        self._saved = None
        if threads_per_rank is not None:
            self._saved = (os.sched_getaffinity(0), torch.get_num_threads())
            pin_rank(0, 1, threads_per_rank)
        self.worker = Worker(model, cache)
        self.vocab_size = self.worker.vocab_size
        self.weight_format = self.worker.weight_format

    def shutdown(self) -> None:
        if self._saved is not None:
            _restore(self._saved)
            self._saved = None

    def execute(self, batch: ForwardBatch) -> torch.Tensor | None:
        return self.worker.execute(batch)

    def compute_logits(self, rows: torch.Tensor) -> torch.Tensor:
        return self.worker.compute_logits(rows)


def make_executor(model: ModelConfig, cache: CacheConfig, parallel: ParallelConfig) -> Executor:
    if parallel.tensor_parallel_size == 1:
        return UniprocExecutor(model, cache, parallel.threads_per_rank)
    return MultiprocExecutor(model, cache, parallel)


# ---- tensor parallelism ----------------------------------------------------------------------------
@dataclass(frozen=True)
class RankSpec:
    """What a worker rank process needs to join the group; the model and KV settings then come
    from rank 0 (the same block count on every rank)."""

    parallel: ParallelConfig  # with the port resolved
    local_rank: int
    device_type: str  # "cpu" or "cuda" (a rank's device is cuda:local_rank)
    model_path: str | None = None  # this node's copy of the model (None: rank 0's path)


def _rank_device(device_type: str, local_rank: int) -> torch.device:
    return torch.device("cuda", local_rank) if device_type == "cuda" else torch.device(device_type)


class MultiprocExecutor(Executor):
    """Global rank 0, in this process: spawns this node's other ranks, forms the group (waiting at
    most `timeout_s` for every rank, local or remote, to join), loads its own shard."""

    def __init__(self, model: ModelConfig, cache: CacheConfig, parallel: ParallelConfig) -> None:
        if parallel.headless or parallel.node_rank != 0:
            raise ValueError("the scheduling rank runs on node 0 (other nodes run --headless)")
        self.parallel = parallel = dataclasses.replace(
            parallel, master_port=parallel.master_port or free_port()
        )
        self._saved = (os.sched_getaffinity(0), torch.get_num_threads())
        self._closed = False
        self.failed: str | None = None
        ctx = mp.get_context("spawn")
        self.procs = {
            parallel.global_rank(i): ctx.Process(
                target=run_worker,
                args=(RankSpec(parallel, i, model.device.type),),
                name=f"pagoda-tp-rank-{parallel.global_rank(i)}",
                daemon=True,
            )
            for i in range(1, parallel.local_size)
        }
        for proc in self.procs.values():
            proc.start()
        try:
            pin_rank(0, parallel.local_size, parallel.threads_per_rank)
            group = self._join(model.device)
            self.ctrl = control_group(group)
            # Every rank allocates the same blocks; each holds its own KV heads of them.
            self._guard(lambda: self.ctrl.broadcast_object((model, cache)))
            self.worker = Worker(model, cache, group)
            self._guard(self.ctrl.barrier)  # every rank loaded its shard
        except BaseException:
            self._stop_workers(kill=True)
            self._restore()
            raise
        self.vocab_size = self.worker.vocab_size
        self.weight_format = self.worker.weight_format
        logger.info(
            "tensor parallel: %d ranks over %d node(s), rank 0 on cores %s",
            parallel.tensor_parallel_size,
            parallel.nnodes,
            sorted(os.sched_getaffinity(0)),
        )

    def _join(self, device: torch.device) -> ParallelGroup:
        """Form the group, failing as soon as a local rank dies before joining (a remote one that
        never joins fails it after `timeout_s`)."""
        parallel = self.parallel
        result: list = []

        def join() -> None:
            try:
                result.append(
                    init_distributed(
                        0,
                        parallel.tensor_parallel_size,
                        parallel.master_addr,
                        parallel.master_port,
                        device=device,
                        timeout_s=parallel.timeout_s,
                    )
                )
            except DistributedInitError as err:
                result.append(err)

        thread = threading.Thread(target=join, name="pagoda-tp-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            if self._dead():
                # The join waits on it until its timeout; this process is failing anyway.
                raise ExecutorError(
                    f"tensor-parallel ranks did not start{self._exit_codes()} (its log says why)"
                )
        if isinstance(result[0], DistributedInitError):
            raise ExecutorError(f"{result[0]}{self._exit_codes()}")
        return result[0]

    def execute(self, batch: ForwardBatch) -> torch.Tensor | None:
        return self._step(batch, lambda: self.worker.execute(batch))

    def compute_logits(self, rows: torch.Tensor) -> torch.Tensor:
        return self._step(LogitsRows(rows), lambda: self.worker.compute_logits(rows))

    def _step(self, message, run):
        if self.failed is not None:
            raise ExecutorError(self.failed)
        dead = self._dead()
        if dead:
            self._fail(f"tensor-parallel rank {dead[0]} exited (exit code {self.procs[dead[0]].exitcode})")

        def both():
            self.ctrl.broadcast_object(message)
            return run()

        return self._guard(both)

    def _guard(self, fn):
        """Run `fn` (collectives); a collective that fails becomes an ExecutorError naming why.
        After any failure the other ranks may be inside a collective: shutdown kills them."""
        try:
            return fn()
        except ExecutorError:
            raise
        except RuntimeError as err:
            if not _is_collective_error(err) and not self._dead():
                self.failed = f"rank 0 failed: {err!r}"  # its own failure (the model raised)
                raise
            # A rank that died is seen by its peers' sockets before its exit code is collected.
            deadline = time.monotonic() + 2.0
            while not self._dead() and time.monotonic() < deadline:
                time.sleep(0.05)
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            self._fail(f"a tensor-parallel collective failed ({first}){self._exit_codes()}")
        except BaseException as err:
            self.failed = f"rank 0 failed: {err!r}"
            raise

    def _fail(self, why: str) -> None:
        self.failed = why
        logger.error("%s", why)
        raise ExecutorError(why)

    def _dead(self) -> list[int]:
        return [rank for rank, p in self.procs.items() if p.exitcode is not None]

    def _exit_codes(self) -> str:
        dead = self._dead()
        if not dead:
            return ""
        return "; " + ", ".join(f"rank {r} exited with code {self.procs[r].exitcode}" for r in dead)

    def watch(self, on_failure: Callable[[str], None]) -> None:
        sentinels = {p.sentinel: rank for rank, p in self.procs.items()}

        def loop() -> None:
            ready = mp_connection.wait(list(sentinels))
            if self._closed:
                return
            rank = sentinels[ready[0]]
            self.procs[rank].join(timeout=1)
            self.failed = f"tensor-parallel rank {rank} exited (exit code {self.procs[rank].exitcode})"
            logger.error("%s", self.failed)
            on_failure(self.failed)

        if sentinels:
            threading.Thread(target=loop, name="pagoda-tp-watch", daemon=True).start()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.failed is None and not self._dead():
            try:
                self.ctrl.broadcast_object(Shutdown())
            except RuntimeError:
                self.failed = "a rank was gone at shutdown"
        # After a failure the other ranks may sit in a collective: stop them before leaving.
        self._stop_workers(kill=self.failed is not None)
        destroy_distributed()
        self._restore()

    def _stop_workers(self, kill: bool) -> None:
        for proc in self.procs.values():
            if not kill:
                proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)

    def _restore(self) -> None:
        _restore(self._saved)


def _is_collective_error(err: RuntimeError) -> bool:
    """torch.distributed's failures: DistError (timeouts), or gloo's plain RuntimeError for a
    peer whose connection closed."""
    text = str(err).lower()
    return isinstance(err, dist.DistError) or "gloo" in text or "nccl" in text


def _restore(saved: tuple[set[int], int]) -> None:
    """Give this process its cores and threads back (an engine in a larger program)."""
    affinity, threads = saved
    os.sched_setaffinity(0, affinity)
    torch.set_num_threads(threads)


def run_worker(spec: RankSpec) -> None:
    """A worker rank's process: pin to its cores, join the group, load its shard, then run each
    batch rank 0 broadcasts until `Shutdown`. Any failure exits non-zero (its peers' collectives
    then fail at once)."""
    parallel = spec.parallel
    rank = parallel.global_rank(spec.local_rank)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s rank {rank}: %(message)s")
    # Ctrl-C reaches the whole process group: rank 0 (or the headless parent) stops this rank.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        pin_rank(spec.local_rank, parallel.local_size, parallel.threads_per_rank)
        device = _rank_device(spec.device_type, spec.local_rank)
        group = init_distributed(
            rank,
            parallel.tensor_parallel_size,
            parallel.master_addr,
            parallel.master_port,
            device=device,
            timeout_s=parallel.timeout_s,
        )
        ctrl = control_group(group)
        model, cache = ctrl.broadcast_object(None)
        model = dataclasses.replace(model, device=device, path=spec.model_path or model.path)
        worker = Worker(model, cache, group)
        ctrl.barrier()
        while True:
            message = ctrl.broadcast_object(None)
            if isinstance(message, ForwardBatch):
                worker.execute(message)
            elif isinstance(message, LogitsRows):
                worker.compute_logits(message.rows)
            elif isinstance(message, Shutdown):
                break
            else:
                raise TypeError(f"unexpected message {type(message).__name__}")
        destroy_distributed()
    except BaseException:
        logger.exception("rank %d failed", rank)
        logging.shutdown()
        # Skip interpreter teardown: it could wait on a process group whose peer is gone.
        os._exit(1)


def run_headless(parallel: ParallelConfig, model_path: str, device_type: str) -> int:
    """A node other than 0: run its ranks as processes until they stop. Returns 0 when every rank
    shut down normally, 1 when one failed (the others are stopped then)."""
    if not parallel.headless or parallel.node_rank == 0:
        raise ValueError("run_headless is for a node with node_rank > 0 (--headless)")
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=run_worker,
            args=(RankSpec(parallel, i, device_type, model_path),),
            name=f"pagoda-tp-rank-{parallel.global_rank(i)}",
            daemon=True,
        )
        for i in range(parallel.local_size)
    ]
    for proc in procs:
        proc.start()
    stop = []
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    try:
        while not stop and any(p.is_alive() for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
    except KeyboardInterrupt:
        stop.append(True)
    finally:
        signal.signal(signal.SIGTERM, previous)
        failed = [p for p in procs if p.exitcode not in (None, 0)]
        for proc in procs:
            if proc.is_alive() and (failed or stop):
                proc.kill()
            proc.join()
    if failed:
        print(
            f"pagoda: {failed[0].name} exited with code {failed[0].exitcode}; this node's ranks stopped",
            file=sys.stderr,
        )
        return 1
    return 0
