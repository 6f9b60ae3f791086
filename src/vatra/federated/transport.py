"""Deployment over gRPC with TLS: ``vatra fl server`` and ``vatra fl client``.

No protoc step: four unary methods of ``vatra.fl.Federation`` carry raw bytes (safetensors
messages, :mod:`vatra.federated.wire`). Every call carries ``x-vatra-client`` and
``x-vatra-token`` metadata; the server checks the token against ``tokens.json`` (constant time).

- ``Join`` — say hello; ``Heartbeat`` — every ``heartbeat_s``; a client silent for
  ``heartbeat_s × heartbeat_misses`` is a drop-out (a failure of its round).
- ``Poll`` — long poll: returns the client's task for the current round, ``wait`` or ``done``.
- ``Submit`` — the client's update; rejected (INVALID_ARGUMENT, with the reason, logged in
  events.jsonl) when it is for another round, has the wrong shape or dtype, or holds NaN/inf.

A round waits for all selected clients, drop-outs or ``round_deadline_s``, whichever comes first.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch

from vatra.config import Config
from vatra.errors import ConfigError, VatraError
from vatra.federated._base import Failure, FitIns, FitRes, UploadHook
from vatra.federated.certs import ServerCredentials, client_credentials
from vatra.federated.client import LocalClient, initial_weights
from vatra.federated.compression import build_upload_hook
from vatra.federated.data import Federation, build_federation
from vatra.federated.privacy import build_private_hook
from vatra.federated.secagg.deploy import secagg_reply
from vatra.federated.server import FederatedServer
from vatra.federated.wire import (
    WireError,
    check_update,
    decode,
    decode_ins,
    decode_res,
    encode,
    encode_ins,
    encode_res,
)
from vatra.rundir import RunDir

SERVICE = "vatra.fl.Federation"
MAX_MESSAGE = 512 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
]
# gRPC's default reconnect backoff grows to 120 s: a client that started before its server, or
# outlived a server restart, would sit idle long after the server is back. Cap it at 2 s.
CLIENT_OPTIONS = [
    *GRPC_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]
POLL_WAIT_S = 2.0


class Hub:
    """State shared by the gRPC handler threads and the round loop (guarded by one condition)."""

    def __init__(self, cfg: Config, creds: ServerCredentials, run_dir: RunDir, hook: UploadHook) -> None:
        self.cfg = cfg.federated
        self.creds = creds
        self.run_dir = run_dir
        self.hook = hook
        self.cond = threading.Condition()
        self.last_seen: dict[int, float] = {}
        self.round = 0
        self.tasks: dict[int, bytes] = {}
        self.expected = 0
        self.results: dict[int, FitRes] = {}
        self.failures: dict[int, str] = {}
        self.bytes_down = 0
        self.bytes_up = 0
        self.done = False
        self.stage_tasks: dict[int, bytes] = {}  # secure aggregation: this stage's request per client
        self.stage_replies: dict[int, bytes | str] = {}

    # ------------------------------------------------------------ handlers
    def _auth(self, context: grpc.ServicerContext) -> int:
        md = dict(context.invocation_metadata())
        token = str(md.get("x-vatra-token", ""))
        try:
            cid = int(md.get("x-vatra-client", ""))
        except ValueError:
            cid = -1
        if cid < 0 or not self.creds.check(cid, token):
            reason = f"client {md.get('x-vatra-client')!r}: unknown client id or wrong token"
            self.run_dir.log_event("rejected", reason=reason, peer=context.peer())
            context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)
        with self.cond:
            self.last_seen[cid] = time.monotonic()
        return cid

    def join(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        cid = self._auth(context)
        self.run_dir.log_event("joined", client=cid, peer=context.peer())
        return encode({"kind": "joined", "rounds": self.cfg.rounds, "heartbeat_s": self.cfg.heartbeat_s})

    def heartbeat(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self._auth(context)
        return encode({"kind": "ok"})

    def poll(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        cid = self._auth(context)
        deadline = time.monotonic() + POLL_WAIT_S
        with self.cond:
            while True:
                if cid in self.stage_tasks and cid not in self.stage_replies:
                    return self.stage_tasks[cid]
                if cid in self.tasks and cid not in self.results and cid not in self.failures:
                    blob = self.tasks[cid]
                    self.bytes_down += len(blob)
                    self.run_dir.log_event("task_sent", client=cid, round=self.round, bytes=len(blob))
                    return blob
                if self.done:
                    return encode({"kind": "done"})
                left = deadline - time.monotonic()
                if left <= 0:
                    return encode({"kind": "wait"})
                self.cond.wait(left)

    def submit(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        cid = self._auth(context)
        reason = None
        try:
            res = self.hook.decode(decode_res(request))
        except WireError as err:
            res, reason = None, str(err)
        with self.cond:
            self.bytes_up += len(request)
            if res is not None and res.client_id != cid:
                reason = f"update names client {res.client_id} but the token is client {cid}'s"
            elif res is not None and (res.round != self.round or cid not in self.tasks):
                reason = f"update for round {res.round}, but client {cid} has no task in round {self.round}"
            elif res is not None and cid in self.results:
                reason = f"client {cid} already returned round {self.round}"
            elif res is not None and cid in self.failures:
                reason = f"round {self.round} was already closed for client {cid} ({self.failures[cid]})"
            elif res is not None:
                reason = check_update(res, self.expected)
            if reason is None and res is not None:
                self.results[cid] = res
            elif cid in self.tasks and cid not in self.results:
                self.failures.setdefault(cid, f"rejected: {reason}")
            self.cond.notify_all()
        if reason is not None:
            self.run_dir.log_event("update_rejected", client=cid, round=self.round, reason=reason)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, reason)
        return encode({"kind": "accepted"})

    def secagg(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        secagg_reply(self, self._auth(context), request, context)
        return encode({"kind": "accepted"})

    def handler(self) -> grpc.GenericRpcHandler:
        methods: dict[str, Callable[[bytes, grpc.ServicerContext], bytes]] = {
            "Join": self.join,
            "Heartbeat": self.heartbeat,
            "Poll": self.poll,
            "Submit": self.submit,
            "SecAgg": self.secagg,
        }
        return grpc.method_handlers_generic_handler(
            SERVICE, {name: grpc.unary_unary_rpc_method_handler(fn) for name, fn in methods.items()}
        )

    # ---------------------------------------------------------- round loop
    def _alive(self, now: float) -> set[int]:
        limit = self.cfg.heartbeat_s * self.cfg.heartbeat_misses
        return {c for c, t in self.last_seen.items() if now - t <= limit}

    def available(self) -> list[int]:
        """Alive clients once all configured ones are, or ``min_clients`` after a short grace."""
        start = time.monotonic()
        grace = self.cfg.heartbeat_s * self.cfg.heartbeat_misses
        with self.cond:
            while True:
                now = time.monotonic()
                alive = self._alive(now)
                if len(alive) >= self.cfg.clients or (
                    len(alive) >= self.cfg.min_clients and now - start >= grace
                ):
                    return sorted(alive)
                if now - start > self.cfg.join_timeout_s:
                    raise VatraError(
                        f"only {len(alive)} client(s) connected within federated.join_timeout_s = "
                        f"{self.cfg.join_timeout_s:g} s; federated.min_clients is {self.cfg.min_clients}"
                    )
                self.cond.wait(0.2)

    def fit(
        self, rnd: int, ins: dict[int, FitIns], expected: int
    ) -> tuple[list[FitRes], list[Failure], int, int]:
        with self.cond:
            self.round, self.expected = rnd, expected
            self.tasks = {c: encode_ins(i) for c, i in ins.items()}
            self.results, self.failures = {}, {}
            self.bytes_down = self.bytes_up = 0
            self.cond.notify_all()
            deadline = time.monotonic() + self.cfg.round_deadline_s
            limit = self.cfg.heartbeat_s * self.cfg.heartbeat_misses
            while True:
                now = time.monotonic()
                pending = [c for c in self.tasks if c not in self.results and c not in self.failures]
                if not pending:
                    break
                for c in pending:
                    silent = now - self.last_seen.get(c, 0.0)
                    if silent > limit:
                        self.failures[c] = f"dropped out: no heartbeat for {silent:.1f} s"
                    elif now > deadline:
                        self.failures[c] = f"missed the round deadline ({self.cfg.round_deadline_s:g} s)"
                self.cond.wait(0.2)
            self.tasks = {}
            results = list(self.results.values())
            failures = [Failure(c, r) for c, r in sorted(self.failures.items())]
            return results, failures, self.bytes_down, self.bytes_up

    def finish(self) -> None:
        with self.cond:
            self.done = True
            self.cond.notify_all()


def serve(
    cfg: Config,
    address: str,
    certs: Path,
    run_dir: RunDir,
    *,
    hook: UploadHook | None = None,
    progress: bool = True,
    on_bound: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Run the federated server on ``address`` until ``federated.rounds`` are done."""
    hook = hook or build_private_hook(cfg, run_dir)  # secure aggregation / DP, when configured
    creds = ServerCredentials(certs)
    run_dir.create()
    fed = build_federation(cfg)
    hook = hook or build_upload_hook(cfg, initial_weights(cfg, fed)[1])
    hub = Hub(cfg, creds, run_dir, hook)
    server = grpc.server(ThreadPoolExecutor(max_workers=2 * cfg.federated.clients + 8), options=GRPC_OPTIONS)
    server.add_generic_rpc_handlers((hub.handler(),))
    tls = grpc.ssl_server_credentials([(creds.key, creds.cert)])
    try:
        port = server.add_secure_port(address, tls)
    except RuntimeError as err:
        raise VatraError(f"--address {address}: cannot listen ({err})") from None
    if port == 0:
        raise VatraError(f"--address {address}: cannot listen (address in use or not local)")
    server.start()
    if progress:
        print(f"vatra: federated server on {address} (TLS), run folder {run_dir.path}", flush=True)
    if on_bound is not None:
        on_bound(port)
    try:
        summary = FederatedServer(cfg, fed, run_dir, hook.wrap(hub), hook=hook, progress=progress).run()
        hub.finish()
        time.sleep(min(POLL_WAIT_S, cfg.federated.heartbeat_s) + 0.5)  # let polling clients hear "done"
        return summary
    finally:
        server.stop(grace=1.0)


class RemoteServer:
    """A client's connection: TLS channel plus its id and token on every call."""

    def __init__(self, target: str, ca: bytes, client_id: int, token: str) -> None:
        creds = grpc.ssl_channel_credentials(root_certificates=ca)
        self.channel = grpc.secure_channel(target, creds, options=CLIENT_OPTIONS)
        self.metadata = (("x-vatra-client", str(client_id)), ("x-vatra-token", token))
        self.calls = {
            m: self.channel.unary_unary(f"/{SERVICE}/{m}")
            for m in ("Join", "Heartbeat", "Poll", "Submit", "SecAgg")
        }

    def call(self, method: str, payload: bytes = b"", timeout: float = 30.0) -> bytes:
        return self.calls[method](payload, metadata=self.metadata, timeout=timeout)

    def close(self) -> None:
        self.channel.close()


def run_client(
    cfg: Config,
    target: str,
    client_id: int,
    certs: Path,
    *,
    retry_s: float = 60.0,
    slow_s: float = 0.0,
    hook: UploadHook | None = None,
    progress: bool = True,
) -> int:
    """Join, then train every task the server sends until it says done; returns rounds trained.

    Survives a server restart: on UNAVAILABLE it reconnects for up to ``retry_s`` seconds.
    ``slow_s`` sleeps before each upload (a slow device, for drills and tests).
    """
    if not 0 <= client_id < cfg.federated.clients:
        raise ConfigError(f"--client-id {client_id}: must be in [0, {cfg.federated.clients})")
    torch.set_num_threads(1)
    ca, token = client_credentials(certs, client_id)
    fed: Federation = build_federation(cfg)
    local = LocalClient(cfg, fed, hook or build_private_hook(cfg, device=True))
    remote = RemoteServer(target, ca, client_id, token)
    stop = threading.Event()
    personal: np.ndarray | None = None

    def beat() -> None:
        while not stop.wait(cfg.federated.heartbeat_s):
            try:
                remote.call("Heartbeat", timeout=cfg.federated.heartbeat_s * 2)
            except grpc.RpcError:
                continue

    def say(line: str) -> None:
        if progress:
            print(f"client {client_id}: {line}", flush=True)

    trained = 0
    last_ok = time.monotonic()
    joined = False
    threading.Thread(target=beat, daemon=True).start()
    try:
        while True:
            try:
                if not joined:
                    remote.call("Join")
                    joined = True
                    say(f"joined {target}")
                blob = remote.call("Poll", timeout=POLL_WAIT_S + 30)
                last_ok = time.monotonic()
                meta, _ = decode(blob)
                if meta.get("kind") == "done":
                    say(f"done after {trained} round(s)")
                    return trained
                if meta.get("kind") == "secagg":  # a secure-aggregation stage: answer it
                    remote.call("SecAgg", local.hook.respond(blob))
                    continue
                if meta.get("kind") != "fit_ins":
                    continue
                ins = decode_ins(blob)
                res, personal = local.fit(ins, personal)
                if slow_s:
                    time.sleep(slow_s)
                try:
                    remote.call("Submit", encode_res(res))
                    trained += 1
                    m = res.metrics
                    say(f"round {ins.round}: loss {m['loss_before']:.4f} → {m['loss_after']:.4f}")
                except grpc.RpcError as err:
                    if err.code() != grpc.StatusCode.INVALID_ARGUMENT:
                        raise
                    say(f"round {ins.round}: update rejected: {err.details()}")
            except grpc.RpcError as err:
                code = err.code()
                if code == grpc.StatusCode.UNAUTHENTICATED:
                    raise VatraError(f"server rejected client {client_id}: {err.details()}") from None
                if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise VatraError(f"client {client_id}: {code.name}: {err.details()}") from None
                if time.monotonic() - last_ok > retry_s:
                    raise VatraError(
                        f"client {client_id}: server {target} unreachable for {retry_s:g} s"
                    ) from None
                joined = False
                time.sleep(0.5)
    finally:
        stop.set()
        remote.close()
