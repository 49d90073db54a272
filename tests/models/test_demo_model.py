"""The built-in demo model: a standard Hugging Face folder that transformers loads and runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from pagoda.assets import default_model_path

transformers = pytest.importorskip("transformers")

MAX_WEIGHT_BYTES = 10_000_000
PROMPT = "The old man walked slowly"


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return Path(default_model_path())


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    return transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


@pytest.fixture(scope="module")
def hf_model(model_dir: Path):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    model.eval()
    return model


def hf_greedy_ids(model, tokenizer, prompt: str, max_new_tokens: int) -> list[int]:
    """Greedy continuation token ids from transformers: the reference pagoda's engine must match."""
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = model.generate(
            ids, do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens
        )
    return out[0, ids.shape[1] :].tolist()


def test_default_model_path_is_a_complete_folder(model_dir: Path) -> None:
    assert model_dir.is_dir()
    assert model_dir.parent.name == "assets" and model_dir.parent.parent.name == "pagoda"
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "training_report.json",
    ):
        assert (model_dir / name).is_file(), name


def test_weights_are_bfloat16_and_within_budget(model_dir: Path) -> None:
    total = 0
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
            tensor = f.get_tensor(key)
            assert tensor.dtype == torch.bfloat16, key
            total += tensor.numel() * tensor.element_size()
    assert 0 < total <= MAX_WEIGHT_BYTES
    assert (model_dir / "model.safetensors").stat().st_size <= MAX_WEIGHT_BYTES + 64 * 1024


def test_config_is_llama_with_tied_embeddings(model_dir: Path, tokenizer) -> None:
    config = transformers.AutoConfig.from_pretrained(model_dir, local_files_only=True)
    assert config.model_type == "llama"
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.tie_word_embeddings is True
    assert config.vocab_size == len(tokenizer)
    assert config.num_attention_heads % config.num_key_value_heads == 0
    assert config.eos_token_id == tokenizer.eos_token_id


def test_generation_config_stops_on_both_end_tokens(model_dir: Path, tokenizer) -> None:
    gen = json.loads((model_dir / "generation_config.json").read_text())
    expected = {tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")}
    assert set(gen["eos_token_id"]) == expected


def test_tokenizer_round_trips_text(tokenizer) -> None:
    assert tokenizer.eos_token == "<|endoftext|>"
    for text in ("Hello, world!", "  two  spaces\n\nand a tab\tthen — “quotes” é ü 漢字 🙂", ""):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text
    ids = tokenizer("<|im_start|>user<|im_end|><|endoftext|>", add_special_tokens=False)["input_ids"]
    start, end, eos = (
        tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
    )
    assert len({start, end, eos}) == 3 and tokenizer.unk_token_id not in (start, end, eos)
    assert ids[0] == start and ids[-2:] == [end, eos]
    assert tokenizer.decode(ids[1:-2]) == "user"


def test_chat_template_renders_chatml(model_dir: Path, tokenizer) -> None:
    raw = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert "chat_template" in raw
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    )


def test_greedy_generation_is_english_looking_and_deterministic(hf_model, tokenizer) -> None:
    first = hf_greedy_ids(hf_model, tokenizer, PROMPT, max_new_tokens=24)
    second = hf_greedy_ids(hf_model, tokenizer, PROMPT, max_new_tokens=24)
    assert first == second and len(first) == 24
    text = tokenizer.decode(first, skip_special_tokens=True)
    words = text.split()
    assert len(words) >= 5, text
    letters = sum(c.isascii() and (c.isalpha() or c in " ,.;:'\n") for c in text)
    assert letters / len(text) > 0.9, text


def test_default_model_path_reports_a_missing_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    import pagoda.assets

    monkeypatch.setattr(pagoda.assets, "DEMO_MODEL_DIR", "no-such-model")
    with pytest.raises(FileNotFoundError, match="demo model is incomplete"):
        pagoda.assets.default_model_path()
