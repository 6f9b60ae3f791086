"""What a deployed server accepts before any handler runs: authenticated calls, bounded sizes and counts.

- :class:`TokenAuth` is a ``grpc.ServerInterceptor``: every call's ``x-vatra-client`` and
  ``x-vatra-token`` metadata is checked (constant time, :meth:`ServerCredentials.check`) when the
  call arrives, before the method's handler is chosen; a bad call gets ``UNAUTHENTICATED`` from a
  handler that ignores the body (gRPC still receives it, up to the receive limit: keep that tight).
  An authenticated client may hold at most :data:`PER_CLIENT_RPCS` calls at once (more get
  ``RESOURCE_EXHAUSTED``), so one token cannot take every server thread.
- :class:`RejectLog` writes at most one ``rejected`` event per peer host every ``every_s`` seconds,
  with the count of the ones it held back, so a token-guessing peer cannot flood ``events.jsonl``.
- :func:`receive_limit` sizes ``grpc.max_receive_message_length`` to about twice the largest
  message the protocol sends; gRPC enforces it while reading the body, before any handler runs
  (``RESOURCE_EXHAUSTED``), so an oversized body costs the server nothing beyond the limit.
- :func:`max_concurrent_rpcs` caps the calls in flight for N clients (``grpc.server``'s
  ``maximum_concurrent_rpcs``; use the same number of pool threads so accepted calls never queue).
- :func:`payload_rule` says which ``payload.*`` tensors a fit result may carry for an upload hook.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import grpc

from vatra.federated._base import UploadHook
from vatra.federated.certs import ServerCredentials

CLIENT_KEY = "x-vatra-client"
TOKEN_KEY = "x-vatra-token"
PER_CLIENT_RPCS = 4  # a client's own calls in flight: its long poll, a heartbeat, retries after timeouts
SPARE_RPCS = 16  # room for calls being rejected (unauthenticated, over a client's share)
MIN_MESSAGE = 1024 * 1024
HEADER_BYTES = 64 * 1024  # safetensors header + JSON metadata (metrics, config) of one message
PEER_BYTES = 1024  # secure aggregation: a key, a ciphertext or a share per other client
MAX_METADATA = 16 * 1024  # gRPC call metadata (id and token are < 100 bytes)
MAX_PEERS = 4096  # peer hosts RejectLog remembers; beyond, hosts share one counter


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


class TokenAuth(grpc.ServerInterceptor):
    """Authenticates every call from its metadata before gRPC picks the method's handler.

    ``grpc.server(..., interceptors=[TokenAuth(creds, run_dir.log_event)])``. Handlers may then read
    the caller's id with :func:`metadata_client` without checking the token again.

    ``request_limit`` (bytes, None = off) refuses an authenticated call whose body is larger
    before its handler runs: set it once the model's size is known when the server had to start
    with a looser gRPC limit (a model sized from the first client's data).
    """

    def __init__(self, creds: ServerCredentials, log: Callable[..., None], *, every_s: float = 10.0) -> None:
        self.creds = creds
        self.rejected = RejectLog(log, every_s)
        self.lock = threading.Lock()
        self.in_flight: dict[int, int] = {}
        self.request_limit: int | None = None
        self._deny = grpc.unary_unary_rpc_method_handler(self._unauthenticated)

    def _unauthenticated(self, request: bytes, context: grpc.ServicerContext) -> bytes:
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
        return grpc.unary_unary_rpc_method_handler(
            self._limited(cid, handler.unary_unary),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _limited(self, cid: int, behaviour: Callable[[Any, grpc.ServicerContext], Any]) -> Callable[..., Any]:
        def call(request: Any, context: grpc.ServicerContext) -> Any:
            limit = self.request_limit
            if limit is not None and isinstance(request, bytes) and len(request) > limit:
                reason = f"client {cid}: a {len(request)}-byte message, over the {limit}-byte limit"
                self.rejected(context.peer(), reason)
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, reason)
            with self.lock:
                busy = self.in_flight.get(cid, 0)
                if busy < PER_CLIENT_RPCS:
                    self.in_flight[cid] = busy + 1
            if busy >= PER_CLIENT_RPCS:
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"client {cid} already has {PER_CLIENT_RPCS} calls in flight",
                )
            try:
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
    """Calls in flight for ``clients`` clients: their share each plus spare room for rejections."""
    return PER_CLIENT_RPCS * clients + SPARE_RPCS


def server_options(receive: int, send: int) -> list[tuple[str, int]]:
    """``grpc.server`` options: message limits in each direction and a small metadata limit."""
    return [
        ("grpc.max_receive_message_length", receive),
        ("grpc.max_send_message_length", send),
        ("grpc.max_metadata_size", MAX_METADATA),
    ]


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
