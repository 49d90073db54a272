"""The interpreter: program states, their executors, fork / join, and running programs.

Ownership: each program state has one executor, which owns the state's text, messages and
variables and is the only writer of them. The state a program starts with runs its expressions at
once on the program's own thread (`s += pl.gen(...)` returns when the gen is done). The branches of
`s.fork(k)` run theirs on a thread each, in order, so the k branches' requests are in the engine
together; reading a branch (`f["x"]`, `f.text()`) waits for what was appended to it before.

`fork` shares the text so far (the trunk) between the branches lazily. A branch whose first
request is a gen of exactly the trunk sends it at once: the k branches' gens then have the same
prompt, and the engine computes it once (its scheduler has the others share that request's
prompt KV: in-batch prefix caching), so no commit and no extra round trip is needed. Any other
first request (the branch appended text, or selects) waits for the trunk's commit (the backend
computes it once, see backend/base.py), which the first such branch sends and the others wait
for, so that every branch's request starts from a prefix-cache hit instead of k requests
computing the trunk at once. `select` itself does not commit: its choices go to the engine as
one batch, whose scheduler has one of them compute the shared prompt while the others wait a
step. An executor tracks how much of its text its last request already put in the cache (the
prompt and output of a gen); when less than MIN_COMMIT_CHARS is new since then there is nothing
worth a round trip, and there is no trunk to commit.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tqdm.auto import tqdm

from pagoda.lang import select as select_impl
from pagoda.lang.backend.base import Backend
from pagoda.lang.errors import UndefinedVariableError
from pagoda.lang.ir import Expr, ExprList, Gen, GenParams, RoleBegin, RoleEnd, Select, Text, as_expr

MAX_FORK = 512  # branches of one fork (each runs on a thread)
# Text shorter than this (about one KV block of tokens: less compute than the round trip costs) is
# not worth a commit: fork skips it when its uncached text is shorter, and run_batch
# when the programs' common prefix is.
MIN_COMMIT_CHARS = 64


class _StopTrace(Exception):
    """Raised while tracing a program's prefix at its first model call."""


class _Trunk:
    """A fork's shared text, committed once by the first branch whose first request needs it."""

    def __init__(self, backend: Backend, text: str) -> None:
        self.backend = backend
        self.text = text
        self._lock = threading.Lock()
        self._done = False

    def commit(self) -> None:
        with self._lock:  # the other branches wait here for the first one's commit
            if not self._done:
                self.backend.commit(self.text)
                self._done = True


class _Run:
    """One program run: its backend, its default sampling parameters and all its executors."""

    def __init__(self, backend: Backend, defaults: GenParams, *, stream: bool, tracing: bool = False) -> None:
        self.backend = backend
        self.defaults = defaults
        self.stream = stream
        self.tracing = tracing
        self.thread: threading.Thread | None = None  # the program's thread when run(stream=True)
        self.finished = threading.Event()
        self.error: BaseException | None = None
        self.executors: list[_Executor] = []
        self._lock = threading.Lock()

    def add(self, executor: _Executor) -> None:
        with self._lock:
            self.executors.append(executor)

    def execute(self, func: Callable[..., Any], state: ProgramState, args: tuple, kwargs: dict) -> None:
        """Run the program function, then wait for every branch and end them. Errors are kept in
        `self.error` (the program's own first, else the first branch's)."""
        try:
            state.ret_value = func(state, *args, **kwargs)
        except BaseException as exc:
            self.error = exc
        finally:
            with self._lock:
                executors = list(self.executors)
            for exe in executors:
                exe.end()
            if self.error is None:
                self.error = next((exe.error for exe in executors if exe.error is not None), None)
            self.finished.set()
            for exe in executors:
                exe.notify()


class _Executor:
    def __init__(self, run: _Run, *, threaded: bool, parent: _Executor | None = None) -> None:
        self.run = run
        self.backend = run.backend
        self.threaded = threaded
        self.cond = threading.Condition()
        if parent is None:
            self.text = ""
            self.messages: list[dict[str, str]] = []
            self.variables: dict[str, Any] = {}
            self.meta: dict[str, Any] = {}
            self.role: str | None = None
            self.role_start = 0
            self.role_suffix = ""
        else:
            self.text = parent.text
            self.messages = list(parent.messages)
            self.variables = dict(parent.variables)
            self.meta = dict(parent.meta)
            self.role, self.role_start, self.role_suffix = parent.role, parent.role_start, parent.role_suffix
        self.fork_start = len(self.text)
        # text[:cached_upto] is what this state's requests so far have computed (and so cached)
        self.cached_upto = 0 if parent is None else parent.cached_upto
        # The fork's trunk, until this branch's first request (which commits it, or needs not).
        self.trunk: _Trunk | None = None
        self.error: BaseException | None = None
        self.pending: Counter[str] = Counter()  # queued gens/selects per variable name (threaded)
        self.streaming: str | None = None  # the variable a streamed gen is writing
        self.ended = False
        run.add(self)
        if threaded:
            self.queue: queue.Queue[Expr | None] = queue.Queue()
            self.thread = threading.Thread(target=self._work, name="pagoda-lang-branch", daemon=True)
            self.thread.start()

    # ---- called by the program -------------------------------------------------------------------
    def submit(self, value: object) -> None:
        expr = as_expr(value)
        if self.ended:
            raise RuntimeError(
                "this program state has ended (its fork was joined or its program finished); "
                "append to a live state instead"
            )
        if not self.threaded:
            self._execute(expr)
            return
        with self.cond:
            self.pending.update(_produced(expr))
        self.queue.put(expr)

    def sync(self) -> None:
        """Wait for everything appended so far; raise the error that stopped this state, if any."""
        if self.threaded:
            if not self.ended:
                self.queue.join()
        elif self._is_streamed_root_elsewhere():
            self.run.finished.wait()
        failure = self._failure()
        if failure is not None:
            raise failure

    def get_var(self, name: str) -> Any:
        with self.cond:
            if self.threaded:
                self.cond.wait_for(lambda: self.pending[name] == 0 or self.error is not None)
            elif self._is_streamed_root_elsewhere():
                self.cond.wait_for(
                    lambda: self.run.finished.is_set() or (name in self.variables and self.streaming != name)
                )
            failure = self._failure()
            if failure is not None:
                raise failure
            if name not in self.variables:
                raise UndefinedVariableError(name, self.variables)
            return self.variables[name]

    def set_var(self, name: str, value: Any) -> None:
        with self.cond:
            self.variables[name] = value
            self.cond.notify_all()

    def get_meta_info(self, name: str) -> Any:
        self.get_var(name)
        return self.meta.get(name)

    def fork(self, size: int) -> list[_Executor]:
        if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= MAX_FORK:
            raise ValueError(f"fork size must be an integer in [1, {MAX_FORK}], got {size!r}")
        if self.run.tracing:
            raise _StopTrace
        self.sync()
        trunk = None
        if size > 1 and len(self.text) - self.cached_upto >= MIN_COMMIT_CHARS:
            trunk = _Trunk(self.backend, self.text)
        branches = [_Executor(self.run, threaded=True, parent=self) for _ in range(size)]
        for branch in branches:
            # A trunk this state was still to commit is part of the new one.
            branch.trunk = trunk or self.trunk
        return branches

    def end(self) -> None:
        """No more expressions: wait for the queued ones and stop the branch's thread."""
        if self.ended:
            return
        if self.threaded:
            self.queue.join()
            self.queue.put(None)
            self.thread.join()
        self.ended = True

    def notify(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def text_iter(self, var_name: str | None) -> Iterator[str]:
        live = self.run.stream and (self.threaded or self._is_streamed_root_elsewhere())
        if not live:
            if var_name is not None:
                yield self.get_var(var_name)
            else:
                self.sync()
                yield self.text
            return
        sent = 0
        while True:
            with self.cond:
                self.cond.wait_for(lambda sent=sent: self._stream_ready(var_name, sent))
                if var_name is None:
                    current, done = self.text, self._finished()
                else:
                    current = self.variables.get(var_name, "")
                    done = self._finished() or (var_name in self.variables and self.streaming != var_name)
                failure = self._failure()
            if isinstance(current, str) and len(current) > sent:
                yield current[sent:]
                sent = len(current)
            if failure is not None:
                raise failure
            if done:
                return

    # ---- the executor's side ---------------------------------------------------------------------
    def _failure(self) -> BaseException | None:
        if self.error is not None or self.threaded or not self.run.finished.is_set():
            return self.error
        return self.run.error

    def _finished(self) -> bool:
        if self.threaded:
            return self.ended or (self.queue.unfinished_tasks == 0 and self.run.finished.is_set())
        return self.run.finished.is_set()

    def _stream_ready(self, var_name: str | None, sent: int) -> bool:
        if self._finished() or self._failure() is not None:
            return True
        if var_name is None:
            return len(self.text) > sent
        value = self.variables.get(var_name)
        return (isinstance(value, str) and len(value) > sent) or (
            var_name in self.variables and self.streaming != var_name
        )

    def _is_streamed_root_elsewhere(self) -> bool:
        thread = self.run.thread
        return not self.threaded and thread is not None and threading.current_thread() is not thread

    def _work(self) -> None:
        while True:
            expr = self.queue.get()
            if expr is None:
                self.queue.task_done()
                return
            if self.error is None:
                try:
                    self._execute(expr)
                except BaseException as exc:
                    with self.cond:
                        self.error = exc
                        self.pending.clear()
                        self.cond.notify_all()
            self.queue.task_done()
            self.notify()

    def _execute(self, expr: Expr) -> None:
        if isinstance(expr, Text):
            self._append(expr.value)
        elif isinstance(expr, ExprList):
            for item in expr.items:
                self._execute(item)
        elif isinstance(expr, Gen):
            self._gen(expr)
        elif isinstance(expr, Select):
            self._select(expr)
        elif isinstance(expr, RoleBegin):
            self._role_begin(expr.role)
        elif isinstance(expr, RoleEnd):
            self._role_end(expr.role)
        else:
            raise TypeError(f"unknown expression {expr!r}")

    def _append(self, text: str) -> None:
        with self.cond:
            self.text += text
            self.cond.notify_all()

    def _settle_trunk(self, prompt_is_trunk: bool) -> None:
        """Before this state's first request: commit the fork's trunk unless that request is a
        gen of exactly the trunk (the engine shares same prompts sent together)."""
        trunk, self.trunk = self.trunk, None
        if trunk is None or prompt_is_trunk:
            return
        trunk.commit()
        self.cached_upto = max(self.cached_upto, len(trunk.text))

    def _set_result(self, name: str | None, value: str, meta: Any) -> None:
        with self.cond:
            if name is not None:
                self.variables[name] = value
                self.meta[name] = meta
                if self.pending[name] > 0:
                    self.pending[name] -= 1
            self.cond.notify_all()

    def _gen(self, expr: Gen) -> None:
        if self.run.tracing:
            raise _StopTrace
        params = expr.params.over(self.run.defaults).sampling_params()
        if not self.text:
            raise ValueError(f"pl.gen({expr.name!r}) has no prompt: the program's text is empty")
        prompt = self.text
        self._settle_trunk(self.trunk is not None and prompt == self.trunk.text)
        if not self.run.stream:
            out = self.backend.generate(prompt, params)
            self._append(out.text)
            self.cached_upto = len(self.text)
            self._set_result(expr.name, out.text, out.meta_info())
            return
        out = None
        with self.cond:
            self.streaming = expr.name
            if expr.name is not None:
                self.variables[expr.name] = ""
        try:
            for item in self.backend.generate_stream(prompt, params):
                if isinstance(item, str):
                    with self.cond:
                        self.text += item
                        if expr.name is not None:
                            self.variables[expr.name] += item
                        self.cond.notify_all()
                else:
                    out = item
        finally:
            with self.cond:
                self.streaming = None
        assert out is not None, "a backend stream ends with its GenOutput"
        self.cached_upto = len(self.text)
        self._set_result(expr.name, out.text, out.meta_info())

    def _select(self, expr: Select) -> None:
        if self.run.tracing:
            raise _StopTrace
        if not self.text:
            raise ValueError(f"pl.select({expr.name!r}) has no prompt: the program's text is empty")
        self.backend.check_prompt_logprobs()  # before any request
        self._settle_trunk(False)
        # No commit first: the choices' requests go to the engine together, and its scheduler
        # lets one compute their shared uncached prompt while the others wait a step for it.
        decision = select_impl.select(self.backend, self.text, list(expr.choices), expr.choices_method)
        self._append(decision.decision)
        self.cached_upto = len(self.text)  # the chosen choice's request computed it
        self._set_result(expr.name, decision.decision, decision.meta_info)

    def _role_begin(self, role: str) -> None:
        if self.role is not None:
            raise ValueError(f"pl.{role} inside pl.{self.role}: roles do not nest")
        prefix, suffix = self.backend.chat_template().affixes(role, [m["role"] for m in self.messages])
        self._append(prefix)
        self.role, self.role_start, self.role_suffix = role, len(self.text), suffix

    def _role_end(self, role: str) -> None:
        if self.role != role:
            raise ValueError(f"pl.{role}_end without a matching pl.{role}_begin (open role: {self.role})")
        content = self.text[self.role_start :]
        self._append(self.role_suffix)
        self.messages.append({"role": role, "content": content})
        self.role = None


def _produced(expr: Expr) -> list[str]:
    """The variable names that running `expr` sets."""
    if isinstance(expr, Gen | Select):
        return [expr.name] if expr.name is not None else []
    if isinstance(expr, ExprList):
        return [name for item in expr.items for name in _produced(item)]
    return []


class ProgramState:
    """The state of a running program: `s += ...`, `s["name"]`, `s.text()`, `s.fork(k)` (SGLang's API)."""

    def __init__(self, executor: _Executor) -> None:
        self._exe = executor
        self.ret_value: Any = None

    def __iadd__(self, other: object) -> ProgramState:
        if other is None:
            raise ValueError("cannot append None to a program state")
        self._exe.submit(other)
        return self

    def __getitem__(self, name: str) -> Any:
        return self._exe.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self._exe.set_var(name, value)

    def __contains__(self, name: str) -> bool:
        self._exe.sync()
        return name in self._exe.variables

    def get_var(self, name: str) -> Any:
        return self._exe.get_var(name)

    def set_var(self, name: str, value: Any) -> None:
        self._exe.set_var(name, value)

    def get_meta_info(self, name: str) -> Any:
        """Token counts, finish reason and (with return_logprob) logprobs of the gen or select `name`."""
        return self._exe.get_meta_info(name)

    def text(self) -> str:
        self._exe.sync()
        return self._exe.text

    def messages(self) -> list[dict[str, str]]:
        """The finished role turns, as chat messages."""
        self._exe.sync()
        return list(self._exe.messages)

    def sync(self) -> None:
        self._exe.sync()

    def error(self) -> BaseException | None:
        """The error that stopped this state (after waiting for it), or None."""
        try:
            self._exe.sync()
        except BaseException as exc:
            return exc
        return None

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """With run(stream=True): the text (or one variable) as it is produced; otherwise all of it once."""
        return self._exe.text_iter(var_name)

    def fork(self, size: int = 1) -> ProgramStateGroup:
        return ProgramStateGroup([ProgramState(e) for e in self._exe.fork(size)], self)

    @contextlib.contextmanager
    def copy(self) -> Iterator[ProgramState]:
        group = self.fork(1)
        try:
            yield group[0]
        finally:
            group.join()

    def _role(self, role: str, expr: object | None):
        if expr is not None:
            self += RoleBegin(role) + as_expr(expr) + RoleEnd(role)
            return None

        @contextlib.contextmanager
        def scope() -> Iterator[None]:
            self._exe.submit(RoleBegin(role))
            yield
            self._exe.submit(RoleEnd(role))

        return scope()

    def system(self, expr: object | None = None):
        return self._role("system", expr)

    def user(self, expr: object | None = None):
        return self._role("user", expr)

    def assistant(self, expr: object | None = None):
        return self._role("assistant", expr)

    def __repr__(self) -> str:
        return f"ProgramState({self._exe.text!r})"


class ProgramStateGroup:
    """The branches of `s.fork(k)`: index or iterate them; `+=` appends to all; `join()` gathers."""

    def __init__(self, states: list[ProgramState], source: ProgramState) -> None:
        self.states = states
        self.source = source

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i: int, state: ProgramState) -> None:
        # `forks[i] += expr` appends in place and stores the same state back.
        if state is not self.states[i]:
            raise TypeError("the branches of a fork cannot be replaced")

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __iadd__(self, other: object) -> ProgramStateGroup:
        """One expression for every branch, a list of one per branch, or `lambda i: expr`."""
        if callable(other):
            for i, state in enumerate(self.states):
                state += other(i)
        elif isinstance(other, list | tuple):
            if len(other) != len(self.states):
                raise ValueError(f"got {len(other)} expressions for {len(self.states)} branches")
            for state, expr in zip(self.states, other, strict=True):
                state += expr
        else:
            for state in self.states:
                state += other
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """gather_variable: each variable the branches made becomes a list (one value per branch)
        in the source state. concate_and_append: the branches' new text is appended to the source."""
        if mode not in ("gather_variable", "concate_and_append"):
            raise ValueError(f"join mode must be 'gather_variable' or 'concate_and_append', got {mode!r}")
        source = self.source._exe
        source.sync()
        for state in self.states:
            state.sync()
        if mode == "gather_variable":
            before = set(source.variables)
            gathered: dict[str, list[Any]] = {}
            for state in self.states:
                for name, value in state._exe.variables.items():
                    if name not in before:
                        gathered.setdefault(name, []).append(value)
            for name, values in gathered.items():
                source.set_var(name, values)
        else:
            source.submit("".join(s._exe.text[s._exe.fork_start :] for s in self.states))
        for state in self.states:
            state._exe.end()


# ---- running programs --------------------------------------------------------------------------------
def run_program(
    func: Callable[..., Any],
    backend: Backend,
    args: tuple,
    kwargs: dict[str, Any],
    defaults: GenParams,
    *,
    stream: bool,
) -> ProgramState:
    run = _Run(backend, defaults, stream=stream)
    state = ProgramState(_Executor(run, threaded=False))
    if stream:
        run.thread = threading.Thread(
            target=run.execute, args=(func, state, args, kwargs), name="pagoda-lang-program", daemon=True
        )
        run.thread.start()
        return state
    run.execute(func, state, args, kwargs)
    if run.error is not None:
        raise run.error
    return state


def trace_prefix(
    func: Callable[..., Any], backend: Backend, args: tuple, kwargs: dict[str, Any], defaults: GenParams
) -> str | None:
    """The text a program builds before its first model call (gen, select or fork), or None if it
    fails before. The program function runs up to that point (without any request)."""
    run = _Run(backend, defaults, stream=False, tracing=True)
    exe = _Executor(run, threaded=False)
    try:
        func(ProgramState(exe), *args, **kwargs)
    except _StopTrace:
        pass
    except Exception:
        return None
    return exe.text


def _common_prefix(texts: list[str]) -> str:
    first, last = min(texts), max(texts)  # the common prefix of all is that of the extremes
    n = 0
    while n < len(first) and first[n] == last[n]:
        n += 1
    return first[:n]


def run_program_batch(
    func: Callable[..., Any],
    backend: Backend,
    batch: Sequence[dict[str, Any]],
    defaults: GenParams,
    *,
    num_threads: int,
    progress_bar: bool,
) -> list[ProgramState]:
    """Run the programs concurrently after committing their common prefix. Raises the first
    program's error (by position) once all have finished."""
    if len(batch) > 1:
        prefixes = [p for kw in batch if (p := trace_prefix(func, backend, (), kw, defaults)) is not None]
        common = _common_prefix(prefixes) if len(prefixes) > 1 else ""
        if len(common) >= MIN_COMMIT_CHARS:
            backend.commit(common)
    results: list[ProgramState | BaseException | None] = [None] * len(batch)

    def one(i: int) -> None:
        try:
            results[i] = run_program(func, backend, (), dict(batch[i]), defaults, stream=False)
        except BaseException as exc:
            results[i] = exc

    with (
        tqdm(total=len(batch), desc="Programs", disable=not progress_bar) as bar,
        ThreadPoolExecutor(max_workers=max(1, min(num_threads, len(batch)))) as pool,
    ):
        futures = [pool.submit(one, i) for i in range(len(batch))]
        for future in futures:
            future.add_done_callback(lambda _: bar.update(1))
        for future in futures:
            future.result()
    for i, result in enumerate(results):
        if isinstance(result, BaseException):
            result.add_note(f"(in program {i} of the batch)")
            raise result
    return results  # type: ignore[return-value]
