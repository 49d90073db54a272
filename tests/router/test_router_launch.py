"""`pagoda launch`: replicas behind a router, started and stopped as one."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from fakes import (
    CLIENT_TIMEOUT,
    LOOPBACK,
    SRC,
    complete,
    served_by,
    wait_until,
)

from pagoda.router.launch import launch_replicas

pytestmark = pytest.mark.timeout(90)

# ---------------------------------------------------------------- launch


def _free_port_range(n: int) -> int:
    for _ in range(50):
        base = random.randint(20000, 60000)
        try:
            socks = []
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind((LOOPBACK, port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range found")


# A replica for the launch tests: stdlib only, so that it starts in a blink. Usage: MODEL --host H --port P.
LIGHT_REPLICA = """
import json, os, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
model, host, port = sys.argv[1], sys.argv[3], int(sys.argv[5])
assert sys.argv[2] == "--host" and sys.argv[4] == "--port" and host == "127.0.0.1"
open(os.path.join(os.environ["PAGODA_FAKE_PID_DIR"], f"{port}.pid"), "w").write(str(os.getpid()))

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *args):
        pass
    def reply(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        if self.path == "/v1/models":
            self.reply({"object": "list", "data": [{"id": model, "object": "model"}]})
        else:
            self.reply({"status": "ok"})
    def do_POST(self):
        self.rfile.read(int(self.headers["content-length"]))
        self.reply({"choices": [{"index": 0, "text": f"fake{port}-answer", "finish_reason": "stop"}]})

ThreadingHTTPServer((host, port), Handler).serve_forever()
"""


def _start_launcher(tmp_path: Path, replicas: int) -> tuple[subprocess.Popen[str], int, Path]:
    base_port = _free_port_range(replicas + 1)
    router_port = base_port + replicas
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    replica = tmp_path / "replica.py"
    replica.write_text(LIGHT_REPLICA)
    code = (
        "import sys; from pagoda.router.launch import launch_replicas; "
        f"sys.exit(launch_replicas(['m1'], {replicas}, {base_port}, '{LOOPBACK}', {router_port}, 'round-robin', "
        f"server_command=[sys.executable, {str(replica)!r}], startup_timeout_s=60, log_level='warning'))"
    )
    env = {**os.environ, "PYTHONPATH": SRC, "PAGODA_FAKE_PID_DIR": str(pid_dir)}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, text=True)
    router_url = f"http://{LOOPBACK}:{router_port}"

    def router_up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"launcher exited early with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{router_url}/health", timeout=1.0).json()["status"] == "ok"
        return False

    wait_until(router_up, 60)
    return proc, router_port, pid_dir


def _pids(pid_dir: Path) -> list[int]:
    return [int(p.read_text()) for p in pid_dir.iterdir()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # the launcher reaps its children, so a stopped replica disappears entirely
    except ProcessLookupError:
        return False
    return True


def test_launch_serves_through_the_router_and_stops_everything_on_sigterm(tmp_path: Path) -> None:
    proc, router_port, pid_dir = _start_launcher(tmp_path, replicas=2)
    try:
        base = f"http://{LOOPBACK}:{router_port}"
        assert {served_by(complete(base)) for _ in range(4)} == _replica_names(base)
        pids = _pids(pid_dir)
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        wait_until(lambda: not any(_alive(p) for p in pids), 10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def _replica_names(base: str) -> set[str]:
    health = httpx.get(f"{base}/health", timeout=CLIENT_TIMEOUT).json()
    return {f"fake{b['url'].rsplit(':', 1)[1]}" for b in health["backends"]}


def test_launch_stops_everything_when_a_replica_dies(tmp_path: Path) -> None:
    proc, _, pid_dir = _start_launcher(tmp_path, replicas=2)
    try:
        pids = _pids(pid_dir)
        os.kill(pids[0], signal.SIGKILL)
        assert proc.wait(timeout=30) == 1
        wait_until(lambda: not any(_alive(p) for p in pids), 10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_launch_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="replicas must be"):
        launch_replicas(["m"], 0, 9000)
    with pytest.raises(ValueError, match="collides with the replica ports"):
        launch_replicas(["m"], 2, 9000, router_port=9001)
    with pytest.raises(ValueError, match="model_args"):
        launch_replicas([], 1, 9000)
    with pytest.raises(ValueError, match="unknown routing policy"):
        launch_replicas(["m"], 1, 9000, router_port=9100, policy="fastest")
    with socket.socket() as busy:
        busy.bind((LOOPBACK, 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        with pytest.raises(ValueError, match=f"cannot use port {port}"):
            launch_replicas(["m"], 1, port, router_port=port - 1 if port > 1 else port + 1)
