"""select against an independent computation from transformers' logits (fp32 tiny model).

Both backends score with the engine's prompt logprobs (SamplingParams.prompt_logprobs with
logprob_start_len in-process, the server's prompt_logprobs field over HTTP). The stand-in test
replaces the engine backend's scoring call by transformers, so that everything else select does on
a real engine (tokenizing, choice spans, the prefix commit, the decision) is checked on its own.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import pagoda.lang as pl
from pagoda.lang.backend.base import Backend
from server_utils import wait_idle

PROMPT = "Review: the soup was cold and the waiter never came back to our table\nSentiment:"
# "positive" and "positively" share their first tokens; " pos" and " neg" start with a space token.
CHOICES = [" positive", " positively", " negative", " neutral"]


class TransformersScorer:
    """logprob of each token given the ones before it, straight from transformers' logits."""

    def __init__(self, model_dir: str) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    @torch.no_grad()
    def token_logprobs(self, ids: list[int]) -> list[float]:
        """logprob of ids[i] given ids[:i], for i >= 1."""
        lp = torch.log_softmax(self.model(torch.tensor([ids])).logits[0].float(), dim=-1)
        return [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]

    def __call__(self, prompt: str, choices: list[str]) -> dict:
        """Per choice: its tokens after the prompt's own (at least one, never position 0), their
        logprobs after the prompt, and their logprobs with no prompt (the first None)."""
        prompt_ids = self.tokenizer(prompt)["input_ids"]
        cond, uncond, spans = [], [], []
        # A token after the same tokens has one logprob (choices sharing a first token tie there
        # exactly, as greedy_token_selection needs); transformers' runs of different lengths
        # differ in the last bits, so the first run of each context gives the value.
        by_context: dict[tuple[int, ...], float] = {}
        for choice in choices:
            ids = self.tokenizer(prompt + choice)["input_ids"]
            shared = 0
            while shared < min(len(ids), len(prompt_ids)) and ids[shared] == prompt_ids[shared]:
                shared += 1
            start = max(1, min(shared, len(ids) - 1))
            lps = self.token_logprobs(ids)
            cond.append(
                [by_context.setdefault(tuple(ids[: i + 1]), lps[i - 1]) for i in range(start, len(ids))]
            )
            spans.append(ids[start:])
            bare = self.token_logprobs(ids[start:])
            uncond.append(
                [
                    None,
                    *(
                        by_context.setdefault(("bare", *ids[start : start + i + 1]), lp)
                        for i, lp in enumerate(bare, 1)
                    ),
                ]
            )
        return {"cond": cond, "uncond": uncond, "spans": spans}


@pytest.fixture(scope="module")
def reference(lang_model_dir: str) -> TransformersScorer:
    return TransformersScorer(lang_model_dir)


def _mean(values: list[float]) -> float:
    return math.fsum(values) / len(values)


def _check_against_reference(backend, reference) -> None:
    ref = reference(PROMPT, CHOICES)
    assert ref["spans"][0][: len(ref["spans"][0]) - 1] == ref["spans"][1][: len(ref["spans"][0]) - 1]

    @pl.function
    def pick(s, method):
        s += PROMPT + pl.select("v", choices=CHOICES, choices_method=method)

    state = pick.run(pl.token_length_normalized, backend=backend)
    normalized = [_mean(c) for c in ref["cond"]]
    meta = state.get_meta_info("v")
    assert meta["normalized_prompt_logprobs"] == pytest.approx(normalized, abs=1e-4)
    for got, want, span in zip(meta["input_token_logprobs"], ref["cond"], ref["spans"], strict=True):
        assert [t[1] for t in got] == span
        assert [t[0] for t in got] == pytest.approx(want, abs=1e-4)
    assert state["v"] == CHOICES[max(range(len(CHOICES)), key=lambda i: (normalized[i], -i))]
    assert state.text() == PROMPT + state["v"]

    gains = [
        _mean([c - (u or 0.0) for c, u in zip(cond, uncond, strict=True)])
        for cond, uncond in zip(ref["cond"], ref["uncond"], strict=True)
    ]
    state = pick.run(pl.unconditional_likelihood_normalized, backend=backend)
    assert state.get_meta_info("v")["normalized_unconditional_prompt_logprobs"] == pytest.approx(
        gains, abs=1e-4
    )
    assert state["v"] == CHOICES[max(range(len(CHOICES)), key=lambda i: (gains[i], -i))]

    state = pick.run(pl.greedy_token_selection, backend=backend)
    expected = pl.greedy_token_selection(
        choices=CHOICES,
        normalized_prompt_logprobs=normalized,
        input_token_logprobs=[[(lp, None, None) for lp in c] for c in ref["cond"]],
        output_token_logprobs=[[] for _ in CHOICES],
    ).decision
    assert state["v"] == expected


@pytest.fixture(scope="module")
def vllm_fields_backend(lang_server):
    """pl.RuntimeEndpoint on the same server as if it lacked pagoda's logprob_start_char: select
    takes the path a server with only vLLM's fields (and logprob_start_len) gets."""
    backend = pl.RuntimeEndpoint(lang_server.base_url)
    backend._features["logprob_start_char"] = False
    yield backend
    backend.shutdown()


@pytest.fixture(params=["engine", "http", "vllm_fields"])
def any_backend(request: pytest.FixtureRequest):
    return request.getfixturevalue(f"{request.param}_backend")


def test_select_matches_transformers(any_backend, reference) -> None:
    assert any_backend.supports_prompt_logprobs()
    _check_against_reference(any_backend, reference)


def test_select_plumbing_with_transformers_as_the_scorer(engine_backend, reference, monkeypatch) -> None:
    calls = []

    def prompt_logprobs(prompts: list[list[int]], starts: list[int]) -> list[list[float]]:
        calls.append(len(prompts))
        return [
            reference.token_logprobs(ids)[start - 1 :] for ids, start in zip(prompts, starts, strict=True)
        ]

    monkeypatch.setattr(engine_backend, "supports_prompt_logprobs", lambda: True)
    monkeypatch.setattr(engine_backend, "prompt_logprobs", prompt_logprobs)
    # The base class's scoring (one prompt_logprobs call for all choices), not pl.Engine's own.
    monkeypatch.setattr(
        engine_backend, "score_choices", functools.partial(Backend.score_choices, engine_backend)
    )
    # Everything else is the real engine (tokenization); select sends no commit, so the scoring
    # calls (replaced here) are its only requests.
    before = engine_backend.usage
    _check_against_reference(engine_backend, reference)
    assert engine_backend.usage.num_requests - before.num_requests == 0
    assert calls == [4, 4, 4, 4]  # all choices in one call; the unconditional pass in a second


def _paths_of_one_select(backend, program) -> tuple[list[str], pl.ProgramState]:
    program.run(backend=backend)  # the first select also asks which fields the server has
    paths: list[str] = []
    hooks = backend._client.event_hooks
    hooks["request"].append(lambda request: paths.append(request.url.path))
    try:
        state = program.run(backend=backend)
    finally:
        hooks["request"].pop()
    return paths, state


@pytest.mark.parametrize(
    "which, paths", [("http", ["/v1/completions"]), ("vllm_fields", ["/tokenize", "/v1/completions"])]
)
def test_select_over_http_round_trips(request, engine_backend, which, paths) -> None:
    """Over HTTP, a select is one scoring request (logprob_start_char: the server finds where each
    choice's tokens start); on a server without it, one /tokenize (the prompt) and one scoring
    request with the choices as texts (their token ids come back with the scores), never one
    /tokenize per choice. The decision and scores equal the in-process backend's."""
    backend = request.getfixturevalue(f"{which}_backend")

    @pl.function
    def pick(s):
        s += "Question: is the river water?\nAnswer:" + pl.select("v", choices=CHOICES)

    sent, state = _paths_of_one_select(backend, pick)
    assert sent == paths
    local = pick.run(backend=engine_backend)
    assert state["v"] == local["v"]
    a, b = (st.get_meta_info("v")["input_token_logprobs"] for st in (state, local))
    assert [[t[1] for t in x] for x in a] == [[t[1] for t in x] for x in b]
    assert state.get_meta_info("v")["normalized_prompt_logprobs"] == pytest.approx(
        local.get_meta_info("v")["normalized_prompt_logprobs"], abs=1e-5
    )


@pytest.mark.parametrize("which", ["engine", "http"])
@pytest.mark.parametrize(
    "choices, lead",
    [([" positive", " positively", "p", " negative"], 0), ([" positive", " positively", " pos", " posh"], 3)],
)
def test_select_computes_each_row_once(request, lang_server, reference, which, choices, lead) -> None:
    """select's scoring (pl.Engine's, and the server's with logprob_start_char): after the prompt,
    the engine computes the prompt's last token and the tokens every choice starts with once,
    then each choice's other tokens but its last (whose KV and logits nobody reads); choices
    sharing first tokens, one-token choices among them, score as transformers does."""
    backend = request.getfixturevalue(f"{which}_backend")
    prompt_ids = backend.tokenize(PROMPT)
    full = [backend.tokenize(PROMPT + c) for c in choices]
    lengths = [len(ids) - len(prompt_ids) for ids in full]
    assert max(lengths) >= 3 and (lead > 0 or 1 in lengths)
    # the tokens all choices start with, leaving each one of its own
    assert all(ids[: len(prompt_ids) + lead] == full[0][: len(prompt_ids) + lead] for ids in full)
    assert min(lengths) == lead + 1 or len({ids[len(prompt_ids) + lead] for ids in full}) > 1
    backend.flush_cache()
    backend.commit(PROMPT[:-4])  # all of the prompt cached but its last few tokens
    uncached = len(prompt_ids) - len(backend.tokenize(PROMPT[:-4]))
    if which == "engine":
        core = backend._engine.engine.core
        before = core.stats().num_computed_tokens
    else:
        before = _server_computed(lang_server.base_url)

    @pl.function
    def pick(s):
        s += PROMPT + pl.select("v", choices=choices)

    state = pick.run(backend=backend)
    if which == "engine":
        computed = core.stats().num_computed_tokens - before
    else:
        computed = _server_computed(lang_server.base_url) - before
    # the prompt's uncached tokens (its last among them) and the shared lead once, then each
    # choice's own tokens but its last
    assert computed == uncached + lead + sum(n - lead - 1 for n in lengths if n > lead + 1)
    ref = reference(PROMPT, choices)
    got = state.get_meta_info("v")["input_token_logprobs"]
    for tokens, want in zip(got, ref["cond"], strict=True):
        assert [t[0] for t in tokens] == pytest.approx(want, abs=1e-4)
    assert state["v"] == choices[max(range(4), key=lambda i: (_mean(ref["cond"][i]), -i))]


def _server_computed(base_url: str) -> float:
    m = wait_idle(base_url)
    return m["vllm:prefix_cache_queries_total"] - m["vllm:prefix_cache_hits_total"]


# After "...: th", the tokenizer merges " the" into one token: "e ..." re-tokenizes the prompt's
# end, and "e" / "en" leave prompt + choice no longer than the prompt.
@pytest.mark.parametrize("which", ["http", "vllm_fields"])
@pytest.mark.parametrize("choices", [["e whole story", "ink so"], ["e", "en"]])
def test_select_over_http_where_choices_merge_with_the_prompt(
    request, engine_backend, choices, which
) -> None:
    """Choices that re-tokenize the prompt's end (or leave a prompt + choice no longer than the
    prompt) are scored from their true start, over HTTP (with logprob_start_char or without) as in
    process (which then takes its general path)."""
    http_backend = request.getfixturevalue(f"{which}_backend")
    prompt = "Sentiment: th"
    ids = engine_backend.tokenize(prompt)
    assert engine_backend.tokenize(prompt + "e")[: len(ids)] != ids  # the merge this test is about

    @pl.function
    def pick(s):
        s += prompt + pl.select("v", choices=choices)

    remote, local = pick.run(backend=http_backend), pick.run(backend=engine_backend)
    assert remote["v"] == local["v"]
    a, b = (st.get_meta_info("v")["input_token_logprobs"] for st in (remote, local))
    assert [[t[1] for t in x] for x in a] == [[t[1] for t in x] for x in b]
    assert [[t[0] for t in x] for x in a] == [pytest.approx([t[0] for t in x], abs=1e-5) for x in b]
