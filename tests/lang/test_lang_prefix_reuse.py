"""Prefix reuse, measured: the server's prefix-cache counters and each backend's computed tokens."""

from __future__ import annotations

import random

import pagoda.lang as pl
from server_utils import metrics, wait_idle

BLOCK_SIZE = 16  # the engine's default KV block: the cache keeps whole blocks only
WORDS = [
    "the",
    "and",
    "of",
    "to",
    "in",
    "is",
    "that",
    "it",
    "for",
    "you",
    "with",
    "on",
    "hello",
    "world",
    "this",
    "a",
    "be",
    "are",
    "was",
]


def text_of_tokens(backend, n: int, seed: int) -> str:
    """Random words cut to exactly `n` tokens (as the backend tokenizes them)."""
    rng = random.Random(seed)
    text = ""
    while len(backend.tokenize(text)) < n:
        text += rng.choice(["The", "Hello"]) + " " + " ".join(rng.choices(WORDS, k=12)) + ".\n"
    while len(backend.tokenize(text)) > n:
        text = text[:-1]
    return text


@pl.function
def tree(s, context, width):
    s += context
    forks = s.fork(width)
    for i, f in enumerate(forks):
        f += f"\nIdea {i}:" + pl.gen("idea", max_tokens=4, ignore_eos=True)
    s["metas"] = [f.get_meta_info("idea") for f in forks]
    forks.join()


def test_fork_computes_the_shared_prompt_once(backend, lang_server) -> None:
    shared = text_of_tokens(backend, 512, seed=1)
    assert len(backend.tokenize(shared)) == 512
    backend.flush_cache()
    server_before = metrics(lang_server.base_url)
    before = backend.usage
    state = tree.run(context=shared, width=8, temperature=0, backend=backend)
    computed = backend.usage.computed_prompt_tokens - before.computed_prompt_tokens
    # The commit computes the 512 shared tokens once; each of the 8 branches finds all of them
    # cached (and, if a sibling finished first, the first tokens of its own line too) and
    # computes only its own few tokens.
    metas = state["metas"]
    assert all(m["cached_tokens"] >= 512 for m in metas), metas
    assert computed == 512 + sum(m["prompt_tokens"] - m["cached_tokens"] for m in metas)
    if isinstance(backend, pl.RuntimeEndpoint):
        after = wait_idle(lang_server.base_url)
        hits = after["vllm:prefix_cache_hits_total"] - server_before["vllm:prefix_cache_hits_total"]
        queries = after["vllm:prefix_cache_queries_total"] - server_before["vllm:prefix_cache_queries_total"]
        assert hits == sum(m["cached_tokens"] for m in metas) >= 8 * 512
        assert queries - hits == computed


@pl.function
def same_prompt_tree(s, context, width):
    s += context
    forks = s.fork(width)
    forks += pl.gen("idea", max_tokens=4, ignore_eos=True)
    s["metas"] = [f.get_meta_info("idea") for f in forks]
    forks.join()


def test_fork_branches_of_the_same_prompt_compute_it_once_without_a_commit(backend, lang_server) -> None:
    # Each branch gens right after the fork: no commit is sent; the engine has one branch compute
    # the 512 tokens and the others share its prompt KV (all but the last token, which each
    # computes to sample its own first token), counted as prefix-cache hits.
    shared = text_of_tokens(backend, 512, seed=2)
    backend.flush_cache()
    server_before = metrics(lang_server.base_url)
    before = backend.usage
    state = same_prompt_tree.run(context=shared, width=8, temperature=0, backend=backend)
    usage = backend.usage
    assert usage.num_requests - before.num_requests == 8  # the branches' gens, no commit
    metas = state["metas"]
    assert sorted(m["cached_tokens"] for m in metas) == [0] + [511] * 7, metas
    assert usage.computed_prompt_tokens - before.computed_prompt_tokens == 512 + 7
    if isinstance(backend, pl.RuntimeEndpoint):
        after = wait_idle(lang_server.base_url)
        hits = after["vllm:prefix_cache_hits_total"] - server_before["vllm:prefix_cache_hits_total"]
        assert hits == 7 * 511


SHOTS = [
    ("the food was wonderful and the staff were kind", "positive"),
    ("cold soup, a rude waiter and a long wait", "negative"),
    ("it was a restaurant like any other", "neutral"),
    ("best evening we have had in years", "positive"),
    ("the bill was wrong and nobody cared", "negative"),
    ("we ate, we paid, we left", "neutral"),
    ("lovely view and a great wine list", "positive"),
    ("the room smelled and the music was too loud", "negative"),
]
FEW_SHOT = "Classify the sentiment of each review.\n\n" + "".join(
    f"Review: {text}\nSentiment: {label}\n\n" for text, label in SHOTS * 3
)


@pl.function
def few_shot(s, review):
    s += FEW_SHOT + "Review: " + review + "\nSentiment:" + pl.gen("label", max_tokens=2, ignore_eos=True)


def test_run_batch_computes_the_shared_part_once(backend) -> None:
    rng = random.Random(3)
    reviews = [" ".join(rng.choices(WORDS, k=rng.randint(8, 20))) for _ in range(32)]
    backend.flush_cache()
    before = backend.usage
    states = few_shot.run_batch([{"review": r} for r in reviews], temperature=0, backend=backend)
    usage = backend.usage
    computed = usage.computed_prompt_tokens - before.computed_prompt_tokens
    shared = len(backend.tokenize(FEW_SHOT + "Review: "))
    prompts = [st.get_meta_info("label")["prompt_tokens"] for st in states]
    ideal = shared + sum(p - shared for p in prompts)
    assert shared > 300
    assert computed < 1.2 * ideal, (computed, ideal)
