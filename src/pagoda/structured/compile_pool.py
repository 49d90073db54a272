"""Grammar compiles on worker threads, each with a deadline.

xgrammar cannot interrupt a compile, and some specs within the size limits compile for minutes
(many optional JSON properties grow cubically). A compile past its deadline fails its future with
`GrammarTimeoutError` (a ValueError: the client gets a 400) and its thread is abandoned: it runs
on to the end and its result is dropped, but it no longer counts as a worker, so the queue moves
on at once. At most `max_abandoned` abandoned compiles may run at a time; while that many burn
CPU, new compiles fail at once with `GrammarBusyError` (the server answers 503) rather than pile up.
Compile threads are not daemons: a process exiting in the middle of a compile would abort inside
xgrammar, so the interpreter waits for them (`wait` bounds that for the server).

State (`_queue`, `_active`, `_abandoned`) is guarded by `_lock`; futures are completed outside it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any


class GrammarTimeoutError(ValueError):
    """A grammar took longer than the compile timeout (the spec is too complex)."""


class GrammarBusyError(RuntimeError):
    """Too many abandoned compiles are still running; retry later."""


class _Job:
    __slots__ = ("abandoned", "args", "done", "fn", "future")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], future: Future) -> None:
        self.fn = fn
        self.args = args
        self.future = future
        self.done = False  # finished or abandoned: whichever happens first wins (under the lock)
        self.abandoned = False


class CompilePool:
    def __init__(self, workers: int, timeout_s: float, max_abandoned: int) -> None:
        if workers < 1 or max_abandoned < 1 or not timeout_s > 0:
            raise ValueError(
                f"need workers >= 1, max_abandoned >= 1 and timeout_s > 0, "
                f"got {workers}, {max_abandoned}, {timeout_s}"
            )
        self.workers = workers
        self.timeout_s = timeout_s
        self.max_abandoned = max_abandoned
        self._lock = threading.Lock()
        self._queue: deque[_Job] = deque()
        self._active = 0  # compiles running within their deadline
        self._abandoned = 0  # compiles running past it
        self._threads: set[threading.Thread] = set()  # every compile still running
        self._closed = False

    @property
    def num_abandoned(self) -> int:
        with self._lock:
            return self._abandoned

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed:
                error: BaseException | None = RuntimeError("the grammar compiler is shut down")
            elif self._abandoned >= self.max_abandoned:
                error = GrammarBusyError(
                    f"the grammar compiler is busy: {self._abandoned} grammar(s) that took longer than "
                    f"{self.timeout_s:g}s are still compiling; retry later"
                )
            else:
                error = None
                self._queue.append(_Job(fn, args, future))
                self._start_locked()
        if error is not None:
            future.set_exception(error)
        return future

    def wait(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the running compiles; True if none is left."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in threads)

    def shutdown(self) -> None:
        """Cancel the queued compiles; running ones finish on their own."""
        with self._lock:
            self._closed = True
            queued = list(self._queue)
            self._queue.clear()
        for job in queued:
            job.future.cancel()

    def _start_locked(self) -> None:
        while self._active < self.workers and self._queue:
            job = self._queue.popleft()
            if not job.future.set_running_or_notify_cancel():
                continue  # cancelled while queued
            self._active += 1
            thread = threading.Thread(target=self._run, args=(job,), name="pagoda-grammar")
            self._threads.add(thread)
            thread.start()

    def _run(self, job: _Job) -> None:
        timer = threading.Timer(self.timeout_s, self._expire, (job,))
        timer.daemon = True
        timer.start()
        result: Any = None
        error: BaseException | None = None
        try:
            result = job.fn(*job.args)
        except BaseException as exc:  # handed to the future's owner
            error = exc
        timer.cancel()
        with self._lock:
            in_time = not job.done
            job.done = True
            if job.abandoned:
                self._abandoned -= 1
            else:
                self._active -= 1
            self._threads.discard(threading.current_thread())
            self._start_locked()
        if in_time:
            _complete(job.future, result, error)

    def _expire(self, job: _Job) -> None:
        with self._lock:
            if job.done:
                return
            job.done = job.abandoned = True
            self._active -= 1
            self._abandoned += 1
            self._start_locked()
        _complete(
            job.future,
            None,
            GrammarTimeoutError(
                f"compiling the output constraint took longer than {self.timeout_s:g}s "
                "(--grammar-compile-timeout); simplify the schema, regex or grammar"
            ),
        )


def _complete(future: Future, result: Any, error: BaseException | None) -> None:
    try:
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
    except InvalidStateError:  # cancelled meanwhile
        pass
