"""Running an ASGI app on uvicorn: in the foreground (the CLI) or in a thread (tests, benchmarks)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from vatra._extras import require
from vatra.errors import ConfigError


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (``port=0``: a free one), so the address is known before the server runs."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted connections only when the
    # listening socket says TCP; without it a response's body waits ~40 ms behind its headers.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {err.strerror}; pick another --port") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _server(app: Any) -> Any:
    uvicorn = require("uvicorn", "serve", "vatra model serve")
    # Access logs off: one line per request costs more than a small model's prediction.
    config = uvicorn.Config(
        app, log_level="warning", access_log=False, lifespan="on", timeout_graceful_shutdown=10
    )
    return uvicorn.Server(config)


def run(app: Any, sock: socket.socket) -> None:
    """Serve until interrupted (Ctrl-C finishes the requests in flight, then stops)."""
    # uvicorn re-raises the Ctrl-C after its graceful shutdown: here that is a normal stop
    with contextlib.suppress(KeyboardInterrupt):
        _server(app).run(sockets=[sock])


@contextmanager
def running(app: Any, host: str = "127.0.0.1") -> Iterator[str]:
    """Serve ``app`` on a free port in a background thread; yields its base URL."""
    sock = bind(host, 0)
    server = _server(app)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            sock.close()
            raise RuntimeError("the server did not start (see its log above)")
        time.sleep(0.01)
    try:
        yield url(sock)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
