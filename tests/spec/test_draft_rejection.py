"""The draft-model proposer at temperature > 0, end to end: the engine's sampled continuations
follow the target model's exact distribution, whatever the draft proposes.

A tiny random Llama target and two bad drafts (the target with noise on its weights, about half its
drafts accepted; an unrelated random 1-layer model, almost none accepted). Every request samples
with top_k = 8, so each position has 8 possible tokens and the target's exact distribution p (from
transformers, fp32) is small enough to test. 2,000 requests with the same prompt run with the
draft proposing K = 3 tokens a step; the counts of the first two sampled tokens, and of the third
given the first two, are compared with p by Pearson's chi-square test. Each assertion fails a
correct engine with probability ALPHA = 1e-4 (seeded, so a run is reproducible); an engine whose
sampler skips the residual correction fails them. The first token comes from the prefill step; the
second and third are the ones speculative verification emits (accepted drafts, residual resamples
and bonus tokens)."""

from __future__ import annotations

import pytest
import torch
import transformers

import pagoda.sample.sampler as sampler_module
from pagoda import LLM, SamplingParams
from pagoda.sample.rejection import RejectionRows, prepare_residual
from stats import chi_square, pvalue

ALPHA = 1e-4
TOP_K = 8
NUM_REQUESTS = 2000
PROMPT = [5, 9, 40, 17, 3, 88, 120, 7]


@torch.no_grad()
def next_token_probs(model, prefixes: list[list[int]]) -> torch.Tensor:
    """The target's filtered next-token distribution [N, V] after each prefix (top-k, temperature 1)."""
    logits = model(torch.tensor(prefixes)).logits[:, -1].double()
    probs = torch.softmax(logits, dim=-1)
    kth = probs.topk(TOP_K, dim=-1).values[:, -1:]
    probs = torch.where(probs >= kth, probs, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


@pytest.fixture(scope="module")
def drafts(tmp_path_factory, tiny_llama_dir) -> dict[str, str]:
    """Two bad drafts sharing the target's tokenizer: "noisy", the target with noise on every
    weight (about half its drafts are accepted), and "unrelated", another random 1-layer model
    (almost all rejected: nearly every token comes from the residual)."""
    root = tmp_path_factory.mktemp("drafts")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for weight in model.parameters():
            weight.add_(torch.randn(weight.shape, generator=g) * weight.std() * 0.1)
    model.save_pretrained(root / "noisy")
    transformers.AutoTokenizer.from_pretrained(tiny_llama_dir).save_pretrained(root / "noisy")
    # The target's own config with one layer, fresh random weights.
    config = transformers.AutoConfig.from_pretrained(tiny_llama_dir)
    config.num_hidden_layers = 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(23)
        other = transformers.LlamaForCausalLM(config)
    other.save_pretrained(root / "unrelated")
    transformers.AutoTokenizer.from_pretrained(tiny_llama_dir).save_pretrained(root / "unrelated")
    return {"noisy": str(root / "noisy"), "unrelated": str(root / "unrelated")}


@pytest.fixture
def one_thread():
    """A model this small gains nothing from threads; one keeps the test cheap on a loaded machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def continuation_pvalues(target: str, draft: str, seed: int) -> tuple[float, float]:
    """Run NUM_REQUESTS requests with the draft proposing; the p-values of the first two tokens'
    joint law and of the third token given the first two."""
    k = 3
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": k, "max_running": 256}
    llm = LLM(target, dtype="float32", speculative_config=spec, num_kv_blocks=2048, seed=seed)
    # max_tokens leaves room for k drafts after the first token (the prefill's).
    params = SamplingParams(temperature=1.0, top_k=TOP_K, max_tokens=k + 2, ignore_eos=True)
    outs = llm.generate([PROMPT] * NUM_REQUESTS, params, use_tqdm=False)
    seqs = torch.tensor([o.outputs[0].token_ids for o in outs])[:, :3]
    stats = llm.engine.stats()
    # Full spans were drafted, some drafts accepted and some rejected: every path ran.
    assert stats.spec_num_draft_tokens > 2 * stats.spec_num_drafts > NUM_REQUESTS
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens

    model = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    p1 = next_token_probs(model, [PROMPT])[0]
    support = p1.nonzero().squeeze(1).tolist()
    p2 = torch.zeros(vocab, vocab, dtype=torch.float64)
    p2[support] = next_token_probs(model, [PROMPT + [a] for a in support])

    # The first two tokens: their joint law p1(a) p2(b | a).
    pairs = torch.bincount(seqs[:, 0] * vocab + seqs[:, 1], minlength=vocab * vocab)
    first_two = pvalue(*chi_square(pairs, p1.unsqueeze(1) * p2))

    # The third given the first two: each observed prefix's counts against its own p (the sum of
    # the statistics, and of their degrees of freedom).
    prefixes = sorted({(a, b) for a, b in seqs[:, :2].tolist()})
    p3 = next_token_probs(model, [PROMPT + list(ab) for ab in prefixes])
    total_stat, total_df = 0.0, 0
    for (a, b), probs in zip(prefixes, p3, strict=True):
        chosen = seqs[(seqs[:, 0] == a) & (seqs[:, 1] == b), 2]
        stat, df = chi_square(torch.bincount(chosen, minlength=vocab), probs)
        total_stat, total_df = total_stat + stat, total_df + df
    return first_two, pvalue(total_stat, total_df)


@pytest.mark.parametrize("draft", ["noisy", "unrelated"])
@pytest.mark.usefixtures("one_thread")
def test_sampled_continuations_follow_the_target_distribution(tiny_llama_dir, drafts, draft):
    first_two, third = continuation_pvalues(tiny_llama_dir, drafts[draft], seed=7)
    assert first_two > ALPHA
    assert third > ALPHA


@pytest.mark.usefixtures("one_thread")
def test_a_sampler_without_the_residual_correction_is_detected(tiny_llama_dir, drafts, monkeypatch):
    """The same test fails an engine whose rejected rows draw from p instead of max(0, p - q)."""

    def without_residual(probs: torch.Tensor, rows: RejectionRows) -> torch.Tensor:
        saved = probs.clone()
        accepted = prepare_residual(probs, rows)
        probs.copy_(saved)
        return accepted

    monkeypatch.setattr(sampler_module, "prepare_residual", without_residual)
    first_two, third = continuation_pvalues(tiny_llama_dir, drafts["noisy"], seed=7)
    assert first_two < ALPHA
    assert third < ALPHA
