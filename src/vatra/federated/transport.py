"""Deployment over gRPC with TLS: ``vatra fl server`` and ``vatra fl client``.

No protoc step: four unary methods of ``vatra.fl.Federation`` carry raw bytes (safetensors
messages, :mod:`vatra.federated.wire`). Every call carries ``x-vatra-client`` and
``x-vatra-token`` metadata; the server checks the token against ``tokens.json`` (constant time).

- ``Join`` — say hello with the shape of its data (:func:`~vatra.federated.data.spec_to_json`:
  input shape, classes; no rows, no names) and its training-row count. Without ``--eval-data`` the
  server builds its model from the first client's spec; a client whose spec differs is refused.
- ``Heartbeat`` — every ``heartbeat_s``; a client silent for ``heartbeat_s × heartbeat_misses`` is
  a drop-out (a failure of its round).
- ``Poll`` — long poll: returns the client's task for the current phase (train, or evaluate on its
  own held-out rows: ``config["phase"] == "evaluate"``), ``wait`` or ``done``.
- ``Submit`` — the client's update or evaluation report; rejected (INVALID_ARGUMENT, with the
  reason, logged in events.jsonl) when it is for another round, has the wrong shape or dtype, or
  holds NaN/inf.

Each client holds its own data (``vatra fl client --data``; the server never builds client data)
and the server evaluates on its own held-out file when given (``vatra fl server --eval-data``).
A round's training phase waits for all selected clients, drop-outs or ``round_deadline_s``
(one deadline for the whole round, secure-aggregation stages included), whichever comes first.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch

from vatra.config import Config
from vatra.data import DatasetSpec, build_dataset
from vatra.errors import ConfigError, VatraError
from vatra.federated._base import EvalRes, Failure, FitIns, FitRes, UploadHook
from vatra.federated.certs import ServerCredentials, client_credentials
from vatra.federated.client import LocalClient, initial_weights
from vatra.federated.compression import build_upload_hook
from vatra.federated.data import (
    ClientData,
    data_context,
    load_source,
    own_data,
    spec_from_json,
    spec_to_json,
)
from vatra.federated.guard import (
    TokenAuth,
    guarded_server,
    metadata_client,
    payload_rule,
    receive_limit,
    server_options,
)
from vatra.federated.privacy import build_private_hook
from vatra.federated.remote import SERVICE, RemoteServer, backoff_s
from vatra.federated.secagg import SecAggError
from vatra.federated.secagg.deploy import secagg_reply
from vatra.federated.server import FederatedServer
from vatra.federated.wire import (
    WireError,
    check_update,
    decode,
    decode_eval_res,
    decode_ins,
    decode_res,
    decode_views,
    encode,
    encode_eval_res,
    encode_ins,
    encode_res,
)
from vatra.rundir import RunDir


def message_sizes(cfg: Config, floats: int) -> tuple[int, int]:
    """(largest upload, largest download) the protocol sends for a model of ``floats`` parameters:
    the guard's limits."""
    fc = cfg.federated
    peers = fc.clients if fc.secure_aggregation.enabled else 0
    models = fc.clusters if fc.strategy == "clustered" else 1
    return receive_limit(floats, 1, peers), receive_limit(floats, models, peers)


POLL_WAIT_S = 2.0


class Hub:
    """State shared by the gRPC handler threads and the round loop (guarded by one condition)."""

    def __init__(
        self,
        cfg: Config,
        creds: ServerCredentials,
        run_dir: RunDir,
        hook: UploadHook,
        spec: DatasetSpec | None = None,
    ) -> None:
        self.cfg = cfg.federated
        self.creds = creds
        self.run_dir = run_dir
        self.hook = hook
        self.cond = threading.Condition()
        self.spec = spec  # the model's data spec: the server's eval data, else the first client's
        self.declared: dict[int, int] = {}  # training rows each client declared at join
        self.last_seen: dict[int, float] = {}
        self.round = 0
        self.phase = "fit"
        self.round_deadline = 0.0  # monotonic: the whole round (training and secure aggregation)
        self.tasks: dict[int, bytes] = {}
        self.expected = 0
        self.results: dict[int, FitRes | EvalRes] = {}
        self.failures: dict[int, str] = {}
        self.bytes_down = 0
        self.bytes_up = 0
        self.done = False
        self.payload_ok: Callable[[str], bool] | None = None  # payload tensors a fit result may carry
        self.stage_tasks: dict[int, bytes] = {}  # secure aggregation: this stage's request per client
        self.stage_replies: dict[int, bytes | str] = {}

    # ------------------------------------------------------------ handlers
    def _auth(self, context: grpc.ServicerContext) -> int:
        """The caller's id; the interceptor (:class:`~vatra.federated.guard.TokenAuth`) has checked
        its token before any body was read (checked again here: cheap, and handlers stay safe alone)."""
        cid, token = metadata_client(context.invocation_metadata())
        if cid < 0 or not self.creds.check(cid, token):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "unknown client id or wrong token")
        with self.cond:
            self.last_seen[cid] = time.monotonic()
        return cid

    def join(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        cid = self._auth(context)
        try:
            meta, _ = decode_views(request)
            spec = spec_from_json(meta.get("spec"))
            given = meta.get("num_train")
            if not isinstance(given, int) or isinstance(given, bool) or not 0 < given < 2**53:
                raise ValueError(f"num_train must be a positive integer, got {given!r}")
            rows = given
        except (WireError, ValueError, TypeError) as err:
            reason = f"client {cid}: a join must say the shape of its data ({err})"
            self.run_dir.log_event("join_refused", client=cid, reason=reason)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, reason)
        with self.cond:
            if self.spec is None:
                self.spec = spec
                self.run_dir.log_event("model_spec", client=cid, spec=spec_to_json(spec))
                self.cond.notify_all()
            mine, theirs = spec_to_json(self.spec), spec_to_json(spec)
        if mine != theirs:
            diff = {k: (theirs[k], mine[k]) for k in mine if mine[k] != theirs.get(k)}
            reason = f"client {cid}'s data does not fit the server's model: (client, server) = {diff}"
            self.run_dir.log_event("join_refused", client=cid, reason=reason)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, reason)
        with self.cond:
            self.declared[cid] = rows
        self.run_dir.log_event("joined", client=cid, peer=context.peer(), rows=rows)
        return encode({"kind": "joined", "rounds": self.cfg.rounds, "heartbeat_s": self.cfg.heartbeat_s})

    def wait_spec(self) -> DatasetSpec:
        """The model's data spec: known already, or the first joining client's."""
        deadline = time.monotonic() + self.cfg.join_timeout_s
        with self.cond:
            while self.spec is None:
                if time.monotonic() > deadline:
                    raise VatraError(
                        f"no client joined within federated.join_timeout_s = {self.cfg.join_timeout_s:g} s "
                        "(the server learns the model's input shape from the first client, or from "
                        "--eval-data)"
                    )
                self.cond.wait(0.2)
            return self.spec

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
        res: FitRes | EvalRes | None
        try:
            if self.phase == "eval":
                res = decode_eval_res(request)
            else:
                res = self.hook.decode(decode_res(request, allowed_payload=self.payload_ok))
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
            elif isinstance(res, FitRes):
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

    def _phase(
        self, phase: str, rnd: int, ins: dict[int, FitIns], expected: int, deadline: float
    ) -> tuple[list[Any], list[Failure], int, int]:
        """Post one task per client and wait for each: a result, a rejection, a drop-out or ``deadline``."""
        with self.cond:
            self.round, self.expected, self.phase = rnd, expected, phase
            self.tasks = {c: encode_ins(i) for c, i in ins.items()}
            self.results, self.failures = {}, {}
            self.bytes_down = self.bytes_up = 0
            self.cond.notify_all()
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

    def fit(
        self, rnd: int, ins: dict[int, FitIns], expected: int
    ) -> tuple[list[FitRes], list[Failure], int, int]:
        self.round_deadline = time.monotonic() + self.cfg.round_deadline_s
        return self._phase("fit", rnd, ins, expected, self.round_deadline)

    def evaluate(self, rnd: int, ins: dict[int, FitIns]) -> tuple[list[EvalRes], list[Failure]]:
        for i in ins.values():
            i.config = {**i.config, "phase": "evaluate"}
        deadline = time.monotonic() + self.cfg.round_deadline_s
        reports, failures, _, _ = self._phase("eval", rnd, ins, 0, deadline)
        return reports, failures

    def finish(self) -> None:
        with self.cond:
            self.done = True
            self.cond.notify_all()


def server_eval_data(cfg: Config, source: str, run_dir: RunDir) -> tuple[list[Any], DatasetSpec]:
    """Every row of the server's own held-out file (its train and val splits together) and its spec."""
    datasets = load_source(cfg, source, "--eval-data", run_dir.path)
    own_data(datasets, "--eval-data")  # map-style, not empty
    return [d for d in (datasets.train, datasets.val) if d is not None], datasets.spec


def serve(
    cfg: Config,
    address: str,
    certs: Path,
    run_dir: RunDir,
    *,
    eval_data: str | Any = None,
    spec: DatasetSpec | None = None,
    hook: UploadHook | None = None,
    progress: bool = True,
    on_bound: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Run the federated server on ``address`` until ``federated.rounds`` are done.

    ``eval_data`` is the server's own held-out data: a file or import string read with the
    config's data options (its spec sizes the model), or a dataset (with ``spec`` when known,
    else the model is sized from the first client's). Without it the global model is scored by the
    clients only.
    """
    hook = hook or build_private_hook(cfg, run_dir)  # secure aggregation / DP, when configured
    creds = ServerCredentials(certs)
    run_dir.create()
    held: Any = eval_data
    if isinstance(eval_data, str):
        held, spec = server_eval_data(cfg, eval_data, run_dir)
    hub = Hub(
        cfg, creds, run_dir, hook or UploadHook(), spec
    )  # the upload hook is set once the model is known
    # Every call is authenticated from its metadata before a handler runs; messages are capped
    # near the largest the protocol sends (gRPC refuses a bigger one while reading it). Until the
    # model's size is known (no --eval-data file), the cap is federated.max_message_mb and
    # authenticated calls are held to Join-sized messages.
    auth = TokenAuth(creds, run_dir.log_event)
    layout = initial_weights(cfg, spec)[1] if spec is not None else None
    if layout is not None:
        upload, download = message_sizes(cfg, layout.size)
        auth.request_limit = upload
    else:
        upload = download = int(cfg.federated.max_message_mb * 2**20)
        auth.request_limit = receive_limit(0)
    server = guarded_server(auth, cfg.federated.clients, upload, download)
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
        spec = hub.wait_spec()
        layout = layout or initial_weights(cfg, spec)[1]
        hook = hook or build_upload_hook(cfg, layout)
        hub.hook = hook
        hub.payload_ok = payload_rule(hook)
        auth.request_limit = message_sizes(cfg, layout.size)[0]
        fl_server = FederatedServer(
            cfg, spec, run_dir, hook.wrap(hub), eval_data=held, hook=hook, progress=progress
        )
        summary = fl_server.run()
        hub.finish()
        time.sleep(min(POLL_WAIT_S, cfg.federated.heartbeat_s) + 0.5)  # let polling clients hear "done"
        return summary
    finally:
        server.stop(grace=1.0)


def client_data(cfg: Config, data: str | ClientData | None) -> ClientData:
    """This client's own data: ``--data`` (a file, folder or import string), or the config's data section."""
    if isinstance(data, ClientData):
        return data
    if data:
        return own_data(load_source(cfg, data, "--data"), "--data")
    return own_data(build_dataset(cfg.data, data_context(cfg)), "data")


def run_client(
    cfg: Config,
    target: str,
    client_id: int,
    certs: Path,
    *,
    data: str | ClientData | None = None,
    retry_s: float = 60.0,
    slow_s: float = 0.0,
    hook: UploadHook | None = None,
    progress: bool = True,
) -> int:
    """Join, then train and evaluate on this client's own data until the server is done; returns
    rounds trained.

    ``data`` is what this owner holds (``--data``); without it the config's data section is. The
    client trains on its training split and evaluates on its own validation split; its rows and
    their labels never leave this process.
    Survives a server restart (UNAVAILABLE: it reconnects and joins again) and a busy server
    (RESOURCE_EXHAUSTED: the call is sent again) for up to ``retry_s`` seconds, with a capped
    exponential back-off and jitter between attempts.
    ``slow_s`` sleeps before each upload (a slow device, for drills and tests).
    """
    if not 0 <= client_id < cfg.federated.clients:
        raise ConfigError(f"--client-id {client_id}: must be in [0, {cfg.federated.clients})")
    torch.set_num_threads(1)
    ca, token = client_credentials(certs, client_id)
    own = client_data(cfg, data)
    local = LocalClient(cfg, own.spec, lambda _cid: own, hook or build_private_hook(cfg, device=True))
    hello = encode({"kind": "join", "spec": spec_to_json(own.spec), "num_train": own.num_train})
    upload, download = message_sizes(cfg, local.layout.size)  # what it sends, what it may receive
    remote = RemoteServer(target, ca, client_id, token, server_options(download, upload), busy_s=retry_s)
    stop = threading.Event()
    personal: np.ndarray | None = None

    def beat() -> None:
        while not stop.wait(cfg.federated.heartbeat_s):
            try:
                remote.call("Heartbeat", timeout=cfg.federated.heartbeat_s * 2, retry=False)
            except grpc.RpcError:
                continue

    def say(line: str) -> None:
        if progress:
            print(f"client {client_id}: {line}", flush=True)

    trained = 0
    last_ok = time.monotonic()
    outages = 0  # failed attempts since the server last answered: the back-off's exponent
    joined = False
    threading.Thread(target=beat, daemon=True).start()
    try:
        while True:
            try:
                if not joined:
                    remote.call("Join", hello)
                    joined = True
                    say(f"joined {target}")
                blob = remote.call("Poll", timeout=POLL_WAIT_S + 30)
                last_ok, outages = time.monotonic(), 0
                meta, _ = decode(blob)
                if meta.get("kind") == "done":
                    say(f"done after {trained} round(s)")
                    return trained
                if meta.get("kind") == "secagg":  # a secure-aggregation stage: answer it
                    try:
                        remote.call("SecAgg", local.hook.respond(blob))
                    except grpc.RpcError as err:  # a late or refused reply costs this stage, not the client
                        if err.code() not in (
                            grpc.StatusCode.FAILED_PRECONDITION,
                            grpc.StatusCode.INVALID_ARGUMENT,
                        ):
                            raise
                        say(f"secure-aggregation reply not taken: {err.details()}")
                    continue
                if meta.get("kind") != "fit_ins":
                    continue
                ins = decode_ins(blob)
                if ins.config.get("phase") == "evaluate":
                    report = local.evaluate(ins, personal)
                    remote.call("Submit", encode_eval_res(report))
                    continue
                try:
                    res, personal = local.fit(ins, personal)
                except SecAggError as err:  # e.g. a server asking to train a round twice: refuse, stay up
                    say(f"round {ins.round}: refused: {err}")
                    continue
                if slow_s:
                    time.sleep(slow_s)
                try:
                    remote.call("Submit", encode_res(res))
                    trained += 1
                    loss = float(res.metrics.get("train_loss", float("nan")))
                    say(f"round {ins.round}: {res.metrics.get('steps', '?')} steps, train loss {loss:.4f}")
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
                time.sleep(backoff_s(outages))
                outages += 1
    finally:
        stop.set()
        remote.close()
