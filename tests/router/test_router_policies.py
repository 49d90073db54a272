"""Unit tests of the router's pieces that need no network: prefix tree, policies, config, CLI flags."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagoda.router.cli import build_router_config, register
from pagoda.router.config import (
    BackendConfig,
    RouterConfig,
    config_from_mapping,
    load_config,
    parse_backend_spec,
)
from pagoda.router.policies import (
    POLICIES,
    CacheAwareConfig,
    CacheAwarePolicy,
    LeastLoadPolicy,
    PowerOfTwoPolicy,
    RoundRobinPolicy,
    make_policy,
)
from pagoda.router.prefix_tree import PrefixTree
from pagoda.router.prompt_text import chat_text, completion_text, request_text

pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------- prefix tree


def test_tree_match_reports_each_tenants_longest_prefix() -> None:
    tree = PrefixTree(max_chars=1000)
    tree.insert("abcdef", "A")
    tree.insert("abcxyz", "B")
    tree.insert("abc", "C")
    tree.check_invariants()
    assert tree.match("abcdefgh") == {"A": 6, "B": 3, "C": 3}
    assert tree.match("abq") == {"A": 2, "B": 2, "C": 2}
    assert tree.match("xyz") == {}
    assert tree.match("") == {}
    assert tree.total_chars == len("abc") + len("def") + len("xyz")


def test_tree_tenant_on_a_longer_path_also_matches_its_prefixes() -> None:
    tree = PrefixTree(max_chars=1000)
    tree.insert("hello world, how are you", "A")
    tree.insert("hello", "B")
    assert tree.match("hello world") == {"A": 11, "B": 5}
    tree.check_invariants()


def test_tree_eviction_keeps_the_bound_and_drops_least_recently_used() -> None:
    tree = PrefixTree(max_chars=100)
    tree.insert("a" * 40, "A")  # oldest
    tree.insert("b" * 40, "B")
    tree.insert("a" * 40, "A")  # touch: now "b..." is the least recently used
    tree.insert("c" * 40, "C")  # 120 > 100: evict down to 90
    tree.check_invariants()
    assert tree.total_chars <= 90
    assert tree.match("a" * 40) == {"A": 40}
    assert tree.match("c" * 40) == {"C": 40}
    assert tree.match("b" * 40) == {}


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.text(alphabet="abc", min_size=0, max_size=30), st.sampled_from(["A", "B", "C"])),
        max_size=40,
    ),
    st.integers(min_value=5, max_value=200),
)
def test_tree_stays_bounded_and_newest_insert_always_matches(
    ops: list[tuple[str, str]], max_chars: int
) -> None:
    tree = PrefixTree(max_chars=max_chars)
    low_water = max(1, int(max_chars * 0.9))
    for text, tenant in ops:
        tree.insert(text, tenant)
        tree.check_invariants()
        assert tree.total_chars <= max_chars
        kept = text[:low_water]
        if kept:
            assert tree.match(kept)[tenant] == len(kept)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.text(alphabet="ab", min_size=1, max_size=12), st.sampled_from(["A", "B", "C"])),
        max_size=30,
    ),
    st.lists(st.text(alphabet="ab", max_size=14), min_size=1, max_size=10),
)
def test_tree_match_equals_brute_force_without_eviction(
    ops: list[tuple[str, str]], queries: list[str]
) -> None:
    tree = PrefixTree(max_chars=10_000)
    for text, tenant in ops:
        tree.insert(text, tenant)
    tree.check_invariants()
    for query in queries:
        expected: dict[str, int] = {}
        for text, tenant in ops:
            n = next(
                (k for k in range(min(len(text), len(query))) if text[k] != query[k]),
                min(len(text), len(query)),
            )
            if n:
                expected[tenant] = max(expected.get(tenant, 0), n)
        assert tree.match(query) == expected


def test_tree_remove_tenant_prunes_only_its_own_nodes() -> None:
    tree = PrefixTree(max_chars=1000)
    tree.insert("shared-prefix-A-only", "A")
    tree.insert("shared-prefix-B-only", "B")
    tree.remove_tenant("A")
    tree.check_invariants()
    assert tree.match("shared-prefix-A-only") == {"B": len("shared-prefix-")}
    assert tree.total_chars == len("shared-prefix-B-only")
    assert tree.tenants() == {"B"}
    tree.remove_tenant("B")
    tree.check_invariants()
    assert tree.total_chars == 0


def test_tree_truncates_texts_longer_than_the_bound() -> None:
    tree = PrefixTree(max_chars=50)
    tree.insert("x" * 500, "A")
    tree.check_invariants()
    assert tree.match("x" * 500) == {"A": 45}


def test_tree_rejects_a_bad_bound() -> None:
    with pytest.raises(ValueError, match="max_chars"):
        PrefixTree(0)


# ---------------------------------------------------------------- policies


@dataclass
class Fake:
    url: str
    in_flight: int = 0


def urls(decisions: list) -> list[str]:
    return [d.backend.url for d in decisions]


def test_round_robin_cycles_per_model() -> None:
    policy = RoundRobinPolicy()
    backends = [Fake("a"), Fake("b"), Fake("c")]
    assert urls([policy.choose("m1", "", backends) for _ in range(4)]) == ["a", "b", "c", "a"]
    assert urls([policy.choose("m2", "", backends[:2]) for _ in range(3)]) == ["a", "b", "a"]


def test_least_load_picks_the_fewest_in_flight_and_rotates_ties() -> None:
    policy = LeastLoadPolicy()
    assert policy.choose("m", "", [Fake("a", 3), Fake("b", 1), Fake("c", 2)]).backend.url == "b"
    idle = [Fake("a"), Fake("b"), Fake("c")]
    assert sorted(urls([policy.choose("m", "", idle) for _ in range(3)])) == ["a", "b", "c"]


def test_power_of_two_never_picks_the_most_loaded_and_is_seeded() -> None:
    backends = [Fake("a", 0), Fake("b", 5), Fake("c", 10)]
    first = urls([PowerOfTwoPolicy(seed=7).choose("m", "", backends) for _ in range(1)])
    policy = PowerOfTwoPolicy(seed=7)
    picks = urls([policy.choose("m", "", backends) for _ in range(200)])
    assert "c" not in picks and {"a", "b"} == set(picks)
    assert picks[0] == first[0]
    assert urls([PowerOfTwoPolicy(seed=7).choose("m", "", backends) for _ in range(1)]) == first
    two = [Fake("a", 4), Fake("b", 1)]
    assert set(urls([policy.choose("m", "", two) for _ in range(20)])) == {"b"}
    assert policy.choose("m", "", [Fake("only", 99)]).backend.url == "only"


def test_cache_aware_sends_a_repeated_prefix_to_the_same_backend() -> None:
    policy = CacheAwarePolicy(CacheAwareConfig(cache_threshold=0.5))
    a, b = Fake("a"), Fake("b")
    first = policy.choose("m", "system prompt. question one", [a, b])
    assert first.reason == "cache_miss"
    # Another prompt sharing >= 50% goes where the prefix went, even if that backend is busier.
    first.backend.in_flight = 3
    again = policy.choose("m", "system prompt. question two", [a, b])
    assert again.reason == "cache_hit" and again.backend is first.backend
    # A prompt with a short match goes to the least-loaded backend.
    other = policy.choose("m", "sys: an unrelated and much longer request text", [a, b])
    assert other.reason == "cache_miss" and other.backend.in_flight == 0
    policy.tree("m").check_invariants()


def test_cache_aware_rebalances_only_when_both_thresholds_are_exceeded() -> None:
    config = CacheAwareConfig(cache_threshold=0.5, balance_abs_threshold=16, balance_rel_threshold=1.5)
    policy = CacheAwarePolicy(config)
    a, b = Fake("a"), Fake("b")
    assert policy.choose("m", "prefix-1", [a, b]).backend is a
    a.in_flight, b.in_flight = 16, 0  # gap 16 is not > 16
    assert policy.choose("m", "prefix-1", [a, b]).reason == "cache_hit"
    a.in_flight, b.in_flight = 100, 80  # gap 20 > 16, but 100 < 80 * 1.5
    assert policy.choose("m", "prefix-1", [a, b]).reason == "cache_hit"
    a.in_flight, b.in_flight = 17, 0  # gap 17 > 16 and 17 > 0 * 1.5
    decision = policy.choose("m", "prefix-1", [a, b])
    assert (decision.reason, decision.backend.url) == ("balance", "b")


def test_cache_aware_forgets_a_removed_backend_and_handles_empty_text() -> None:
    policy = CacheAwarePolicy()
    a, b = Fake("a"), Fake("b")
    assert policy.choose("m", "hello there", [a, b]).backend is a
    policy.forget_backend("a")
    assert policy.tree("m").match("hello there") == {}
    assert policy.choose("m", "", [a, b]).reason == "no_text"
    assert policy.tree("m").total_chars == 0  # forgotten, and an empty text is not recorded


def test_cache_aware_only_matches_among_the_candidates() -> None:
    policy = CacheAwarePolicy()
    a, b = Fake("a"), Fake("b")
    policy.choose("m", "the same long prompt", [a])  # recorded on a
    decision = policy.choose("m", "the same long prompt", [b])  # a is not a candidate (unhealthy)
    assert decision.backend is b and decision.reason == "cache_miss"


def test_policy_registry_and_validation() -> None:
    assert set(POLICIES) == {"round-robin", "least-load", "power-of-two", "cache-aware"}
    assert isinstance(make_policy("cache-aware"), CacheAwarePolicy)
    with pytest.raises(ValueError, match="unknown routing policy 'fastest'"):
        make_policy("fastest")
    with pytest.raises(ValueError, match="at least one candidate"):
        RoundRobinPolicy().choose("m", "", [])
    for bad in (
        {"cache_threshold": 1.5},
        {"cache_threshold": "0.5"},
        {"balance_abs_threshold": -1},
        {"balance_rel_threshold": 0.5},
        {"max_tree_chars": 0},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            CacheAwareConfig(**bad)


# ---------------------------------------------------------------- request text


def test_request_text_renders_prompts_and_chats() -> None:
    assert completion_text("hi") == "hi"
    assert completion_text(["a", "b"]) == "a\nb"
    assert completion_text([1, 2, 3]) == "1 2 3 "
    assert completion_text([[1], [2]]) == "1 \n2 "
    assert completion_text(None) == "" and completion_text([1, "x"]) == ""
    chat = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {}}]},
    ]
    assert chat_text(chat) == "<|system|>be brief<|user|>hi<image_url>"
    # A longer conversation extends the shorter one's text: the prefix property the tree relies on.
    assert chat_text([*chat, {"role": "assistant", "content": "hello"}]).startswith(chat_text(chat))
    assert request_text("chat", {"messages": chat}) == chat_text(chat)
    assert request_text("completion", {"prompt": "p"}) == "p"


# ---------------------------------------------------------------- config


def test_backend_spec_parsing() -> None:
    assert parse_backend_spec("http://127.0.0.1:8001") == BackendConfig("http://127.0.0.1:8001")
    spec = parse_backend_spec("http://127.0.0.1:8001/,model=a,model=b,api_key=k")
    assert spec == BackendConfig("http://127.0.0.1:8001", ("a", "b"), "k")
    for bad, message in (
        ("", "empty --backend"),
        ("http://127.0.0.1:8001,modle=a", "bad --backend option 'modle=a'"),
        ("http://127.0.0.1:8001,model=", "bad --backend option"),
        ("127.0.0.1:8001", "must look like http://HOST:PORT"),
        ("http://127.0.0.1:99999", "invalid port"),
        ("http://127.0.0.1:8001,model=a,model=a", "duplicate model names"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_backend_spec(bad)


def test_config_file_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text(
        """
host: 127.0.0.1
port: 9000
policy: least-load
api_key: secret
health_interval_s: 2
cache_aware:
  cache_threshold: 0.3
backends:
  - url: http://127.0.0.1:8001
    model: qwen
  - url: http://127.0.0.1:8002
    models: [qwen, llama]
    api_key: backend-key
  - http://127.0.0.1:8003,model=llama
  - url: http://127.0.0.1:8004
"""
    )
    config = load_config(path)
    assert config.port == 9000 and config.policy == "least-load" and config.api_key == "secret"
    assert config.health_interval_s == 2 and config.cache_aware.cache_threshold == 0.3
    assert config.cache_aware.balance_abs_threshold == CacheAwareConfig().balance_abs_threshold
    assert [b.models for b in config.backends] == [("qwen",), ("qwen", "llama"), ("llama",), ()]
    assert config.backends[1].api_key == "backend-key"
    merged = load_config(path, {"policy": "round-robin", "cache_aware": {"balance_abs_threshold": 4}})
    assert merged.policy == "round-robin"
    assert (merged.cache_aware.cache_threshold, merged.cache_aware.balance_abs_threshold) == (0.3, 4)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"backends": []}, "'backends' must be a non-empty list"),
        ({}, "'backends' must be a non-empty list"),
        ({"backends": ["http://127.0.0.1:1"], "polcy": "x"}, "unknown keys \\['polcy'\\]"),
        ({"backends": ["http://127.0.0.1:1"], "policy": "x"}, "unknown routing policy"),
        ({"backends": [{"model": "m"}]}, "backends\\[0\\]: missing 'url'"),
        ({"backends": [{"url": "http://127.0.0.1:1", "model": "a", "models": ["b"]}]}, "either 'model'"),
        ({"backends": [{"url": "http://127.0.0.1:1", "weight": 2}]}, "unknown keys \\['weight'\\]"),
        ({"backends": ["http://127.0.0.1:1", "http://127.0.0.1:1/"]}, "duplicate backend urls"),
        ({"backends": ["http://127.0.0.1:1"], "cache_aware": {"threshold": 1}}, "cache_aware: unknown keys"),
        (
            {"backends": ["http://127.0.0.1:1"], "health_interval_s": 0},
            "health_interval_s must be a positive",
        ),
        ({"backends": ["http://127.0.0.1:1"], "port": 70000}, "port must be"),
        ([1, 2], "top level must be a mapping"),
    ],
)
def test_config_errors_name_the_problem(data: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config_from_mapping(data, "router.yaml")


def test_config_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read router config"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("backends: [unclosed\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_config(bad)


def test_router_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="at least one backend"):
        RouterConfig(backends=())
    with pytest.raises(ValueError, match="seed must be an integer"):
        RouterConfig(backends=(BackendConfig("http://127.0.0.1:1"),), seed=1.5)  # type: ignore[arg-type]


# ---------------------------------------------------------------- CLI


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pagoda")
    register(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_cli_flags_build_the_config(tmp_path: Path) -> None:
    args = parse(
        [
            "router",
            "--backend",
            "http://127.0.0.1:8001,model=a",
            "--backend",
            "http://127.0.0.1:8002",
            "--policy",
            "power-of-two",
            "--cache-threshold",
            "0.7",
            "--read-timeout",
            "30",
            "--api-key",
            "k",
        ]
    )
    config = build_router_config(args)
    assert [b.url for b in config.backends] == ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    assert config.policy == "power-of-two" and config.api_key == "k" and config.read_timeout_s == 30
    assert config.cache_aware.cache_threshold == 0.7
    path = tmp_path / "router.yaml"
    path.write_text("port: 9001\npolicy: least-load\nbackends: [http://127.0.0.1:8003]\n")
    config = build_router_config(
        parse(["router", "--config", str(path), "--backend", "http://127.0.0.1:8004"])
    )
    assert (
        config.port == 9001 and config.policy == "least-load"
    )  # the file's values stand where no flag is given
    assert [b.url for b in config.backends] == ["http://127.0.0.1:8003", "http://127.0.0.1:8004"]
    assert build_router_config(parse(["router", "--config", str(path), "--port", "9002"])).port == 9002


def test_cli_errors() -> None:
    with pytest.raises(ValueError, match="no backends"):
        build_router_config(parse(["router"]))
    with pytest.raises(SystemExit):
        parse(["router", "--policy", "fastest"])
    with pytest.raises(SystemExit):
        parse(["launch", "m"])  # --replicas is required
    args = parse(["launch", "m", "--replicas", "2", "--serve-args", "--max-model-len 512"])
    assert (args.model, args.replicas, args.base_port, args.serve_args) == (
        "m",
        2,
        8100,
        "--max-model-len 512",
    )


def test_cli_registration_stays_light() -> None:
    code = (
        "import sys, pagoda.router.cli; "
        "heavy = [m for m in ('fastapi', 'httpx', 'uvicorn', 'prometheus_client', 'yaml', 'torch') if m in sys.modules]; "
        "print(heavy)"
    )
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
