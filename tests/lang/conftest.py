"""Backends on a real tiny model: pl.Engine in-process and pl.RuntimeEndpoint on a `pagoda serve`
subprocess, with the same engine settings, so the same programs must give the same greedy results."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import pagoda.lang as pl
from tiny_models import TINY_DIMS

from .lang_helpers import ENGINE_FLAGS, LANG_MODEL_CONTEXT


@pytest.fixture(scope="session")
def lang_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from pagoda.models.synthetic import build_random_model

    return build_random_model(
        tmp_path_factory.mktemp("lang_model") / "llama",
        "LlamaForCausalLM",
        **TINY_DIMS,
        tie_word_embeddings=True,
        dtype=torch.float32,
        seed=7,
        initializer_range=0.1,
        max_position_embeddings=LANG_MODEL_CONTEXT,
    )


@pytest.fixture(scope="session")
def lang_server(lang_model_dir: str) -> Iterator[object]:
    from server_utils import start_server

    server = start_server(lang_model_dir, **ENGINE_FLAGS)
    yield server
    code = server.stop()
    assert code == 0, f"pagoda serve exited with {code}; log:\n{server.log()[-3000:]}"


@pytest.fixture(scope="session")
def engine_backend(lang_model_dir: str) -> Iterator[pl.Engine]:
    backend = pl.Engine(lang_model_dir, **ENGINE_FLAGS)
    yield backend
    backend.shutdown()


@pytest.fixture(scope="session")
def http_backend(lang_server) -> Iterator[pl.RuntimeEndpoint]:
    backend = pl.RuntimeEndpoint(lang_server.base_url)
    yield backend
    backend.shutdown()


@pytest.fixture(params=["engine", "http"])
def backend(request: pytest.FixtureRequest):
    """Each backend in turn (tests that compare the two take both fixtures instead)."""
    return request.getfixturevalue(f"{request.param}_backend")
