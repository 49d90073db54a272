"""An app served by uvicorn on a thread of the test process (import it as `from inproc_server
import serve_in_thread`), for tests that must reach the server's state while it serves."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def serve_in_thread(app: Any, **config: Any) -> Iterator[str]:
    """Serve `app` on a free loopback port until the block ends; yields its base URL. `config`
    goes to uvicorn.Config (log_level "warning" and no access log unless given)."""
    import uvicorn

    config = {"log_level": "warning", "access_log": False, **config}
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    server = uvicorn.Server(uvicorn.Config(app, **config))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
