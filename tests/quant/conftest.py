"""GGUF files of the tiny test models, written by `pagoda quantize` (once per session and type)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagoda.entrypoints.cli import main
from pagoda.models.synthetic import build_random_model

# A tiny Qwen2 whose rows are multiples of 256, so that the K-quant types are used (not their
# fallbacks): tied head (Q6_K in the M mixtures), q/k/v biases.
K_DIMS = dict(
    hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=512, vocab_size=384
)


def quantize_folder(model_dir: str, out: Path, file_type: str) -> str:
    if not out.exists():
        assert main(["quantize", model_dir, str(out), "--type", file_type, "--quiet"]) == 0
    return str(out)


@pytest.fixture(scope="session")
def quantize_to():
    """`quantize_to(model_dir, out_path, file_type)` runs `pagoda quantize` (once per output)."""
    return quantize_folder


@pytest.fixture(scope="session")
def gguf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf")


@pytest.fixture(scope="session")
def gguf_file(tiny_model_dirs: dict[str, str], gguf_dir: Path):
    """`gguf_file(arch, file_type)` → a GGUF file of the tiny `arch` model."""

    def make(arch: str, file_type: str) -> str:
        return quantize_folder(tiny_model_dirs[arch], gguf_dir / f"{arch}-{file_type}.gguf", file_type)

    return make


@pytest.fixture(scope="session")
def k_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_random_model(
        tmp_path_factory.mktemp("k_model") / "qwen2-k",
        "Qwen2ForCausalLM",
        **K_DIMS,
        tie_word_embeddings=True,
        dtype=torch.float32,
        seed=7,
        initializer_range=0.05,
        max_position_embeddings=512,
    )


@pytest.fixture(scope="session")
def k_gguf_file(k_model_dir: str, gguf_dir: Path):
    """`k_gguf_file(file_type)` → a GGUF file of the K-sized tiny model."""

    def make(file_type: str) -> str:
        return quantize_folder(k_model_dir, gguf_dir / f"qwen2-k-{file_type}.gguf", file_type)

    return make
