"""Start a real `pagoda serve` subprocess on a free loopback port, wait for /health, stop it with a signal."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

SRC_DIR = str(Path(__file__).resolve().parents[1] / "src")
STARTUP_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def flags_to_args(flags: dict[str, object]) -> list[str]:
    """{"max_num_seqs": 4, "enable_prefix_caching": False} → ["--max-num-seqs", "4", "--no-enable-prefix-caching"]."""
    args: list[str] = []
    for key, value in flags.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is False:
            args.append("--no-" + flag[2:])
        elif value is not None:
            args += [flag, str(value)]
    return args


class ServerProcess:
    """One `python -m pagoda.entrypoints.cli serve MODEL --port P ...` process; its output goes to a log file."""

    def __init__(self, model_dir: str, args: list[str], env: dict[str, str] | None = None) -> None:
        self.model_dir = model_dir
        self.args = list(args)
        self.extra_env = dict(env or {})
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = Path(tempfile.mkstemp(prefix="pagoda-server-", suffix=".log")[1])

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = STARTUP_TIMEOUT_S) -> ServerProcess:
        """Start and wait for /health; a port taken in the meantime is retried on a new one."""
        for _ in range(3):
            self.port = free_port()
            env = {**os.environ, **self.extra_env}
            env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC_DIR, env.get("PYTHONPATH")) if p)
            cmd = [sys.executable, "-m", "pagoda.entrypoints.cli", "serve", self.model_dir]
            cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning", *self.args]
            with open(self.log_path, "wb") as log:
                self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            if self._wait_healthy(timeout_s):
                return self
            if "address already in use" not in self.log().lower():
                break
        raise RuntimeError(f"pagoda serve did not become healthy; log:\n{self.log()[-4000:]}")

    def _wait_healthy(self, timeout_s: float) -> bool:
        assert self.process is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.base_url + "/health", timeout=2.0).status_code == 200:
                    return True
            time.sleep(0.2)
        self.kill()
        return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """Send `sig` and wait; returns the exit code (killed and -9 if it hangs)."""
        if self.process is None:
            return 0
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.process.returncode

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def start_server(model_dir: str, **flags: object) -> ServerProcess:
    return ServerProcess(model_dir, flags_to_args(flags)).start()


def metrics(base_url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """GET /metrics, parsed by `parse_metrics`."""
    return parse_metrics(
        httpx.get(base_url + "/metrics", headers=headers, timeout=10.0).raise_for_status().text
    )


def parse_metrics(text: str) -> dict[str, float]:
    """Every Prometheus sample as {'name{label="v",...}': value} (labels sorted, model_name left out),
    plus each bare name summed over its labels."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()) if k != "model_name")
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
            values[sample.name] = values.get(sample.name, 0.0) + sample.value if labels else sample.value
    return values


def wait_idle(
    base_url: str, timeout_s: float = 15.0, headers: dict[str, str] | None = None
) -> dict[str, float]:
    """Poll /metrics until no request runs or waits and no KV block is held; returns the last sample.
    Raises AssertionError with the last values if that does not happen in time."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = metrics(base_url, headers)
        idle = (
            m["vllm:num_requests_running"] == 0
            and m["vllm:num_requests_waiting"] == 0
            and m["vllm:kv_cache_usage_perc"] == 0
        )
        if idle:
            return m
        if time.monotonic() > deadline:
            raise AssertionError(
                "server still busy: "
                + ", ".join(
                    f"{k}={m[k]}"
                    for k in (
                        "vllm:num_requests_running",
                        "vllm:num_requests_waiting",
                        "vllm:kv_cache_usage_perc",
                    )
                )
            )
        time.sleep(0.1)
