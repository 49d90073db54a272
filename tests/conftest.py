"""Shared fixtures: tiny random checkpoints of every supported architecture, the paged-KV harness
(tests/tiny_models.py, which test modules import by that name) and real `pagoda serve` servers."""

from __future__ import annotations

import os

import pytest
import torch

from kernel_variants import variant_params
from pagoda.kernels import build
from tiny_models import TINY_DIMS, TINY_VARIANTS, PagedKVHarness

# Every engine the tests start (here and in server subprocesses) checks the KV block accounting
# after every step, not only when it goes idle.
os.environ.setdefault("PAGODA_CHECK_INVARIANTS", "1")


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Architecture name → folder of a tiny float32 random checkpoint with tokenizer files."""
    from pagoda.models.synthetic import build_random_model

    root = tmp_path_factory.mktemp("tiny_models")
    dirs = {}
    for index, (arch, (tie, shards, extra)) in enumerate(TINY_VARIANTS.items()):
        dirs[arch] = build_random_model(
            root / arch,
            arch,
            **TINY_DIMS,
            tie_word_embeddings=tie,
            dtype=torch.float32,
            shards=shards,
            seed=index,
            initializer_range=0.1,
            max_position_embeddings=512,
            **extra,
        )
    return dirs


@pytest.fixture(params=variant_params())
def variant(request: pytest.FixtureRequest):
    """A CPU kernel variant: a test taking it runs once per variant this machine can execute, and
    every kernel call in it goes to that variant (see tests/kernel_variants.py)."""
    with build.use_variant(request.param):
        yield request.param


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_dirs: dict[str, str]) -> str:
    return tiny_model_dirs["LlamaForCausalLM"]


@pytest.fixture
def paged_harness() -> type[PagedKVHarness]:
    """The harness class; construct it with `(num_blocks, block_size, seed=...)`."""
    return PagedKVHarness


# ---- OpenAI server fixtures (tests/server_utils.py starts real `pagoda serve` processes) ----------
# Small KV pool and float32, so that a server on a tiny model starts fast and behaves the same everywhere.
PAGODA_SERVER_FLAGS = {"dtype": "float32", "num_kv_blocks": 512}


@pytest.fixture(scope="session")
def pagoda_server(tiny_llama_dir: str):
    """Base URL ("http://127.0.0.1:PORT") of a server on the tiny llama model, shared by the session.
    Stopped with SIGTERM at the end, which must exit with status 0."""
    from server_utils import start_server

    server = start_server(tiny_llama_dir, **PAGODA_SERVER_FLAGS)
    yield server.base_url
    code = server.stop()
    assert code == 0, f"pagoda serve exited with {code}; log:\n{server.log()[-3000:]}"


@pytest.fixture(scope="session")
def openai_client(pagoda_server: str):
    """The official `openai` client on the shared server (no retries, a 60 s timeout)."""
    import openai

    return openai.OpenAI(base_url=pagoda_server + "/v1", api_key="unused", max_retries=0, timeout=60.0)


@pytest.fixture(scope="session")
def served_model(openai_client) -> str:
    """The shared server's model name (its /v1/models)."""
    return openai_client.models.list().data[0].id


@pytest.fixture(scope="module")
def pagoda_server_factory():
    """`start(model_dir, **flags) -> base_url`: a server with `--flag value` per keyword (True: `--flag`,
    False: `--no-flag`), on top of float32 and a small KV pool. All are stopped (SIGTERM, exit 0) at the
    end of the module."""
    from server_utils import start_server

    servers = []

    def start(model_dir: str, **flags: object) -> str:
        server = start_server(model_dir, **{**PAGODA_SERVER_FLAGS, **flags})
        servers.append(server)
        return server.base_url

    yield start
    codes = [(server, server.stop()) for server in servers]
    bad = [(s.base_url, code, s.log()[-2000:]) for s, code in codes if code != 0]
    assert not bad, f"servers exited with non-zero status: {bad}"
