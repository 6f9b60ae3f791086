"""Deployment over gRPC with TLS: ``vatra fl server`` and ``vatra fl client``.

No protoc step: four unary methods of ``vatra.fl.Federation`` carry raw bytes (safetensors
messages, :mod:`vatra.federated.wire`). Every call carries ``x-vatra-client`` and
``x-vatra-token`` metadata; the server checks the token against ``tokens.json`` (constant time).

- ``Join`` — say hello with the shape of its data (:func:`~vatra.federated.data.spec_to_json`:
  input shape, classes; no rows, no names) and its training-row count. Without ``--eval-data`` the
  server builds its model from the first client's spec, once it is in range and the model fits
  ``max_message_mb``; a client whose spec differs, or is out of range, is refused.
- ``Heartbeat`` — every ``heartbeat_s``; a client silent for ``heartbeat_s × heartbeat_misses`` is
  a drop-out (a failure of its round).
- ``Poll`` — long poll: returns the client's task for the current phase (train, or evaluate on its
  own held-out rows: ``config["phase"] == "evaluate"``), ``wait`` or ``done``.
- ``Submit`` — the client's update or evaluation report; rejected (INVALID_ARGUMENT, with the
  reason, logged in events.jsonl) when it answers no task the client was handed, repeats an answer,
  has the wrong shape or dtype, or holds NaN/inf. The server side is :class:`~vatra.federated.hub.Hub`.

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
from vatra.federated._base import EvalRes, UploadHook
from vatra.federated.certs import ServerCredentials, client_credentials
from vatra.federated.client import LocalClient, TaskRefused, initial_weights
from vatra.federated.compression import build_upload_hook
from vatra.federated.data import (
    ClientData,
    data_context,
    load_source,
    own_data,
    spec_to_json,
)
from vatra.federated.guard import (
    TokenAuth,
    guarded_server,
    payload_rule,
    receive_limit,
    server_options,
)
from vatra.federated.hub import POLL_WAIT_S, Hub
from vatra.federated.privacy import build_private_hook
from vatra.federated.remote import RemoteServer, backoff_s
from vatra.federated.secagg import SecAggError
from vatra.federated.server import FederatedServer
from vatra.federated.wire import (
    decode,
    decode_ins,
    encode,
    encode_eval_res,
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
                    try:
                        report = local.evaluate(ins, personal)
                    except TaskRefused as err:  # a round this client has left: the server hears nothing
                        say(f"round {ins.round}: evaluation refused: {err}")
                        report = EvalRes(client_id, ins.round, 0, {})
                    try:
                        remote.call("Submit", encode_eval_res(report))
                    except grpc.RpcError as err:
                        if err.code() != grpc.StatusCode.INVALID_ARGUMENT:
                            raise
                        say(f"round {ins.round}: evaluation report rejected: {err.details()}")
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
