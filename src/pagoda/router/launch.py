"""`pagoda launch`: N engine processes on consecutive ports and a router in front, stopped together.

The replicas are child processes; the router runs in this process. Everything stops when this
process gets SIGINT or SIGTERM, or when any replica exits: the router shuts down, then every
replica gets SIGTERM and, after a grace period, SIGKILL. On Linux the replicas also get SIGTERM
if this process dies without cleaning up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

logger = logging.getLogger("pagoda.router.launch")

_POLL_S = 0.25  # how often replicas are polled for readiness and for unexpected exits
_STOP_GRACE_S = 15.0  # how long replicas get to exit after SIGTERM before SIGKILL


class _Terminated(Exception):
    """Raised by our SIGTERM handler so that cleanup runs as for Ctrl-C."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise _Terminated()


def default_server_command() -> list[str]:
    return [sys.executable, "-m", "pagoda.entrypoints.cli", "serve"]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise ValueError(f"cannot use port {port} on {host}: {exc.strerror}") from exc


def _validate(model_args: Sequence[str], replicas: int, base_port: int, router_port: int) -> None:
    if isinstance(model_args, str) or not model_args or not all(isinstance(a, str) for a in model_args):
        raise ValueError(f"model_args must be a non-empty list of strings (MODEL first), got {model_args!r}")
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
        raise ValueError(f"replicas must be an integer >= 1, got {replicas!r}")
    if not isinstance(base_port, int) or not 1 <= base_port <= 65535 - (replicas - 1):
        raise ValueError(f"base_port must leave room for {replicas} consecutive ports, got {base_port!r}")
    if base_port <= router_port < base_port + replicas:
        raise ValueError(
            f"router port {router_port} collides with the replica ports {base_port}..{base_port + replicas - 1}"
        )


class _Replicas:
    """The replica processes; `stop` is safe to call at any time and more than once."""

    def __init__(self, command: Sequence[str], host: str, ports: Sequence[int]) -> None:
        self.command = list(command)
        self.host = host
        self.ports = list(ports)
        self.processes: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        preexec = _die_with_parent if sys.platform.startswith("linux") else None
        for port in self.ports:
            argv = [*self.command, "--host", self.host, "--port", str(port)]
            logger.info("starting replica on port %d: %s", port, " ".join(argv))
            self.processes.append(subprocess.Popen(argv, preexec_fn=preexec))

    def exited(self) -> list[tuple[int, int]]:
        """(port, exit code) of every replica that is no longer running."""
        return [
            (port, code)
            for port, p in zip(self.ports, self.processes, strict=True)
            if (code := p.poll()) is not None
        ]

    def wait_healthy(self, timeout_s: float) -> None:
        """Block until every replica answers GET /health with 2xx; RuntimeError if one exits or time runs out."""
        import httpx

        pending = set(self.ports)
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while pending:
                dead = self.exited()
                if dead:
                    port, code = dead[0]
                    raise RuntimeError(f"replica on port {port} exited with code {code} during startup")
                for port in sorted(pending):
                    with contextlib.suppress(httpx.HTTPError):
                        if client.get(f"http://{self.host}:{port}/health").is_success:
                            pending.discard(port)
                            logger.info("replica on port %d is healthy", port)
                if pending and time.monotonic() > deadline:
                    raise RuntimeError(
                        f"replicas on ports {sorted(pending)} not healthy after {timeout_s:.0f}s; giving up"
                    )
                if pending:
                    time.sleep(_POLL_S)

    def stop(self) -> None:
        alive = [p for p in self.processes if p.poll() is None]
        for p in alive:
            with contextlib.suppress(ProcessLookupError):
                p.terminate()
        deadline = time.monotonic() + _STOP_GRACE_S
        for p in alive:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("replica pid %d ignored SIGTERM; killing it", p.pid)
                p.kill()
                p.wait()


async def _serve_router(config: Any, replicas: _Replicas, log_level: str) -> bool:
    """Run the router until it is told to stop or a replica exits; True if a replica exited."""
    import uvicorn

    from pagoda.limits import DEFAULT_KEEP_ALIVE_S
    from pagoda.router.app import create_app

    server = uvicorn.Server(
        uvicorn.Config(
            create_app(config),
            host=config.host,
            port=config.port,
            log_level=log_level,
            access_log=False,
            timeout_keep_alive=DEFAULT_KEEP_ALIVE_S,
        )
    )
    replica_died = False

    async def watch() -> None:
        nonlocal replica_died
        while not server.should_exit:
            dead = replicas.exited()
            if dead:
                logger.error(
                    "replica(s) exited: %s; stopping everything",
                    ", ".join(f"port {p} code {c}" for p, c in dead),
                )
                replica_died = True
                server.should_exit = True
                return
            await asyncio.sleep(_POLL_S)

    watcher = asyncio.create_task(watch())
    try:
        await server.serve()
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    return replica_died


def launch_replicas(
    model_args: list[str],
    replicas: int,
    base_port: int,
    router_host: str = "127.0.0.1",
    router_port: int = 8080,
    policy: str = "cache-aware",
    *,
    server_command: Sequence[str] | None = None,
    replica_host: str = "127.0.0.1",
    router_overrides: Mapping[str, Any] | None = None,
    startup_timeout_s: float = 600.0,
    log_level: str = "info",
) -> int:
    """Start `replicas` servers (`server_command + model_args + --host H --port P`, ports from
    `base_port`), wait for their /health, serve a router on `router_host:router_port` in front, and
    stop them all on SIGINT/SIGTERM or when any replica exits. Returns the process exit code: 0
    after a signal, 1 if a replica failed. Raises ValueError for bad arguments or busy ports.

    `server_command` defaults to `python -m pagoda.entrypoints.cli serve`; `router_overrides` takes
    RouterConfig keys (api_key, cache_aware, health_interval_s, ...).
    """
    from pagoda.router.config import BackendConfig, RouterConfig, config_from_mapping

    _validate(model_args, replicas, base_port, router_port)
    ports = list(range(base_port, base_port + replicas))
    overrides = dict(router_overrides or {})
    clashing = {"backends", "host", "port", "policy"} & set(overrides)
    if clashing:
        raise ValueError(f"router_overrides must not set {sorted(clashing)}; launch sets them")
    config: RouterConfig = config_from_mapping(
        {
            **overrides,
            "backends": [BackendConfig(f"http://{replica_host}:{port}") for port in ports],
            "host": router_host,
            "port": router_port,
            "policy": policy,
        },
        source="launch",
    )
    for port in ports:
        _check_port_free(replica_host, port)
    _check_port_free(router_host, router_port)

    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = {
        signal.SIGTERM: signal.getsignal(signal.SIGTERM),
        signal.SIGINT: signal.getsignal(signal.SIGINT),
    }
    if in_main_thread:
        signal.signal(signal.SIGTERM, _raise_terminated)
    group = _Replicas([*(server_command or default_server_command()), *model_args], replica_host, ports)
    try:
        group.start()
        group.wait_healthy(startup_timeout_s)
        logger.info("%d replicas healthy; router on http://%s:%d", replicas, router_host, router_port)
        return 1 if asyncio.run(_serve_router(config, group, log_level)) else 0
    except (KeyboardInterrupt, _Terminated):
        logger.info("stopping the router and %d replicas", replicas)
        return 0
    except RuntimeError as exc:
        logger.error("%s", exc)
        return 1
    finally:
        if in_main_thread:  # a second Ctrl-C must not cut the cleanup short; stop() is bounded anyway
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            group.stop()
        finally:
            if in_main_thread:
                for signum, handler in previous.items():
                    signal.signal(signum, handler)
