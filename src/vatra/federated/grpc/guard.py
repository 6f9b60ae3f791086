"""What a deployed server accepts before any handler runs: authenticated calls, bounded sizes and counts.

- :class:`TokenAuth` is a ``grpc.ServerInterceptor``: every call's ``x-vatra-client`` and
  ``x-vatra-token`` metadata is checked (constant time, :meth:`ServerCredentials.check`) when the
  call arrives, before the method's handler is chosen. Every handler it returns is request-streaming,
  so no thread waits for a body gRPC has not received: a bad call gets ``UNAUTHENTICATED`` at once
  (its body is never awaited or read), and an authenticated call takes one of its client's
  :data:`PER_CLIENT_RPCS` places (more get ``RESOURCE_EXHAUSTED``) before its body is awaited, for
  at most :data:`BODY_WAIT_S` (:class:`BodyWait` cancels it then). So an unauthenticated peer holds
  no capacity, and one token cannot take every server thread.
- :class:`RejectLog` writes at most one ``rejected`` event per peer host every ``every_s`` seconds,
  with the count of the ones it held back, so a token-guessing peer cannot flood ``events.jsonl``.
- :func:`receive_limit` sizes ``grpc.max_receive_message_length`` to about twice the largest
  message the protocol sends; gRPC enforces it while reading the body, before any handler runs
  (``RESOURCE_EXHAUSTED``), so an oversized body costs the server nothing beyond the limit.
- :func:`guarded_server` builds the ``grpc.server``: :func:`max_concurrent_rpcs` pool threads (every
  client's share plus room for rejections), and per-connection limits applied by gRPC's HTTP/2 layer
  before any call is authenticated (:func:`connection_options`).
- :func:`payload_rule` says which ``payload.*`` tensors a fit result may carry for an upload hook.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from vatra.federated._base import UploadHook
from vatra.federated.certs import ServerCredentials
from vatra.federated.model_spec import HEADER_BYTES, PEER_BYTES

CLIENT_KEY = "x-vatra-client"
TOKEN_KEY = "x-vatra-token"
PER_CLIENT_RPCS = 4  # a client's own calls in flight: its long poll, a heartbeat, retries after timeouts
SPARE_RPCS = 16  # room for calls being rejected (unauthenticated, over a client's share)
MIN_MESSAGE = 1024 * 1024
MAX_METADATA = 16 * 1024  # gRPC call metadata (id and token are < 100 bytes)
MAX_PEERS = 4096  # peer hosts RejectLog remembers; beyond, hosts share one counter
# An authenticated call's body must arrive within this: a client's own deadline for one call
# (RemoteServer.call's 30 s), so an honest body never takes longer, while a silent one is cut.
BODY_WAIT_S = 30.0
STREAMS_PER_CONNECTION = 2 * PER_CLIENT_RPCS  # HTTP/2 streams one connection may hold open
QUEUED_RPCS = 256  # calls that may wait for a server thread (memory, not threads)
SIZE_LIMIT = "message limit"  # in the details of a refusal for size: a client does not retry it


def metadata_client(metadata: Iterable[tuple[str, Any]] | None) -> tuple[int, str]:
    """(claimed client id or −1, token) from a call's metadata; never raises."""
    md = {k: v for k, v in metadata or () if isinstance(k, str)}
    raw, token = md.get(CLIENT_KEY, ""), md.get(TOKEN_KEY, "")
    cid = int(raw) if isinstance(raw, str) and raw.isascii() and raw.isdecimal() and len(raw) < 10 else -1
    return cid, token if isinstance(token, str) else ""


def peer_host(peer: str) -> str:
    """``ipv4:10.0.0.7:51234`` → ``ipv4:10.0.0.7`` (a reconnect changes the port, not the host)."""
    return peer.rpartition(":")[0] if peer.count(":") >= 2 else peer


class RejectLog:
    """Rate-limited ``rejected`` events: the first per peer host, then one per ``every_s`` seconds.

    ``log(event, **fields)`` is :meth:`vatra.rundir.RunDir.log_event`; each event carries
    ``suppressed``, the rejections from that host not logged since its previous event.
    Thread-safe (gRPC handler threads call it concurrently).
    """

    def __init__(
        self,
        log: Callable[..., None],
        every_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.log = log
        self.every_s = every_s
        self.clock = clock
        self.lock = threading.Lock()
        self.hosts: dict[str, tuple[float, int]] = {}  # host → (time of its last event, held back since)

    def __call__(self, peer: str, reason: str) -> None:
        host = peer_host(peer)
        with self.lock:
            now = self.clock()
            if host not in self.hosts and len(self.hosts) >= MAX_PEERS:
                for h in [h for h, (t, _) in self.hosts.items() if now - t >= self.every_s]:
                    del self.hosts[h]  # hosts quiet for a full period have nothing held back worth keeping
                if len(self.hosts) >= MAX_PEERS:
                    host = "*"  # too many hosts at once: they share one budget
            last, held = self.hosts.get(host, (-float("inf"), 0))
            if now - last < self.every_s:
                self.hosts[host] = (last, held + 1)
                return
            self.hosts[host] = (now, 0)
        self.log("rejected", reason=reason, peer=peer, suppressed=held)


class BodyWait:
    """Cancels a call whose request message has not arrived within ``limit_s``: one watcher thread
    for all calls, started when a call waits and gone after ``limit_s`` without one.

    ``read(requests, context)`` returns the call's first message (None when the client closed
    without one) or raises ``grpc.RpcError`` once cancelled; ``on_late(peer)`` hears of each cut.
    """

    def __init__(self, limit_s: float, on_late: Callable[[str], None]) -> None:
        self.limit_s = limit_s
        self.on_late = on_late
        self.cond = threading.Condition()
        self.waiting: dict[int, tuple[float, grpc.ServicerContext]] = {}  # key → (deadline, call)
        self.keys = 0
        self.watching = False

    def read(self, requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
        with self.cond:
            key, self.keys = self.keys, self.keys + 1
            self.waiting[key] = (time.monotonic() + self.limit_s, context)
            if not self.watching:
                self.watching = True
                threading.Thread(target=self._watch, name="vatra-body-wait", daemon=True).start()
        try:
            return next(requests, None)
        finally:
            with self.cond:
                self.waiting.pop(key, None)

    def _watch(self) -> None:
        tick = min(1.0, self.limit_s / 4)  # a late call is cut within limit_s + tick
        idle_since = time.monotonic()
        while True:
            with self.cond:
                now = time.monotonic()
                late = [k for k, (t, _) in self.waiting.items() if t <= now]
                contexts = [self.waiting.pop(k)[1] for k in late]
                if self.waiting or contexts:
                    idle_since = now
                elif now - idle_since > self.limit_s:
                    self.watching = False
                    return
            for context in contexts:
                context.cancel()
                self.on_late(context.peer())
            time.sleep(tick)


class TokenAuth(grpc.ServerInterceptor):
    """Authenticates every call from its metadata before gRPC picks the method's handler.

    ``grpc.server(..., interceptors=[TokenAuth(creds, run_dir.log_event)])`` (:func:`guarded_server`).
    Handlers may then read the caller's id with :func:`metadata_client` without checking the token
    again. The unary handlers behind it keep their signature; the interceptor hands them the one
    request message it read.

    ``request_limit`` (bytes, None = off) refuses an authenticated call whose body is larger
    before its handler runs: set it once the model's size is known when the server had to start
    with a looser gRPC limit (a model sized from the first client's data).
    """

    def __init__(
        self,
        creds: ServerCredentials,
        log: Callable[..., None],
        *,
        every_s: float = 10.0,
        body_wait_s: float = BODY_WAIT_S,
    ) -> None:
        self.creds = creds
        self.rejected = RejectLog(log, every_s)
        self.body = BodyWait(
            body_wait_s, lambda peer: self.rejected(peer, f"no request message within {body_wait_s:g} s")
        )
        self.lock = threading.Lock()
        self.in_flight: dict[int, int] = {}
        self.request_limit: int | None = None
        # Request-streaming, so gRPC runs it without waiting for a body: the call ends at once.
        self._deny = grpc.stream_unary_rpc_method_handler(self._unauthenticated)

    def _unauthenticated(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        claimed = dict(context.invocation_metadata() or ()).get(CLIENT_KEY)
        reason = f"client {str(claimed)[:20]!r}: unknown client id or wrong token"
        self.rejected(context.peer(), reason)
        context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)
        return b""  # not reached: abort raises

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        cid, token = metadata_client(handler_call_details.invocation_metadata)
        if cid < 0 or not self.creds.check(cid, token):
            return self._deny
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        return grpc.stream_unary_rpc_method_handler(
            self._limited(cid, handler.unary_unary),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _limited(self, cid: int, behaviour: Callable[[Any, grpc.ServicerContext], Any]) -> Callable[..., Any]:
        def call(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            with self.lock:  # the client's place is taken before its body is awaited
                busy = self.in_flight.get(cid, 0)
                if busy < PER_CLIENT_RPCS:
                    self.in_flight[cid] = busy + 1
            if busy >= PER_CLIENT_RPCS:
                reason = f"client {cid} already has {PER_CLIENT_RPCS} calls in flight"
                self.rejected(context.peer(), reason)
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, reason)
            try:
                request = self.body.read(requests, context)
                if request is None:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a call carries one request message")
                limit = self.request_limit
                if limit is not None and isinstance(request, bytes) and len(request) > limit:
                    reason = (
                        f"client {cid}: a {len(request)}-byte message, over the {limit}-byte {SIZE_LIMIT}"
                    )
                    self.rejected(context.peer(), reason)
                    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, reason)
                return behaviour(request, context)
            finally:
                with self.lock:
                    self.in_flight[cid] -= 1

        return call


def receive_limit(update_floats: int, models: int = 1, clients: int = 0) -> int:
    """Bytes to allow per message: about twice the largest one, at least :data:`MIN_MESSAGE`.

    The largest message holds ``models`` vectors of ``update_floats`` float32 (a fit instruction
    with every cluster model, an update or a masked update of 32-bit words) plus its header;
    ``clients`` > 0 adds :data:`PEER_BYTES` per client for secure-aggregation stages. Compressed
    payloads (values + indices) stay under twice the dense update.
    """
    largest = max(models, 1) * update_floats * 4 + HEADER_BYTES + clients * PEER_BYTES
    return max(2 * largest, MIN_MESSAGE)


def max_concurrent_rpcs(clients: int) -> int:
    """Server threads for ``clients`` clients: their share each plus spare room for rejections."""
    return PER_CLIENT_RPCS * clients + SPARE_RPCS


def server_options(receive: int, send: int) -> list[tuple[str, int]]:
    """Message limits in each direction and a small metadata limit (the server's and a client's)."""
    return [
        ("grpc.max_receive_message_length", receive),
        ("grpc.max_send_message_length", send),
        ("grpc.max_metadata_size", MAX_METADATA),
    ]


def connection_options() -> list[tuple[str, int]]:
    """The server's per-connection limits, applied by gRPC's HTTP/2 layer before any call is
    authenticated: streams open at once, the TLS handshake's time, an idle connection's life, and
    keepalive pings that close a connection whose peer stopped answering (its calls end with it)."""
    return [
        ("grpc.max_concurrent_streams", STREAMS_PER_CONNECTION),
        ("grpc.server_handshake_timeout_ms", 10_000),
        ("grpc.max_connection_idle_ms", 60_000),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
    ]


def guarded_server(auth: TokenAuth, clients: int, receive: int, send: int) -> grpc.Server:
    """A ``grpc.server`` for ``clients`` clients behind ``auth``.

    Its pool has :func:`max_concurrent_rpcs` threads: every client's share, so authenticated calls
    never queue, plus spare ones for rejections (each ends at once, holding no thread). Up to
    :data:`QUEUED_RPCS` more calls may wait for a thread; beyond that gRPC answers
    ``RESOURCE_EXHAUSTED``, which clients retry after a back-off.
    """
    threads = max_concurrent_rpcs(clients)
    return grpc.server(
        ThreadPoolExecutor(max_workers=threads, thread_name_prefix="vatra-fl"),
        interceptors=[auth],
        options=[*server_options(receive, send), *connection_options()],
        maximum_concurrent_rpcs=threads + QUEUED_RPCS,
    )


_COMPRESSED = re.compile(r"(0|[1-9][0-9]{0,5})\.(raw|(0|[1-9][0-9]?)(\.bf16)?)")


def payload_rule(hook: UploadHook) -> Callable[[str], bool] | None:
    """Which ``payload.<name>`` tensors a fit result may carry (``wire.decode_res(allowed_payload=)``).

    The identity decode reads no payload, so a hook that keeps it accepts none; the compression
    hook accepts its per-tensor names for the layout's tensors; any other hook decides itself (None).
    """
    from vatra.federated.compression import CompressedUpload  # imports torch and vatra.comm

    if isinstance(hook, CompressedUpload):
        tensors = len(hook.layout.sizes)

        def compressed(name: str) -> bool:
            match = _COMPRESSED.fullmatch(name)
            return match is not None and int(match.group(1)) < tensors

        return compressed
    if type(hook).decode is UploadHook.decode:
        return lambda name: False
    return None
