"""speculative_config as vLLM spells it: on LLM(...), EngineArgs and `pagoda serve
--speculative-config`, validated with errors that name the problem."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagoda import LLM
from pagoda.config import EngineArgs, SpeculativeConfig
from pagoda.entrypoints.cli import build_parser
from pagoda.entrypoints.serve_cli import _engine_args


@pytest.mark.parametrize(
    "config,message",
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "unknown method 'eagle'"),
        ({"num_speculative_tokens": 2}, "needs a 'method'"),
        ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown key(s) 'lookahead'"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a positive"),
        ({"method": "ngram", "num_speculative_tokens": 65}, "at most 64"),
        ({"method": "ngram", "num_speculative_tokens": "4"}, "num_speculative_tokens must be a positive"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3},
            "must not exceed",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "max_running": 0}, "max_running"),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_bad_configs_are_clear_errors(tiny_llama_dir, config, message):
    with pytest.raises(ValueError, match="speculative_config") as info:
        EngineArgs(model=tiny_llama_dir, speculative_config=config)
    assert message in str(info.value)
    with pytest.raises(ValueError, match="speculative_config"):
        LLM(tiny_llama_dir, speculative_config=config)


def test_lookup_bounds_follow_each_other():
    assert (
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3}).prompt_lookup_min == 2
    )
    only_max = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 1}
    )
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (1, 1)
    only_min = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 6}
    )
    assert (only_min.prompt_lookup_min, only_min.prompt_lookup_max) == (6, 6)


def test_serve_flag(tiny_llama_dir):
    parser = build_parser()
    text = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}'
    args = parser.parse_args(["serve", tiny_llama_dir, "--speculative-config", text])
    engine_args = _engine_args(args, tiny_llama_dir)
    assert engine_args.speculative_config == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 2,
    }
    llm_config = LLM(tiny_llama_dir, speculative_config=engine_args.speculative_config).engine.core.config
    assert llm_config.speculative.num_speculative_tokens == 3
    assert llm_config.speculative.max_running is not None  # the CPU's load gate


def test_serve_rejects_bad_configs(tiny_llama_dir):
    run = [sys.executable, "-m", "pagoda.entrypoints.cli", "serve", tiny_llama_dir, "--speculative-config"]
    bad_json = subprocess.run([*run, "{method: ngram}"], capture_output=True, text=True, timeout=120)
    assert bad_json.returncode == 2 and "--speculative-config" in bad_json.stderr
    bad_key = subprocess.run(
        [*run, '{"method": "ngram", "num_speculative_tokens": 2, "k": 1}'],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad_key.returncode != 0 and "unknown key(s) 'k'" in bad_key.stderr
