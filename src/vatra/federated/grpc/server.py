"""The server side of the gRPC deployment: ``vatra fl server`` (:func:`serve`).

No protoc step: four unary methods of ``vatra.fl.Federation`` carry raw bytes (safetensors
messages, :mod:`vatra.federated.wire`). Every call carries ``x-vatra-client`` and
``x-vatra-token`` metadata; the server checks the token against ``tokens.json`` (constant time).

- ``Join`` — say hello with the shape of its data (:func:`~vatra.federated.data.spec_to_json`:
  input shape, classes; no rows) and its training-row count. Without ``--eval-data`` the
  server builds its model from the first client's spec, once it is in range and the model fits
  ``max_message_mb``; a client whose spec differs, or is out of range, is refused. A table's join
  also carries its data contract (columns, categories, classes: :mod:`~vatra.federated.contract`).
- ``Contract`` — the federation's data contract, read by a client before it joins: the server's
  own, from ``--eval-data``, else the first client's; none before.
- ``Heartbeat`` — every ``heartbeat_s``; a client silent for ``heartbeat_s × heartbeat_misses`` is
  a drop-out (a failure of its round).
- ``Poll`` — long poll: returns the client's task for the current phase (train, or evaluate on its
  own held-out rows: ``config["phase"] == "evaluate"``), ``wait`` or ``done``.
- ``Submit`` — the client's update or evaluation report; rejected (INVALID_ARGUMENT, with the
  reason, logged in events.jsonl) when it answers no task the client was handed, repeats an answer,
  has the wrong shape or dtype, or holds NaN/inf. The server's state is :class:`~.hub.Hub`; the
  client's side is :func:`~.client.run_client`.

Each client holds its own data (``vatra fl client --data``; the server never builds client data)
and the server evaluates on its own held-out file when given (``vatra fl server --eval-data``).
A round's training phase waits for all selected clients, drop-outs or ``round_deadline_s``
(one deadline for the whole round, secure-aggregation stages included), whichever comes first.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from vatra.config import Config
from vatra.data import DatasetSpec
from vatra.errors import VatraError
from vatra.federated._base import UploadHook
from vatra.federated.certs import ServerCredentials
from vatra.federated.client import initial_weights
from vatra.federated.compression import build_upload_hook
from vatra.federated.contract import contract_of
from vatra.federated.data import load_source, own_data
from vatra.federated.grpc.guard import TokenAuth, guarded_server, payload_rule, receive_limit
from vatra.federated.grpc.hub import POLL_WAIT_S, Hub
from vatra.federated.private import build_private_hook
from vatra.federated.server import FederatedServer
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
    contract = contract_of(held[0] if isinstance(held, list) and held else held)
    hub = Hub(
        cfg, creds, run_dir, hook or UploadHook(), spec, contract
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
