"""Schema fuzzing of a real `pagoda serve` with schemathesis, against the server's own OpenAPI
document: every operation, valid and invalid bodies (positive and negative generation modes).

Checked on every response: no 5xx, no dropped connection (the client raises), the status code,
content type and body are the documented ones, and data the document rejects is rejected
(`negative_data_rejection`, which keeps the document honest). Afterwards no request runs or
waits and no KV block is held, and the engine still answers /health.

The default run is bounded (about 40 cases per operation, a few hundred in all); the `slow` one
generates 1,000 per operation.
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from server_utils import wait_idle

pytestmark = pytest.mark.timeout(1800)

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]
# A short context and small limits keep each generated request cheap on the CPU; the limits are
# in the document, so the fuzzer knows them.
FUZZ_FLAGS = {"served_model_name": "tiny", "max_model_len": 96, "max_n": 3, "max_sequences": 4}


@pytest.fixture(scope="module")
def fuzz_server(pagoda_server_factory, tiny_llama_dir: str) -> str:
    return pagoda_server_factory(tiny_llama_dir, **FUZZ_FLAGS)


@pytest.fixture(scope="module")
def api_schema(fuzz_server: str):
    config = schemathesis.Config.from_dict({"request-timeout": 60})
    return schemathesis.openapi.from_url(fuzz_server + "/openapi.json", config=config)


# Every operation of the document (a test checks the list is complete). schemathesis' own pytest
# plugin does not run under pytest 9, so each operation's cases are drawn with Hypothesis here.
OPERATIONS = [
    ("GET", "/health"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{model_id}"),
    ("GET", "/version"),
    ("GET", "/metrics"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("POST", "/reset_prefix_cache"),
]


def _fuzz(api_schema, server: str, method: str, path: str, max_examples: int) -> None:
    operation = api_schema[path][method]
    cases = st.one_of(
        operation.as_strategy(generation_mode=GenerationMode.POSITIVE),
        operation.as_strategy(generation_mode=GenerationMode.NEGATIVE),
    )

    @settings(
        max_examples=max_examples, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True
    )
    @given(case=cases)
    def run(case) -> None:
        case.call_and_validate(checks=CHECKS)

    run()
    _nothing_left_behind(server)


def test_the_document_lists_every_operation(api_schema) -> None:
    listed = {(op.method.upper(), op.path) for op in (r.ok() for r in api_schema.get_all_operations())}
    assert listed == set(OPERATIONS)


@pytest.mark.parametrize(("method", "path"), OPERATIONS)
def test_fuzz_every_operation(api_schema, fuzz_server: str, method: str, path: str) -> None:
    _fuzz(api_schema, fuzz_server, method, path, max_examples=40)


@pytest.mark.slow
@pytest.mark.parametrize(("method", "path"), OPERATIONS)
def test_fuzz_every_operation_long(api_schema, fuzz_server: str, method: str, path: str) -> None:
    _fuzz(api_schema, fuzz_server, method, path, max_examples=1000)


def _nothing_left_behind(server: str) -> None:
    """After an operation's cases: nothing runs, waits or holds a KV block, and the engine serves."""
    wait_idle(server, timeout_s=60)
    assert httpx.get(server + "/health", timeout=10).status_code == 200
    body = {"prompt": "still fine", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    response = httpx.post(server + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
