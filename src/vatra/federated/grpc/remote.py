"""A client's connection to a deployed server (:class:`RemoteServer`) and its retries: capped
exponential back-off with jitter for calls a busy or absent server refused.

A server that is busy answers ``RESOURCE_EXHAUSTED`` before any handler runs (its call limit, or the
client's own share of calls in flight, :mod:`vatra.federated.grpc.guard`): nothing was done, so the
same call is sent again. ``UNAVAILABLE`` means the server or the link is down; the caller decides
what else to redo (a restarted server must be joined again). A message refused for its size is
never retried: it would be refused again.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TypeVar

import grpc

from vatra.federated.grpc.guard import SIZE_LIMIT

T = TypeVar("T")

SERVICE = "vatra.fl.Federation"
# gRPC's default reconnect backoff grows to 120 s: a client that started before its server, or
# outlived a server restart, would sit idle long after the server is back. Cap it at 2 s.
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]
BASE_S = 0.2  # the first wait
CAP_S = 2.0  # the longest wait, as gRPC's reconnect back-off (RECONNECT_OPTIONS)


def backoff_s(attempt: int, rng: Callable[[], float] = random.random) -> float:
    """Seconds to wait before retry ``attempt`` (0, 1, …): ``min(CAP_S, BASE_S · 2^attempt)`` times a
    random factor in [0.5, 1), so clients refused together do not come back together."""
    return min(CAP_S, BASE_S * 2.0 ** min(attempt, 32)) * (0.5 + 0.5 * rng())


def server_busy(err: grpc.RpcError) -> bool:
    """A ``RESOURCE_EXHAUSTED`` that says "later", not "too large" (gRPC's own size refusal or vatra's)."""
    if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return False
    details = err.details() or ""
    return SIZE_LIMIT not in details and "larger than max" not in details


def retry_busy(
    send: Callable[[], T],
    budget_s: float,
    *,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    rng: Callable[[], float] = random.random,
) -> T:
    """``send()``, sent again after a back-off while the server is busy (:func:`server_busy`), for up
    to ``budget_s`` seconds; then, or on any other error, the error is raised."""
    start = clock()
    attempt = 0
    while True:
        try:
            return send()
        except grpc.RpcError as err:
            if not server_busy(err):
                raise
            wait = backoff_s(attempt, rng)
            if clock() + wait - start > budget_s:
                raise
        sleep(wait)
        attempt += 1


class RemoteServer:
    """A client's connection: TLS channel plus its id and token on every call.

    A call the server refuses as busy (``RESOURCE_EXHAUSTED`` before any handler ran) is sent again
    after a capped exponential back-off with jitter for up to ``busy_s`` seconds
    (:func:`retry_busy`); ``retry=False`` sends it once.
    """

    def __init__(
        self,
        target: str,
        ca: bytes,
        client_id: int,
        token: str,
        options: list[tuple[str, int]] | None = None,
        busy_s: float = 60.0,
    ) -> None:
        creds = grpc.ssl_channel_credentials(root_certificates=ca)
        self.channel = grpc.secure_channel(target, creds, options=[*(options or []), *RECONNECT_OPTIONS])
        self.metadata = (("x-vatra-client", str(client_id)), ("x-vatra-token", token))
        self.busy_s = busy_s
        self.calls = {
            m: self.channel.unary_unary(f"/{SERVICE}/{m}")
            for m in ("Contract", "Join", "Heartbeat", "Poll", "Submit", "SecAgg")
        }

    def call(self, method: str, payload: bytes = b"", timeout: float = 30.0, *, retry: bool = True) -> bytes:
        send = self.calls[method]
        return retry_busy(
            lambda: send(payload, metadata=self.metadata, timeout=timeout), self.busy_s if retry else 0.0
        )

    def close(self) -> None:
        self.channel.close()
