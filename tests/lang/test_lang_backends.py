"""The same programs on pl.Engine and on pl.RuntimeEndpoint (a real `pagoda serve`): identical
greedy results, constraints honoured, the chat template applied as the model's own."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

import pagoda.lang as pl
from pagoda import LLM, SamplingParams

from .lang_helpers import ENGINE_FLAGS

RECORD_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "member"],
    "additionalProperties": False,
}
YEAR_REGEX = r"(19|20)[0-9]{2}"
LABELS = ["positive", "negative", "neutral"]
FEW_SHOT = "".join(
    f"Review: {text}\nSentiment: {label}\n\n"
    for text, label in [
        ("the food was wonderful", "positive"),
        ("cold soup and a rude waiter", "negative"),
        ("it was a restaurant", "neutral"),
        ("best evening in years", "positive"),
    ]
)


@pl.function
def multi_turn_chat(s, questions):
    s += pl.system("You are a helpful assistant.")
    for i, q in enumerate(questions):
        s += pl.user(q)
        s += pl.assistant(pl.gen(f"answer_{i}", max_tokens=8, ignore_eos=True))


@pl.function
def extract(s, text):
    s += pl.user("Extract the year and a record from: " + text)
    s += pl.assistant(
        "Year: "
        + pl.gen("year", regex=YEAR_REGEX)
        + "\nAge: "
        + pl.gen_int("age", max_tokens=4)
        + "\nRecord: "
        + pl.gen("record", json_schema=json.dumps(RECORD_SCHEMA), max_tokens=48)
    )


@pl.function
def judge(s, question, answers):
    s += pl.system("You are a strict grader.")
    s += pl.user("Question: " + question)
    forks = s.fork(len(answers))
    for f, a in zip(forks, answers, strict=True):
        f += pl.user("Answer: " + a + "\nIs it correct?")
        f += pl.assistant(pl.gen("verdict", choices=["yes", "no"]))
        f += pl.user("Why?") + pl.assistant(pl.gen("why", max_tokens=12, stop="\n", ignore_eos=True))
    s["verdicts"] = [f["verdict"] for f in forks]
    forks.join()


def lookup(action: str) -> str:
    return f"[{len(action)} results]"


@pl.function
def react(s, question, steps=3):
    s += "Answer with Thought / Action / Observation steps.\nQuestion: " + question + "\n"
    for i in range(steps):
        s += f"Thought {i}: " + pl.gen(f"thought_{i}", max_tokens=16, stop="\n", ignore_eos=True)
        s += "\nAction: " + pl.gen(f"action_{i}", max_tokens=8, stop=["\n", "Observation"], ignore_eos=True)
        s += "\nObservation: " + lookup(s[f"action_{i}"]) + "\n"


@pl.function
def classify(s, review):
    s += FEW_SHOT + "Review: " + review + "\nSentiment: " + pl.gen("label", choices=LABELS)


@pl.function
def classify_select(s, review, method=pl.token_length_normalized):
    s += (
        FEW_SHOT
        + "Review: "
        + review
        + "\nSentiment: "
        + pl.select("label", choices=LABELS, choices_method=method)
    )


def snapshot(state: pl.ProgramState) -> tuple:
    exe = state._exe
    return state.text(), state.messages(), {k: v for k, v in exe.variables.items()}


PROGRAMS = [
    (multi_turn_chat, {"questions": ["What is 2+2?", "And 3+3?", "Thanks!"]}),
    (extract, {"text": "Ann, 34, joined the club in 1998."}),
    (judge, {"question": "2+2?", "answers": ["4", "5", "four"]}),
    (react, {"question": "Who wrote Hamlet?"}),
    (classify, {"review": "the staff ignored us all night"}),
]


@pytest.mark.parametrize(("program", "kwargs"), PROGRAMS, ids=lambda p: getattr(p, "__name__", ""))
def test_same_greedy_results_on_both_backends(engine_backend, http_backend, program, kwargs) -> None:
    local = program.run(**kwargs, temperature=0, backend=engine_backend)
    remote = program.run(**kwargs, temperature=0, backend=http_backend)
    assert snapshot(local) == snapshot(remote)


def test_constraints_and_stops_hold(engine_backend) -> None:
    state = extract.run(text="Bo, 7, 2021", temperature=0, backend=engine_backend)
    assert re.fullmatch(YEAR_REGEX, state["year"])
    assert re.fullmatch(r"[-+]?[0-9]+", state["age"])
    jsonschema.validate(json.loads(state["record"]), RECORD_SCHEMA)
    state = judge.run(question="1+1?", answers=["2", "3"], temperature=0, backend=engine_backend)
    assert state["verdicts"] == state["verdict"] and set(state["verdicts"]) <= {"yes", "no"}
    assert all("\n" not in why for why in state["why"])
    state = react.run(question="q", temperature=0, backend=engine_backend)
    for i in range(3):
        assert "\n" not in state[f"thought_{i}"]
        assert "\n" not in state[f"action_{i}"] and "Observation" not in state[f"action_{i}"]
        assert f"Observation: {lookup(state[f'action_{i}'])}\n" in state.text()
    assert classify.run(review="fine", backend=engine_backend)["label"] in LABELS


def test_run_batch_equals_single_runs(backend) -> None:
    reviews = ["great", "awful service", "meh", "loved the dessert", "too loud"]
    states = classify.run_batch([{"review": r} for r in reviews], temperature=0, backend=backend)
    singles = [classify.run(review=r, temperature=0, backend=backend)["label"] for r in reviews]
    assert [s["label"] for s in states] == singles


def test_chat_turns_render_as_the_models_template_and_gen_prefills_the_assistant(
    engine_backend, lang_model_dir
) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
    ]

    @pl.function
    def chat(s):
        s += pl.system("Be brief.")
        s += pl.user("Name a colour.")
        s["prompt"] = s.text()
        s += pl.assistant(pl.gen("reply", max_tokens=10, ignore_eos=True))

    state = chat.run(temperature=0, backend=engine_backend)
    tokenizer = engine_backend.tokenizer
    assert state["prompt"] == tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False
    )
    full = [*messages, {"role": "assistant", "content": state["reply"]}]
    assert state.text() == tokenizer.apply_chat_template(full, tokenize=False)
    # The gen continued the assistant turn exactly as a chat request would have.
    reference = LLM(lang_model_dir, dtype="float32", num_kv_blocks=64).chat(
        messages, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    )
    assert state["reply"] == reference[0].outputs[0].text


def test_streaming_gives_the_same_text(backend) -> None:
    kwargs = {"questions": ["Stream this.", "And this."]}
    whole = multi_turn_chat.run(**kwargs, temperature=0, backend=backend)
    streamed = multi_turn_chat.run(**kwargs, temperature=0, stream=True, backend=backend)
    pieces = list(streamed.text_iter())
    assert "".join(pieces) == whole.text() == streamed.text()
    assert len(pieces) > 2
    again = multi_turn_chat.run(**kwargs, temperature=0, stream=True, backend=backend)
    assert "".join(again.text_iter("answer_1")) == whole["answer_1"]


def test_logprobs_agree_between_backends(engine_backend, http_backend) -> None:
    @pl.function
    def scored(s):
        s += "Once upon a time" + pl.gen(
            "x", max_tokens=6, ignore_eos=True, return_logprob=True, top_logprobs_num=3
        )

    local = scored.run(temperature=0, backend=engine_backend).get_meta_info("x")
    remote = scored.run(temperature=0, backend=http_backend).get_meta_info("x")
    assert len(local["output_token_logprobs"]) == local["completion_tokens"] == 6
    for (lp_a, tid, text_a), (lp_b, none, text_b) in zip(
        local["output_token_logprobs"], remote["output_token_logprobs"], strict=True
    ):
        assert lp_a == pytest.approx(lp_b, abs=1e-5) and text_a == text_b and none is None
        assert engine_backend.tokenizer.decode([tid], skip_special_tokens=False) == text_a
    for top_a, top_b in zip(local["output_top_logprobs"], remote["output_top_logprobs"], strict=True):
        assert len(top_a) == len(top_b) == 3
        assert [t[2] for t in top_a] == [t[2] for t in top_b]
        assert [t[0] for t in top_a] == pytest.approx([t[0] for t in top_b], abs=1e-5)
        assert top_a[0][0] >= top_a[1][0] >= top_a[2][0]


def test_bad_requests_are_value_errors_naming_the_problem(backend) -> None:
    @pl.function
    def bad_regex(s):
        s += "x" + pl.gen("y", regex="(unclosed")

    with pytest.raises(ValueError, match="regex"):
        bad_regex.run(backend=backend)

    @pl.function
    def too_long(s):
        s += "word " * 3000 + pl.gen("y", max_tokens=4)

    with pytest.raises(ValueError, match=r"max_model_len|maximum context length"):
        too_long.run(backend=backend)
    # The backend still serves.
    assert classify.run(review="ok", temperature=0, backend=backend)["label"] in LABELS


def test_runtime_endpoint_connection_and_model_errors(lang_server) -> None:
    with pytest.raises(pl.BackendRequestError, match="failed"):
        pl.RuntimeEndpoint("http://127.0.0.1:9", timeout=2)
    with pytest.raises(ValueError, match="http"):
        pl.RuntimeEndpoint("localhost:8000")
    with pytest.raises(ValueError, match="does not serve model 'other'"):
        pl.RuntimeEndpoint(lang_server.base_url, model="other")


def test_runtime_endpoint_api_key(lang_model_dir) -> None:
    from server_utils import start_server

    server = start_server(lang_model_dir, api_key="sesame", **ENGINE_FLAGS)
    try:
        with pytest.raises(PermissionError, match="API key"):
            pl.RuntimeEndpoint(server.base_url)
        with pytest.raises(PermissionError, match="API key"):
            pl.RuntimeEndpoint(server.base_url, api_key="wrong")
        backend = pl.RuntimeEndpoint(server.base_url, api_key="sesame")
        assert classify.run(review="ok", temperature=0, backend=backend)["label"] in LABELS
        backend.shutdown()
    finally:
        assert server.stop() == 0


# ---- select: prompt logprobs from the engine ------------------------------------------------------
# (A backend without them is a clear error: tests/lang/test_lang_interpreter.py, on a fake.)
def test_select_same_on_both_backends(engine_backend, http_backend) -> None:
    assert engine_backend.supports_prompt_logprobs() and http_backend.supports_prompt_logprobs()
    for method in (
        pl.token_length_normalized,
        pl.greedy_token_selection,
        pl.unconditional_likelihood_normalized,
    ):
        local = classify_select.run(review="cold and slow", method=method, backend=engine_backend)
        remote = classify_select.run(review="cold and slow", method=method, backend=http_backend)
        assert local["label"] == remote["label"] and local["label"] in LABELS
        assert local.get_meta_info("label")["normalized_prompt_logprobs"] == pytest.approx(
            remote.get_meta_info("label")["normalized_prompt_logprobs"], abs=1e-4
        )
