"""The client side of the gRPC deployment: ``vatra fl client`` (:func:`run_client`).

A client reads the federation's data contract and conforms to it (:mod:`.agree`: same columns,
categories in the federation's order, or it stops with one line naming the column), joins with the
shape and contract of its own data, heartbeats, long-polls for its task, trains and
evaluates on its own rows, and answers secure-aggregation stages; its rows and their labels never
leave its process. The connection and its retries are :class:`~.remote.RemoteServer`.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import numpy as np
import torch

from vatra.config import Config
from vatra.config._edgesync import BUILTIN_PROFILES
from vatra.data import build_dataset
from vatra.errors import ConfigError, VatraError
from vatra.federated._base import EvalRes, UploadHook
from vatra.federated.certs import client_credentials
from vatra.federated.client import LocalClient, TaskRefused
from vatra.federated.contract import contract_of
from vatra.federated.data import ClientData, data_context, load_source, own_data, spec_to_json
from vatra.federated.grpc.agree import agree, fetch_contract
from vatra.federated.grpc.guard import server_options
from vatra.federated.grpc.hub import POLL_WAIT_S
from vatra.federated.grpc.remote import RemoteServer, backoff_s
from vatra.federated.grpc.server import message_sizes
from vatra.federated.private import build_private_hook
from vatra.federated.secagg import SecAggError
from vatra.federated.wire import decode, decode_ins, encode, encode_eval_res, encode_res


def client_data(cfg: Config, data: str | ClientData | None) -> ClientData:
    """This client's own data: ``--data`` (a file, folder or import string), or the config's data section."""
    if isinstance(data, ClientData):
        return data
    if data:
        return own_data(load_source(cfg, data, "--data"), "--data")
    return own_data(build_dataset(cfg.data, data_context(cfg)), "data")


class _ContractRaced(Exception):
    """Another owner published the federation's data contract between this client's read and its join."""


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
    device_profile: str | None = None,
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
    ``device_profile`` (``--device-profile``) names the device this client runs on
    (``federated.edge.device_profiles``): the server sends it the int8 model when the fp32 one is
    over the profile's ``max_model_mb``, and refuses its join when neither fits.
    A client that read no data contract and whose join is refused because another owner published
    one meanwhile (owners starting together) starts again once: it reads that contract and conforms.
    """
    edge = cfg.federated.edge
    if device_profile is not None and device_profile not in {*BUILTIN_PROFILES, *edge.device_profiles}:
        known = ", ".join(sorted({*BUILTIN_PROFILES, *edge.device_profiles}))
        raise ConfigError(f"--device-profile {device_profile!r}: not defined; choose one of {known}")
    args = (cfg, target, client_id, certs, data, retry_s, slow_s, hook, progress)
    try:
        return _run(*args, raced=False, device_profile=device_profile)
    except _ContractRaced:
        return _run(*args, raced=True, device_profile=device_profile)


def _run(
    cfg: Config,
    target: str,
    client_id: int,
    certs: Path,
    data: str | ClientData | None,
    retry_s: float,
    slow_s: float,
    hook: UploadHook | None,
    progress: bool,
    raced: bool,
    device_profile: str | None,
) -> int:
    """:func:`run_client`'s session; ``raced``: the second, after a contract published meanwhile."""
    if not 0 <= client_id < cfg.federated.clients:
        raise ConfigError(f"--client-id {client_id}: must be in [0, {cfg.federated.clients})")
    torch.set_num_threads(1)
    ca, token = client_credentials(certs, client_id)

    def say(line: str) -> None:
        if progress:
            print(f"client {client_id}: {line}", flush=True)

    own = client_data(cfg, data)
    federation = fetch_contract(target, ca, client_id, token, retry_s)
    rebuild = None if isinstance(data, ClientData) else (lambda pinned: client_data(pinned, data))
    own = agree(cfg, own, federation, rebuild, say)
    local = LocalClient(cfg, own.spec, lambda _cid: own, hook or build_private_hook(cfg, device=True))
    mine = contract_of(own.train)
    hello = encode(
        {
            "kind": "join",
            "spec": spec_to_json(own.spec),
            "num_train": own.num_train,
            "contract": None if mine is None else mine.to_json(),
            **({"device_profile": device_profile} if device_profile else {}),
        }
    )
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

    trained = 0
    last_ok = time.monotonic()
    outages = 0  # failed attempts since the server last answered: the back-off's exponent
    joined = False
    threading.Thread(target=beat, daemon=True).start()
    try:
        while True:
            try:
                if not joined:
                    try:
                        remote.call("Join", hello)
                    except grpc.RpcError as err:
                        published = federation is None and mine is not None and not raced
                        if published and err.code() == grpc.StatusCode.FAILED_PRECONDITION:
                            raise _ContractRaced from None
                        raise
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
