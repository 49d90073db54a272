"""`--step-log FILE`: one JSON line per engine step, for finding where serving time goes.

Each line is one step the engine ran (an empty schedule writes nothing): `time` (Unix seconds
at its start), `duration_ms` (schedule, forward, sampling and update), `requests` and `tokens`
scheduled, the prefill share of them (`prefill_requests`, `prefill_tokens`: requests still
computing their prompt), `decode_requests`, `prompt_logprob_requests` (requests owed prompt
logprobs in this step), `preempted`, the `running` and `waiting` counts after the step, and the
process id (`pid`: replicas started by `--replicas` append to the same file). Lines are appended
and flushed one at a time, so a file can be read while the engine runs.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from pagoda.step import SchedulerOutput


@dataclass(frozen=True)
class StepShape:
    """What a step was about to compute, counted before it ran (the update changes requests)."""

    requests: int
    tokens: int
    prefill_requests: int  # requests still computing their prompt
    prefill_tokens: int
    prompt_logprob_requests: int  # requests owed prompt logprobs
    preempted: int

    @staticmethod
    def of(sched: SchedulerOutput) -> StepShape:
        chunks = [s for s in sched.scheduled if s.request.num_computed_tokens < s.request.num_prompt_tokens]
        return StepShape(
            len(sched.scheduled),
            sched.num_tokens,
            len(chunks),
            sum(s.num_new_tokens for s in chunks),
            sum(s.request.prompt_logprobs_next is not None for s in sched.scheduled),
            len(sched.preempted),
        )


class StepLog:
    """Owned by the engine core: opened with it, written by its loop thread only."""

    def __init__(self, path: str) -> None:
        try:
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())
        except OSError as exc:
            raise ValueError(f"cannot open the step log {path!r}: {exc.strerror}") from exc
        self._pid = os.getpid()

    def record(self, start: float, duration_s: float, shape: StepShape, running: int, waiting: int) -> None:
        line = {
            "time": round(start, 6),
            "duration_ms": round(duration_s * 1e3, 3),
            "requests": shape.requests,
            "tokens": shape.tokens,
            "prefill_requests": shape.prefill_requests,
            "prefill_tokens": shape.prefill_tokens,
            "decode_requests": shape.requests - shape.prefill_requests,
            "prompt_logprob_requests": shape.prompt_logprob_requests,
            "preempted": shape.preempted,
            "running": running,
            "waiting": waiting,
            "pid": self._pid,
        }
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
