"""The engine end to end on every kernel variant and on plain PyTorch: a bf16 model decodes
greedily to the same tokens, with logits that agree within bf16 tolerance."""

from __future__ import annotations

import logging

import pytest

from kernel_variants import RUNNABLE, requires_variants, unresolved_selection
from pagoda.entrypoints.llm import LLM
from pagoda.kernels import build
from pagoda.sampling_params import SamplingParams

PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [300, 2, 8] * 9, [11]]
MAX_TOKENS = 16
TOP = 5


def _generate(path: str, variant: str | None):
    with build.use_variant(variant):
        llm = LLM(path, dtype="bfloat16", num_kv_blocks=64, block_size=4, seed=0)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=TOP, ignore_eos=True)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def _top(step) -> dict[int, float]:
    return {token: lp.logprob for token, lp in step.items()}


def _assert_agree(got_run, ref_run) -> None:
    """Greedy decodes with different arithmetic: the same tokens up to a near tie, log-probs within
    bf16 tolerance."""
    compared = 0
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got_run, ref_run, strict=True):
        for step, (token, ref_token) in enumerate(zip(tokens, ref_tokens, strict=True)):
            got, ref = _top(logprobs[step]), _top(ref_logprobs[step])
            # bf16 tolerance on log-probabilities of order one (different summation and rounding).
            for t in set(got) & set(ref):
                assert abs(got[t] - ref[t]) < 0.1, (step, t, got[t], ref[t])
            compared += 1
            if token != ref_token:
                # Only a near tie may decode differently; the sequences part ways from here.
                assert ref_token in got and got[token] - got[ref_token] < 0.1, (step, got, ref)
                break
    assert compared >= MAX_TOKENS * len(PROMPTS) // 2


@requires_variants
@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_greedy_decode_agrees_on_every_variant_and_plain_pytorch(arch: str, tiny_model_dirs) -> None:
    path = tiny_model_dirs[arch]
    runs = {name: _generate(path, name) for name in RUNNABLE}
    # avx2 and avx512 compute the same bits (fp32 multiply-adds in one order), so their whole
    # outputs are equal; avx512_bf16 multiplies bf16 pairs with vdpbf16ps in its own order.
    fma = [name for name in RUNNABLE if name != "avx512_bf16"]
    for name in fma:
        assert runs[name] == runs[fma[0]], f"{name} differs from {fma[0]}"
    plain = _generate(path, None)
    for name in RUNNABLE:
        _assert_agree(runs[name], plain)


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    return unresolved_selection(monkeypatch)


@requires_variants
def test_llm_logs_the_variant_at_start(fresh, caplog, tiny_model_dirs) -> None:
    with caplog.at_level(logging.INFO, logger=build.__name__):
        LLM(tiny_model_dirs["Qwen2ForCausalLM"], dtype="float32", num_kv_blocks=16)
    [record] = [r for r in caplog.records if r.name == build.__name__]
    assert record.levelno == logging.INFO and f"CPU kernels: {RUNNABLE[0]}" in record.getMessage()


def test_llm_rejects_a_bad_variant_setting(fresh, tiny_model_dirs) -> None:
    fresh.setenv(build.ISA_ENV, "avx1024")
    with pytest.raises(ValueError, match="PAGODA_CPU_ISA='avx1024' is not one of"):
        LLM(tiny_model_dirs["Qwen2ForCausalLM"], dtype="float32", num_kv_blocks=16)


def test_serve_logs_the_fallback_and_rejects_a_bad_setting(fresh, caplog, capsys, tiny_model_dirs) -> None:
    from pagoda.entrypoints import cli
    from pagoda.entrypoints.openai import app

    fresh.setattr(app, "run_server", lambda engine_args, config: 0)
    argv = ["serve", tiny_model_dirs["Qwen2ForCausalLM"], "--dtype", "float32"]
    fresh.setenv(build.ISA_ENV, "none")
    with caplog.at_level(logging.INFO, logger=build.__name__):
        assert cli.main(argv) == 0
    [record] = [r for r in caplog.records if r.name == build.__name__]
    assert record.levelno == logging.INFO and "disabled by PAGODA_CPU_ISA=none" in record.getMessage()
    fresh.setattr(build, "_status", None)
    fresh.setenv(build.ISA_ENV, "avx1024")
    assert cli.main(argv) != 0
    assert "PAGODA_CPU_ISA='avx1024' is not one of" in capsys.readouterr().err
