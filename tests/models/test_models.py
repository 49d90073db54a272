"""Models against transformers on tiny random checkpoints, the loader, config parsing, the factory."""

from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from pagoda.kernels import build, cpu_gemm
from pagoda.kernels.precision import FP32_MIN_ROWS, cpu_lacks_full_rate_bf16, upcast_to_fp32
from pagoda.layers import Linear, PackedLinear
from pagoda.layers.rotary import RopeConfig
from pagoda.models import CausalLM, load_model, parse_hf_config, supported_architectures
from pagoda.models.synthetic import build_random_model
from tiny_models import TINY_DIMS, TINY_VARIANTS

ARCHS = list(TINY_VARIANTS)
ATOL = 1e-4
NUM_BLOCKS = 64
BLOCK_SIZE = 4
# transformers 5 renamed the KV-cache argument and output field from `past_key_values` to `cache`.
HF_CACHE_NAME = (
    "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"
)


@pytest.fixture(scope="module")
def windowed_model_dirs(tmp_path_factory) -> dict[str, str]:
    """Checkpoints whose sliding windows are shorter than the test prompts."""
    root = tmp_path_factory.mktemp("windowed")
    common = dict(TINY_DIMS, tie_word_embeddings=False, dtype=torch.float32, initializer_range=0.1)
    return {
        "mistral": build_random_model(root / "mistral", "MistralForCausalLM", sliding_window=5, **common),
        # Only layer 1 is windowed (layers >= max_window_layers).
        "qwen2": build_random_model(
            root / "qwen2",
            "Qwen2ForCausalLM",
            use_sliding_window=True,
            sliding_window=6,
            max_window_layers=1,
            **common,
        ),
    }


_HF_CACHE: dict[str, torch.nn.Module] = {}
_PAGODA_CACHE: dict[tuple[str, torch.dtype], CausalLM] = {}


def hf_model(path: str) -> torch.nn.Module:
    if path not in _HF_CACHE:
        _HF_CACHE[path] = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager"
        ).eval()
    return _HF_CACHE[path]


def pagoda_model(path: str, dtype: torch.dtype = torch.float32) -> CausalLM:
    if (path, dtype) not in _PAGODA_CACHE:
        _PAGODA_CACHE[(path, dtype)] = load_model(path, dtype)
    return _PAGODA_CACHE[(path, dtype)]


class Runner:
    """Drives a pagoda model through flat paged batches, like the model runner will."""

    def __init__(self, model: CausalLM, paged_harness, seed: int = 0) -> None:
        self.model = model
        model.bind_kv_cache(model.allocate_kv_caches(NUM_BLOCKS, BLOCK_SIZE))
        self.harness = paged_harness(NUM_BLOCKS, BLOCK_SIZE, seed=seed)
        self.tokens: dict[str, list[int]] = {}

    def step(self, batch: list[tuple[str, list[int]]]) -> dict[str, torch.Tensor]:
        """Feed each sequence its new tokens; returns each sequence's logits for those tokens."""
        step = self.harness.step([(seq_id, len(new)) for seq_id, new in batch])
        input_ids = torch.tensor([t for _, new in batch for t in new], dtype=torch.int64)
        with torch.inference_mode():
            logits = self.model.compute_logits(self.model(input_ids, step.positions, step.metadata))
        out, start = {}, 0
        for seq_id, new in batch:
            self.tokens.setdefault(seq_id, []).extend(new)
            out[seq_id] = logits[start : start + len(new)]
            start += len(new)
        return out


def hf_logits(model: torch.nn.Module, prompt: list[int], decode_tokens: list[int] = ()) -> torch.Tensor:
    """HF logits for every prompt position, then for each decode token fed through HF's own cache."""
    with torch.inference_mode():
        out = model(torch.tensor([prompt]), use_cache=True)
        rows = [out.logits[0].float()]
        cache = getattr(out, HF_CACHE_NAME)
        for token in decode_tokens:
            out = model(torch.tensor([[token]]), use_cache=True, **{HF_CACHE_NAME: cache})
            cache = getattr(out, HF_CACHE_NAME)
            rows.append(out.logits[0].float())
    return torch.cat(rows)


def random_tokens(count: int, seed: int) -> list[int]:
    return torch.randint(
        0, TINY_DIMS["vocab_size"], (count,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_single_prefill_matches_hf(arch, tiny_model_dirs, paged_harness):
    path = tiny_model_dirs[arch]
    prompt = random_tokens(29, seed=1)
    logits = Runner(pagoda_model(path), paged_harness).step([("a", prompt)])["a"]
    assert logits.dtype == torch.float32 and logits.shape == (29, TINY_DIMS["vocab_size"])
    torch.testing.assert_close(logits, hf_logits(hf_model(path), prompt), atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_variable_length_batch_matches_hf(arch, tiny_model_dirs, paged_harness):
    path = tiny_model_dirs[arch]
    prompts = {
        "a": random_tokens(7, 2),
        "b": random_tokens(1, 3),
        "c": random_tokens(23, 4),
        "d": random_tokens(12, 5),
    }
    logits = Runner(pagoda_model(path), paged_harness).step(list(prompts.items()))
    for seq_id, prompt in prompts.items():
        torch.testing.assert_close(logits[seq_id], hf_logits(hf_model(path), prompt), atol=ATOL, rtol=0)


def chunked_prefill_and_decode(path: str, paged_harness) -> None:
    """Sequence a's prompt arrives in two chunks, the second batched with b's decode; then both decode."""
    prompt_a, prompt_b = random_tokens(19, 6), random_tokens(6, 7)
    decodes_a, decodes_b = random_tokens(4, 8), random_tokens(5, 9)
    runner = Runner(pagoda_model(path), paged_harness, seed=2)
    got = {"a": [], "b": []}
    for step in (
        [("a", prompt_a[:11]), ("b", prompt_b)],
        [("b", decodes_b[:1]), ("a", prompt_a[11:])],
        *[[("a", [ta]), ("b", [tb])] for ta, tb in zip(decodes_a, decodes_b[1:], strict=True)],
    ):
        for seq_id, rows in runner.step(step).items():
            got[seq_id].append(rows)
    model = hf_model(path)
    torch.testing.assert_close(torch.cat(got["a"]), hf_logits(model, prompt_a, decodes_a), atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat(got["b"]), hf_logits(model, prompt_b, decodes_b), atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_and_decode_match_hf(arch, tiny_model_dirs, paged_harness):
    chunked_prefill_and_decode(tiny_model_dirs[arch], paged_harness)


@pytest.mark.parametrize("name", ["mistral", "qwen2"])
def test_sliding_window_matches_hf(name, windowed_model_dirs, paged_harness):
    path = windowed_model_dirs[name]
    config = pagoda_model(path).config
    assert config.layer_sliding_windows == ((5, 5) if name == "mistral" else (None, 6))
    chunked_prefill_and_decode(path, paged_harness)
    prompt = random_tokens(25, 10)
    logits = Runner(pagoda_model(path), paged_harness).step([("a", prompt)])["a"]
    torch.testing.assert_close(logits, hf_logits(hf_model(path), prompt), atol=ATOL, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_runs_close_to_float32(dtype, tiny_model_dirs, paged_harness):
    path = tiny_model_dirs["Qwen2ForCausalLM"]
    model = pagoda_model(path, dtype)
    assert model.dtype == dtype and all(p.dtype == dtype for p in model.parameters())
    prompt = random_tokens(21, 11)
    logits = Runner(model, paged_harness).step([("a", prompt)])["a"]
    assert logits.dtype == torch.float32
    reference = hf_logits(hf_model(path), prompt)
    assert (logits - reference).abs().max() < 0.15 * reference.abs().max()


@pytest.mark.skipif(not build.available(), reason="CPU kernels unavailable")
@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_weights_are_packed_for_the_cpu_kernel(arch, tiny_model_dirs, paged_harness, monkeypatch):
    path = tiny_model_dirs[arch]
    packed = load_model(path, torch.bfloat16)
    layers = [m for m in packed.modules() if isinstance(m, Linear | PackedLinear)] + [packed.lm_head]
    assert layers and all(m.packed is not None and m.weight is None for m in layers)
    tied = packed.config.tie_word_embeddings
    assert (packed.model.embed_tokens.weight is None) == tied
    monkeypatch.setattr(CausalLM, "process_weights_after_loading", lambda self: None)
    plain = load_model(path, torch.bfloat16)
    assert plain.lm_head.packed is None
    prompt, decodes = random_tokens(21, 12), random_tokens(3, 13)
    got = {}
    for name, model in (("packed", packed), ("plain", plain)):
        runner = Runner(model, paged_harness)
        rows = [runner.step([("a", prompt)])["a"]] + [runner.step([("a", [t])])["a"] for t in decodes]
        got[name] = torch.cat(rows)
    # Same weights, different (more precise) arithmetic: bf16-level agreement.
    assert (got["packed"] - got["plain"]).abs().max() < 0.05 * got["plain"].abs().max()


def test_compute_logits_only_on_given_rows(tiny_model_dirs, paged_harness):
    model = pagoda_model(tiny_model_dirs["Qwen3ForCausalLM"])
    runner = Runner(model, paged_harness)
    step = runner.harness.step([("a", 9), ("b", 4)])
    with torch.inference_mode():
        hidden = model(torch.tensor(random_tokens(13, 12)), step.positions, step.metadata)
        last_rows = hidden[torch.tensor([8, 12])]
        logits = model.compute_logits(last_rows)
        assert hidden.shape == (13, TINY_DIMS["hidden_size"])
        assert logits.shape == (2, TINY_DIMS["vocab_size"]) and logits.dtype == torch.float32
        torch.testing.assert_close(logits, model.compute_logits(hidden)[[8, 12]])


def dense_weight(layer) -> torch.Tensor:
    """A linear layer's `[out, in]` weight, from the kernel's packed layout where it was packed
    (fp32 and bf16 weights are, where the CPU kernels run)."""
    return layer.weight if layer.packed is None else cpu_gemm.unpack(layer.packed)


def assert_tied(model) -> None:
    """The embedding and the LM head share one weight: the tensor, or the head's packed copy."""
    head, embed = model.lm_head, model.model.embed_tokens
    if head.packed is None:
        assert head.weight is embed.weight
    else:
        assert embed.packed is head.packed and embed.weight is None and head.weight is None


def test_sharded_checkpoint_loads_every_weight(tiny_llama_dir):
    folder = Path(tiny_llama_dir)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2
    model = pagoda_model(tiny_llama_dir)
    checkpoint = {}
    for shard in shards:
        checkpoint.update(load_file(folder / shard))
    layer0 = model.model.layers[0]
    q, k, v = (checkpoint[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    torch.testing.assert_close(dense_weight(layer0.self_attn.qkv_proj), torch.cat([q, k, v]), rtol=0, atol=0)
    gate, up = (checkpoint[f"model.layers.0.mlp.{p}_proj.weight"] for p in ("gate", "up"))
    torch.testing.assert_close(dense_weight(layer0.mlp.gate_up_proj), torch.cat([gate, up]), rtol=0, atol=0)
    assert_tied(model)


def test_model_interface(tiny_model_dirs):
    model = pagoda_model(tiny_model_dirs["Qwen3ForCausalLM"])
    config = model.config
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (2, 4, 2, 32)
    assert (
        config.hidden_size == 64
        and config.vocab_size == 384
        and config.qk_norm
        and config.tie_word_embeddings
    )
    assert model.kv_cache_shape(10, 16) == (2, 10, 16, 2, 32)
    with pytest.raises(ValueError, match="expected 2 KV cache tensors"):
        model.bind_kv_cache(model.allocate_kv_caches(4, 4)[:1])
    with pytest.raises(ValueError, match="bfloat16"):
        model.bind_kv_cache([torch.zeros(model.kv_cache_shape(4, 4), dtype=torch.bfloat16)] * 2)


def test_forward_without_cache_fails_clearly(tiny_model_dirs, paged_harness):
    model = load_model(tiny_model_dirs["MistralForCausalLM"], torch.float32)
    step = paged_harness(8, 4).step([("a", 3)])
    with pytest.raises(RuntimeError, match="bind_kv_cache"):
        model(torch.tensor([1, 2, 3]), step.positions, step.metadata)


def test_tied_checkpoint_with_explicit_lm_head(tiny_model_dirs, tmp_path):
    folder = Path(shutil.copytree(tiny_model_dirs["Qwen3ForCausalLM"], tmp_path / "m"))
    tensors = load_file(folder / "model.safetensors")
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    model = load_model(folder, torch.float32)
    assert_tied(model)
    torch.testing.assert_close(dense_weight(model.lm_head), tensors["model.embed_tokens.weight"])


def rewrite_checkpoint(src: str, dst: Path, edit) -> Path:
    folder = Path(shutil.copytree(src, dst))
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_missing_weight_is_named(tiny_model_dirs, tmp_path):
    folder = rewrite_checkpoint(
        tiny_model_dirs["Qwen2ForCausalLM"],
        tmp_path / "m",
        lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"),
    )
    with pytest.raises(
        ValueError, match=r"missing weights for: model\.layers\.1\.self_attn\.qkv_proj\.bias\[k\]"
    ):
        load_model(folder, torch.float32)


def test_untied_checkpoint_without_lm_head_fails(tiny_model_dirs, tmp_path):
    folder = rewrite_checkpoint(
        tiny_model_dirs["Qwen2ForCausalLM"], tmp_path / "m", lambda t: t.pop("lm_head.weight")
    )
    with pytest.raises(ValueError, match=r"lm_head\.weight"):
        load_model(folder, torch.float32)


def test_unexpected_and_misshapen_tensors_fail(tiny_model_dirs, tmp_path):
    src = tiny_model_dirs["MistralForCausalLM"]
    extra = rewrite_checkpoint(
        src, tmp_path / "extra", lambda t: t.update({"model.layers.7.foo": torch.zeros(2)})
    )
    with pytest.raises(ValueError, match=r"'model\.layers\.7\.foo' matches no model parameter"):
        load_model(extra, torch.float32)

    def shrink(tensors):
        tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"][:-1]

    bad = rewrite_checkpoint(src, tmp_path / "bad", shrink)
    with pytest.raises(ValueError, match=r"up_proj.weight.*shape \(127, 64\) != expected \(128, 64\)"):
        load_model(bad, torch.float32)


def test_unknown_architecture_lists_supported(tiny_model_dirs, tmp_path):
    folder = Path(shutil.copytree(tiny_model_dirs["Qwen2ForCausalLM"], tmp_path / "m"))
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture 'GPTNeoXForCausalLM'") as info:
        load_model(folder, torch.float32)
    for arch in ARCHS:
        assert arch in str(info.value)
    assert sorted(supported_architectures()) == sorted(ARCHS)


def test_missing_folder_config_or_weights(tiny_model_dirs, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_model(tmp_path / "nope", torch.float32)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"no config\.json"):
        load_model(tmp_path / "empty", torch.float32)
    folder = tmp_path / "no_weights"
    folder.mkdir()
    shutil.copy(Path(tiny_model_dirs["Qwen2ForCausalLM"]) / "config.json", folder)
    with pytest.raises(ValueError, match=r"no model\.safetensors"):
        load_model(folder, torch.float32)
    with pytest.raises(ValueError, match="unsupported dtype"):
        load_model(tiny_model_dirs["Qwen2ForCausalLM"], torch.int8)


def test_missing_shard_is_named(tiny_llama_dir, tmp_path):
    folder = Path(shutil.copytree(tiny_llama_dir, tmp_path / "m"))
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match=r"model-00002-of-00002\.safetensors"):
        load_model(folder, torch.float32)


BASE_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 384,
    "max_position_embeddings": 1024,
}
LLAMA3 = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def parse(**overrides):
    return parse_hf_config({**BASE_CONFIG, **overrides})[1]


def test_rope_old_and_new_config_styles_agree():
    old = parse(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", **LLAMA3})
    very_old = parse(rope_theta=500000.0, rope_scaling={"type": "llama3", **LLAMA3})
    new = parse(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3})
    assert old.rope == very_old.rope == new.rope == RopeConfig(500000.0, "llama3", **LLAMA3)
    assert parse().rope == RopeConfig(10000.0, "default")
    assert parse(rope_theta=1e6, rope_scaling=None).rope == RopeConfig(1e6, "default")


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "unsupported rope type 'yarn'"),
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}}, "unsupported rope type 'dynamic'"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}, "llama3 rope scaling needs factor"),
        ({"partial_rotary_factor": 0.5}, "partial rotary"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"quantization_config": {"quant_method": "awq"}}, "quantized"),
        ({"num_attention_heads": 5}, "not divisible"),
        ({"num_key_value_heads": 3}, "multiple of num_kv_heads"),
        ({"vocab_size": 0}, "'vocab_size' must be a positive integer"),
        ({"architectures": []}, "no 'architectures'"),
    ],
)
def test_bad_configs_are_rejected(overrides, match):
    with pytest.raises(ValueError, match=match):
        parse(**overrides)


def test_missing_config_key_is_named():
    config = dict(BASE_CONFIG)
    del config["intermediate_size"]
    with pytest.raises(ValueError, match="missing 'intermediate_size'"):
        parse_hf_config(config)


def test_sliding_window_parsing():
    qwen = {"architectures": ["Qwen2ForCausalLM"], "sliding_window": 32}
    assert parse(**qwen).layer_sliding_windows == (None, None)  # use_sliding_window defaults to off
    assert parse(**qwen, use_sliding_window=True, max_window_layers=1).layer_sliding_windows == (None, 32)
    assert parse(**qwen, use_sliding_window=True, max_window_layers=0).layer_sliding_windows == (32, 32)
    layer_types = ["sliding_attention", "full_attention"]
    assert parse(**qwen, use_sliding_window=True, layer_types=layer_types).layer_sliding_windows == (32, None)
    mistral = {"architectures": ["MistralForCausalLM"]}
    assert parse(**mistral, sliding_window=32).layer_sliding_windows == (32, 32)
    assert parse(**mistral, sliding_window=None).layer_sliding_windows == (None, None)
    # A window covering every position is no window at all.
    assert parse(**mistral, sliding_window=4096).layer_sliding_windows == (None, None)
    assert parse(**mistral, max_position_embeddings=8192).layer_sliding_windows == (4096, 4096)  # HF default
    assert parse(sliding_window=32).layer_sliding_windows == (None, None)  # Llama has none
    with pytest.raises(ValueError, match="sliding_window must be a positive integer"):
        parse(**mistral, sliding_window=-1)


def test_family_flags():
    assert parse(architectures=["Qwen2ForCausalLM"]).qkv_bias
    assert not parse(architectures=["Qwen2ForCausalLM"]).o_proj_bias
    qwen3 = parse(architectures=["Qwen3ForCausalLM"])
    assert qwen3.qk_norm and qwen3.head_dim == 128 and not qwen3.qkv_bias
    llama = parse(attention_bias=True, mlp_bias=True, head_dim=32)
    assert llama.qkv_bias and llama.o_proj_bias and llama.mlp_bias and llama.head_dim == 32
    assert not parse(architectures=["MistralForCausalLM"], attention_bias=True).qkv_bias
    assert parse().head_dim == 16 and not parse().tie_word_embeddings


def test_synthetic_folder_loads_in_transformers_and_tokenizer_round_trips(tiny_llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert tokenizer.eos_token == "<|endoftext|>"
    assert len(tokenizer) <= TINY_DIMS["vocab_size"]
    text = "Hello world — 你好，世界 🐱‍👤 naïve"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode())  # merges apply
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.encode("<|im_end|>", add_special_tokens=False) == [im_end]
    generation = json.loads((Path(tiny_llama_dir) / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tokenizer.eos_token_id, im_end]
    tokenizer_config = json.loads((Path(tiny_llama_dir) / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tokenizer_config["chat_template"]


def test_synthetic_is_deterministic_and_validates(tmp_path):
    kwargs = dict(TINY_DIMS, tie_word_embeddings=True, dtype="bfloat16")
    first = build_random_model(tmp_path / "a", "Qwen3ForCausalLM", seed=5, **kwargs)
    second = build_random_model(tmp_path / "b", "Qwen3ForCausalLM", seed=5, **kwargs)
    a, b = load_file(Path(first) / "model.safetensors"), load_file(Path(second) / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert a["model.norm.weight"].dtype == torch.bfloat16
    assert not torch.equal(a["model.norm.weight"], torch.ones_like(a["model.norm.weight"]))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        build_random_model(tmp_path / "c", "GPT2LMHeadModel", **kwargs)
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        build_random_model(tmp_path / "d", "Qwen3ForCausalLM", **{**kwargs, "vocab_size": 100})


def test_bfloat16_linear_policy_keeps_dtype_and_values():
    generator = torch.Generator().manual_seed(0)
    layer = Linear(96, 80, bias=True, dtype=torch.bfloat16)
    for param in layer.parameters():
        param.copy_(torch.randn(param.shape, generator=generator))
    for rows in (3, FP32_MIN_ROWS + 5):
        x = torch.randn(rows, 96, generator=generator).to(torch.bfloat16)
        out = layer(x)
        assert out.dtype == torch.bfloat16
        exact = x.double() @ layer.weight.double().T + layer.bias.double()
        torch.testing.assert_close(out.double(), exact, atol=0.1, rtol=1e-2)
    assert not upcast_to_fp32(torch.zeros(1, dtype=torch.float32), 10_000)
    assert not upcast_to_fp32(torch.zeros(1, dtype=torch.bfloat16), FP32_MIN_ROWS - 1)
    assert upcast_to_fp32(torch.zeros(1, dtype=torch.bfloat16), FP32_MIN_ROWS) == cpu_lacks_full_rate_bf16()
