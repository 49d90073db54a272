"""The interpreter on a scripted backend: state, roles, variables, fork/join, batches, streaming, errors."""

from __future__ import annotations

import threading
import time

import pytest

import pagoda.lang as pl
from pagoda.lang.interpreter import MIN_COMMIT_CHARS
from pagoda.lang.ir import REGEX_FLOAT, REGEX_INT, REGEX_STR

from .lang_fakes import FakeBackend


@pytest.fixture
def fake() -> FakeBackend:
    return FakeBackend()


# ---- text, roles, variables --------------------------------------------------------------------
def test_text_roles_and_messages(fake: FakeBackend) -> None:
    @pl.function
    def prog(s, q):
        s += "intro. "
        s += pl.user(q)
        s += pl.assistant("A: " + pl.gen("a", max_tokens=4))
        with s.user():
            s += "more"
        s += pl.system_begin() + "sys" + pl.system_end()

    state = prog.run(q="hi", backend=fake)
    # The gen's prompt is the text so far, ending inside the open assistant turn (prefill).
    ((prompt, _),) = fake.of_kind("generate")
    assert prompt == "intro. [system]default[/system][user]hi[/user][assistant]A: "
    assert state["a"] == f"<{len(prompt)}>"
    assert state.text() == prompt + state["a"] + "[/assistant][user]more[/user][system]sys[/system]"
    assert state.messages() == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "A: " + state["a"]},
        {"role": "user", "content": "more"},
        {"role": "system", "content": "sys"},
    ]
    meta = state.get_meta_info("a")
    assert meta["prompt_tokens"] == len(prompt) and meta["finish_reason"] == {"type": "length", "length": 4}
    assert "a" in state and "b" not in state


def test_program_defaults_reach_every_gen_that_does_not_override(fake: FakeBackend) -> None:
    @pl.function
    def prog(s):
        s += "x" + pl.gen("a") + pl.gen("b", max_tokens=3, temperature=0.5, stop=["\n"], regex="[0-9]+")

    prog.run(backend=fake, max_new_tokens=7, temperature=0.0, stop="END", top_k=5)
    (_, a), (_, b) = fake.of_kind("generate")
    assert (a.max_tokens, a.temperature, a.stop, a.top_k, a.structured_outputs) == (7, 0.0, ["END"], 5, None)
    assert (b.max_tokens, b.temperature, b.stop, b.top_k) == (3, 0.5, ["\n"], 5)
    assert b.structured_outputs.regex == "[0-9]+"


def test_constraint_shortcuts_map_to_structured_outputs(fake: FakeBackend) -> None:
    @pl.function
    def prog(s):
        s += "x" + pl.gen_int("i") + pl.gen_string("s") + pl.gen("c", choices=["a", "b"])
        s += pl.gen("j", json_schema='{"type": "object"}') + pl.gen("f", dtype=float)

    prog.run(backend=fake)
    specs = [p.structured_outputs for _, p in fake.of_kind("generate")]
    assert [s.kind for s in specs] == ["regex", "regex", "choice", "json", "regex"]
    assert (specs[0].regex, specs[1].regex, specs[4].regex) == (REGEX_INT, REGEX_STR, REGEX_FLOAT)
    assert specs[2].choice == ["a", "b"]


def test_logprob_options(fake: FakeBackend) -> None:
    @pl.function
    def prog(s):
        s += "x" + pl.gen("a", return_logprob=True, top_logprobs_num=3) + pl.gen("b", return_logprob=True)

    prog.run(backend=fake)
    (_, a), (_, b) = fake.of_kind("generate")
    assert (a.logprobs, b.logprobs) == (3, 0)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: pl.gen("x", temperature=-1), "temperature"),
        (lambda: pl.gen("x", max_tokens=0), "max_tokens"),
        (lambda: pl.gen("x", top_p=0), "top_p"),
        (lambda: pl.gen("x", top_logprobs_num=2), "top_logprobs_num needs return_logprob"),
        (lambda: pl.gen("x", regex="a", choices=["a"]), "at most one constraint"),
        (lambda: pl.gen("x", dtype=list), "dtype"),
        (lambda: pl.gen("x", json_schema="{nope"), "json_schema is not valid JSON"),
        (lambda: pl.gen("x", choices=[]), "choice"),
        (lambda: pl.gen("", max_tokens=1), "name"),
        (lambda: pl.select("x", choices=None), "needs choices"),
        (lambda: pl.select("x", choices=["a", ""]), "non-empty"),
        (lambda: pl.select("x", choices=["a"], temperature=0.5), "temperature 0.0 only"),
        (lambda: pl.select("x", choices=["a"], choices_method="greedy"), "choices_method"),
    ],
)
def test_bad_arguments_fail_where_written(make, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_bad_program_defaults_fail_before_any_request(fake: FakeBackend) -> None:
    @pl.function
    def prog(s):
        s += "x" + pl.gen("a")

    with pytest.raises(ValueError, match="temperature"):
        prog.run(backend=fake, temperature=-2)
    with pytest.raises(TypeError, match=r"got an unexpected keyword"):
        prog.run(backend=fake, q=1)
    assert fake.calls == []


def test_undefined_variable_names_it(fake: FakeBackend) -> None:
    @pl.function
    def prog(s):
        s += "x" + pl.gen("answer", max_tokens=2)
        return s["answr"]

    with pytest.raises(pl.UndefinedVariableError, match=r"'answr'.*defined: 'answer'"):
        prog.run(backend=fake)


def test_errors_in_program_structure(fake: FakeBackend) -> None:
    @pl.function
    def empty(s):
        s += pl.gen("a")

    with pytest.raises(ValueError, match="no prompt"):
        empty.run(backend=fake)

    @pl.function
    def nested(s):
        s += pl.user_begin() + pl.assistant("x")

    with pytest.raises(ValueError, match="roles do not nest"):
        nested.run(backend=fake)

    @pl.function
    def unmatched(s):
        s += pl.user_end()

    with pytest.raises(ValueError, match="without a matching"):
        unmatched.run(backend=fake)

    @pl.function
    def not_text(s):
        s += 5

    with pytest.raises(TypeError, match="appends text"):
        not_text.run(backend=fake)

    @pl.function
    def none(s):
        s += None

    with pytest.raises(ValueError, match="None"):
        none.run(backend=fake)


def test_backend_resolution() -> None:
    @pl.function
    def prog(s):
        s += "x"

    previous = pl.get_default_backend()
    try:
        pl.program._default_backend = None
        with pytest.raises(ValueError, match=r"no backend: call pl\.set_default_backend"):
            prog.run()
        with pytest.raises(TypeError, match=r"pl\.Engine or a pl\.RuntimeEndpoint"):
            pl.set_default_backend("http://x")
        fake = FakeBackend()
        pl.set_default_backend(fake)
        assert prog.run().text() == "x"
        assert pl.flush_cache() is True and fake.of_kind("flush") == [None]
    finally:
        pl.program._default_backend = previous


def test_function_signature_and_bind(fake: FakeBackend) -> None:
    with pytest.raises(TypeError, match="program state as its first argument"):
        pl.function(lambda: None)

    @pl.function
    def prog(s, a, b="B"):
        s += a + b

    assert prog.run("A", backend=fake).text() == "AB"
    assert prog.bind(b="C").run(a="A", backend=fake).text() == "AC"
    assert prog("Z", backend=fake).text() == "ZB"
    with pytest.raises(TypeError, match="no argument 'c'"):
        prog.bind(c=1)
    with pytest.raises(TypeError, match="missing a required argument"):
        prog.run(backend=fake)


# ---- fork / join -------------------------------------------------------------------------------------
def test_fork_commits_the_shared_prefix_once_and_branches_run_concurrently() -> None:
    barrier = threading.Barrier(3, timeout=10)

    def reply(prompt: str, params) -> str:
        barrier.wait()  # all three branches must be in flight together
        return prompt[-1]

    fake = FakeBackend(reply)

    shared = "a long shared context. " * 3
    assert len(shared) >= MIN_COMMIT_CHARS

    @pl.function
    def prog(s):
        s += shared
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f"b{i}" + pl.gen("x")
        s["xs"] = [f["x"] for f in forks]
        s["texts"] = [f.text() for f in forks]
        forks.join()

    state = prog.run(backend=fake)
    assert fake.of_kind("commit") == [shared]
    assert state["xs"] == ["0", "1", "2"]
    assert state["texts"] == [f"{shared}b00", f"{shared}b11", f"{shared}b22"]
    assert state["x"] == ["0", "1", "2"]  # gathered by join
    assert state.text() == shared


def test_fork_commits_only_text_its_requests_have_not_computed(fake: FakeBackend) -> None:
    @pl.function
    def prog(s, extra):
        s += "x" * 100 + pl.gen("a")  # the gen's request computed all of this
        s += extra
        s["trunk"] = s.text()
        forks = s.fork(2)
        forks += "b" + pl.gen("b")
        forks.join()

    prog.run("short tail", backend=fake)
    assert fake.of_kind("commit") == []  # less than MIN_COMMIT_CHARS is new: not worth a round trip
    state = prog.run("t" * MIN_COMMIT_CHARS, backend=fake)
    assert fake.of_kind("commit") == [state["trunk"]]


def test_branches_whose_gen_prompt_is_the_trunk_send_no_commit(fake: FakeBackend) -> None:
    # Their gens have the same prompt, which the engine computes once for all of them; branches
    # that never send a request commit nothing either.
    trunk = "a long shared context. " * 4

    @pl.function
    def prog(s):
        s += trunk
        forks = s.fork(3)
        forks += pl.gen("x")
        forks.join()
        s.fork(2)

    state = prog.run(backend=fake)
    assert fake.of_kind("commit") == []
    assert [prompt for prompt, _ in fake.of_kind("generate")] == [trunk] * 3
    assert len(state["x"]) == 3


def test_nested_forks_commit_the_innermost_trunk_once(fake: FakeBackend) -> None:
    @pl.function
    def prog(s):
        s += "t" * MIN_COMMIT_CHARS
        (a, b) = s.fork(2)
        a += "u" * MIN_COMMIT_CHARS
        inner = a.fork(2)
        inner += "v" + pl.gen("y")
        b += "w" + pl.gen("z")
        inner.join()

    prog.run(backend=fake)
    assert sorted(fake.of_kind("commit")) == [
        "t" * MIN_COMMIT_CHARS,
        "t" * MIN_COMMIT_CHARS + "u" * MIN_COMMIT_CHARS,
    ]


def test_fork_of_one_and_of_nothing_do_not_commit(fake: FakeBackend) -> None:
    @pl.function
    def prog(s):
        s.fork(2)  # the text is empty: nothing to commit
        s += "x"
        (f,) = s.fork(1)  # one branch: nothing is shared
        f += "a"
        with s.copy() as c:
            c += "b" + pl.gen("g")

    state = prog.run(backend=fake)
    assert fake.of_kind("commit") == []
    assert state["g"] == ["<2>"]  # the copy's prompt was "xb"; join gathered it

    @pl.function
    def bad(s, k):
        s += "x"
        s.fork(k)

    for k in (0, -1, 10**6, 2.0, True):
        with pytest.raises(ValueError, match="fork size"):
            bad.run(k, backend=fake)


def test_group_append_and_concatenate(fake: FakeBackend) -> None:
    @pl.function
    def prog(s):
        s += "p:"
        forks = s.fork(3)
        forks += "+"
        forks += ["a", "b", "c"]
        forks += lambda i: str(i)
        forks.join("concate_and_append")
        s += "."

    assert prog.run(backend=fake).text() == "p:+a0+b1+c2."

    @pl.function
    def mismatch(s):
        s += "p"
        s.fork(2).__iadd__(["a"])

    with pytest.raises(ValueError, match="1 expressions for 2 branches"):
        mismatch.run(backend=fake)

    @pl.function
    def bad_mode(s):
        s += "p"
        s.fork(2).join("merge")

    with pytest.raises(ValueError, match="join mode"):
        bad_mode.run(backend=fake)


def test_branch_error_reaches_the_reader_and_run() -> None:
    def reply(prompt: str, params) -> str:
        if "bad" in prompt:
            raise ValueError("the engine refused it")
        return "ok"

    fake = FakeBackend(reply)

    @pl.function
    def prog(s, read):
        s += "x"
        forks = s.fork(2)
        forks[0] += "good" + pl.gen("y")
        forks[1] += "bad" + pl.gen("y") + pl.gen("z")
        if read:
            return forks[1]["z"]

    with pytest.raises(ValueError, match="refused"):
        prog.run(True, backend=fake)
    with pytest.raises(ValueError, match="refused"):
        prog.run(False, backend=fake)  # nobody read it: run still reports it


def test_appending_to_an_ended_branch_is_an_error(fake: FakeBackend) -> None:
    @pl.function
    def prog(s):
        s += "x"
        forks = s.fork(2)
        forks.join()
        forks[0] += "late"

    with pytest.raises(RuntimeError, match="has ended"):
        prog.run(backend=fake)


# ---- select ---------------------------------------------------------------------------------------------
def test_select_scores_every_choice_in_one_call_without_a_commit() -> None:
    # logprob of a token: 0 for 'y', -1 otherwise, so "yy" (mean 0) beats "yn" (-0.5) and "n" (-1).
    fake = FakeBackend(logprob=lambda before, tok: 0.0 if tok == ord("y") else -1.0)

    @pl.function
    def prog(s, question):
        s += question + pl.select("v", choices=["n", "yn", "yy"])

    state = prog.run("Q? ", backend=fake)
    assert state["v"] == "yy" and state.text() == "Q? yy"
    assert fake.of_kind("commit") == []
    ((prompts, starts),) = fake.of_kind("score")
    assert prompts == [[ord(c) for c in "Q? " + ch] for ch in ["n", "yn", "yy"]] and starts == [3, 3, 3]
    meta = state.get_meta_info("v")
    assert meta["normalized_prompt_logprobs"] == [-1.0, -0.5, 0.0]
    # However long the prompt: the engine shares it among the choices (in-batch prefix caching).
    long_question = "Is this long question, which fills more than a block, answered yes? "
    assert prog.run(long_question, backend=fake)["v"] == "yy"
    assert fake.of_kind("commit") == []


def test_select_without_prompt_logprobs_names_backend_and_need(fake: FakeBackend) -> None:
    @pl.function
    def prog(s):
        s += "Q? " + pl.select("v", choices=["a", "b"])

    with pytest.raises(
        pl.BackendCapabilityError, match=r"FakeBackend\(\) cannot do select: needs prompt logprobs"
    ):
        prog.run(backend=fake)
    assert fake.of_kind("commit") == []  # nothing was sent


# ---- batches -----------------------------------------------------------------------------------------
def test_run_batch_commits_the_common_prefix_and_keeps_order() -> None:
    fake = FakeBackend(lambda prompt, params: prompt[-2:])
    shared = "You classify questions. " * 4
    assert len(shared) >= MIN_COMMIT_CHARS

    @pl.function
    def prog(s, q):
        s += shared + pl.user(q)
        s += pl.assistant(pl.gen("a"))

    states = prog.run_batch([{"q": f"q{i}"} for i in range(6)] + [("q6",)], progress_bar=True, backend=fake)
    assert [st["a"] for st in states] == ["t]"] * 7  # the last two characters of each prompt
    assert [st.text() for st in states] == [
        f"{shared}[system]default[/system][user]q{i}[/user][assistant]t][/assistant]" for i in range(7)
    ]
    commits = fake.of_kind("commit")
    assert commits == [shared + "[system]default[/system][user]q"]
    assert fake.calls[0][0] == "commit"  # before any program's gen


def test_run_batch_short_or_missing_common_prefix_is_not_committed(fake: FakeBackend) -> None:
    @pl.function
    def prog(s, q):
        s += q + pl.gen("a")

    prog.run_batch([{"q": "same start " + str(i)} for i in range(3)], backend=fake)
    assert fake.of_kind("commit") == []
    assert prog.run_batch([], backend=fake) == []


def test_run_batch_reports_the_failing_program(fake: FakeBackend) -> None:
    @pl.function
    def prog(s, q):
        s += "x" + pl.gen("a")
        if q == 3:
            return s["missing"]

    with pytest.raises(pl.UndefinedVariableError) as info:
        prog.run_batch([{"q": i} for i in range(5)], backend=fake)
    assert "(in program 3 of the batch)" in info.value.__notes__
    with pytest.raises(TypeError, match="run_batch item 1"):
        prog.run_batch([{"q": 1}, {"p": 2}], backend=fake)
    with pytest.raises(ValueError, match="num_threads"):
        prog.run_batch([{"q": 1}], backend=fake, num_threads=0)


# ---- streaming -----------------------------------------------------------------------------------------
def test_stream_yields_text_while_it_is_produced() -> None:
    fake = FakeBackend(lambda prompt, params: "abcdef", stream_delay=lambda: time.sleep(0.01))

    @pl.function
    def prog(s):
        s += pl.user("hi")
        s += pl.assistant(pl.gen("a"))
        s += "|" + pl.gen("b")

    state = prog.run(stream=True, backend=fake)
    pieces = list(state.text_iter())
    assert len(pieces) > 3
    assert "".join(pieces) == state.text()
    assert state.text().endswith("abcdef[/assistant]|abcdef")
    assert "".join(state.text_iter("a")) == "abcdef"

    streamed = prog.run(stream=True, backend=fake)
    assert "".join(streamed.text_iter("b")) == "abcdef"
    assert streamed["a"] == "abcdef"
    assert prog.run(backend=fake).text() == state.text()
    assert list(prog.run(backend=fake).text_iter()) == [state.text()]


def test_stream_error_surfaces_to_the_reader() -> None:
    def reply(prompt: str, params) -> str:
        raise ValueError("bad gen")

    fake = FakeBackend(reply)

    @pl.function
    def prog(s):
        s += "x" + pl.gen("a")

    state = prog.run(stream=True, backend=fake)
    with pytest.raises(ValueError, match="bad gen"):
        list(state.text_iter())
    assert isinstance(state.error(), ValueError)
