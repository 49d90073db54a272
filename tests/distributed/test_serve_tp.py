"""`pagoda serve --tensor-parallel-size 2` as real processes through the official `openai` client:
the two-node form as two process groups on 127.0.0.1 (rank 0 serving, rank 1 `--headless`), and a
worker rank killed mid-request (the client gets an error, the server exits within the bound)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from pagoda import LLM, SamplingParams
from server_utils import SRC_DIR, ServerProcess, free_port

FLAGS = ["--dtype", "float32", "--num-kv-blocks", "64", "--block-size", "4"]
# A dead rank fails the collective in progress at once (its sockets close); the server then fails
# its requests and exits. The bound allows for this loaded 2-core machine.
EXIT_BOUND_S = 30.0
PROMPT = "The quick brown fox"


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _children(pid: int) -> list[int]:
    pids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        pids += [int(p) for p in text]
    return pids


def test_two_nodes_as_two_process_groups_serve_what_one_rank_serves(tiny_llama_dir):
    with LLM(tiny_llama_dir, dtype="float32", num_kv_blocks=64, block_size=4) as llm:
        expected = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text
    port = free_port()
    common = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1"]
    common += ["--master-port", str(port), "--distributed-timeout", "120"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (SRC_DIR, os.environ.get("PYTHONPATH")) if p),
    }
    headless_log = open(Path(ServerProcess(tiny_llama_dir, []).log_path), "wb")  # noqa: SIM115
    headless = subprocess.Popen(
        [sys.executable, "-m", "pagoda.entrypoints.cli", "serve", tiny_llama_dir, *FLAGS, *common]
        + ["--node-rank", "1", "--headless"],
        stdout=headless_log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    server = ServerProcess(tiny_llama_dir, [*FLAGS, *common, "--node-rank", "0"])
    try:
        server.start()
        client = _client(server)
        model = client.models.list().data[0].id
        done = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
        assert done.choices[0].text == expected
        streamed = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=12, temperature=0, stream=True
        )
        assert "".join(chunk.choices[0].text for chunk in streamed) == expected
        assert server.stop() == 0, server.log()[-3000:]
        # Node 0's shutdown message stops the headless node's rank, which exits cleanly.
        assert headless.wait(60) == 0
    finally:
        server.kill()
        if headless.poll() is None:
            headless.kill()
        headless_log.close()


def test_a_killed_worker_rank_fails_the_request_and_the_server_exits_within_the_bound(tiny_llama_dir):
    server = ServerProcess(tiny_llama_dir, [*FLAGS, "--tensor-parallel-size", "2"]).start()
    try:
        client = _client(server)
        model = client.models.list().data[0].id
        stream = client.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=200,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        next(iter(stream))  # the request is in flight
        workers = _children(server.process.pid)
        assert workers, "no worker rank process"
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(openai.APIError, match="tensor-parallel"):
            for _ in stream:
                pass
        code = server.process.wait(EXIT_BOUND_S)
        assert time.monotonic() - killed < EXIT_BOUND_S
        assert code == 1
        log = server.log()
        assert "tensor-parallel" in log and "exit code -9" in log, log[-3000:]
    finally:
        server.kill()


def test_an_idle_server_whose_worker_rank_dies_exits(tiny_llama_dir):
    server = ServerProcess(tiny_llama_dir, [*FLAGS, "--tensor-parallel-size", "2"]).start()
    try:
        for pid in _children(server.process.pid):
            os.kill(pid, signal.SIGKILL)
        assert server.process.wait(EXIT_BOUND_S) == 1
        assert "tensor-parallel rank 1 exited (exit code -9)" in server.log()
    finally:
        server.kill()
