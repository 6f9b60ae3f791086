"""A client's side of the data contract: read the federation's before joining, then conform or stop.

:func:`fetch_contract` asks the server for the federation's contract over its own small channel
(the reply is bounded by the channel's receive limit and checked by
:meth:`~vatra.federated.contract.DataContract.from_json`: the server is not trusted blindly).
:func:`agree` compares this owner's data with it and re-encodes the rows in the federation's
columns and categories when only their order or extent differs; otherwise the client stops with one
line naming the column and the values. Nothing about the rows is sent: the client's own contract
goes out only in its join, and holds names and categories, no rows and no counts.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc

from vatra.config import Config
from vatra.errors import ConfigError, VatraError
from vatra.federated.contract import MAX_BYTES, DataContract, conform_problem, contract_of, notices, pins
from vatra.federated.data import ClientData
from vatra.federated.grpc.guard import server_options
from vatra.federated.grpc.remote import RemoteServer, backoff_s
from vatra.federated.wire import WireError, decode_views

REPLY_BYTES = 4 * MAX_BYTES  # the contract's JSON escaped inside the message's JSON metadata, with room


def fetch_contract(target: str, ca: bytes, client_id: int, token: str, retry_s: float) -> DataContract | None:
    """The federation's data contract, or None when no party has published one yet. Waits for a
    server that is not up yet (or busy) for up to ``retry_s`` seconds."""
    remote = RemoteServer(target, ca, client_id, token, server_options(REPLY_BYTES, REPLY_BYTES), retry_s)
    start, outages = time.monotonic(), 0
    try:
        while True:
            try:
                blob = remote.call("Contract", timeout=30.0)
                break
            except grpc.RpcError as err:
                code = err.code()
                if code == grpc.StatusCode.UNAUTHENTICATED:
                    raise VatraError(f"server rejected client {client_id}: {err.details()}") from None
                retry = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                if not retry or time.monotonic() - start > retry_s:
                    raise VatraError(
                        f"client {client_id}: cannot read the federation's data contract from {target}: "
                        f"{code.name}: {err.details()}"
                    ) from None
                time.sleep(backoff_s(outages))
                outages += 1
    finally:
        remote.close()
    try:
        raw = decode_views(blob)[0].get("contract")
        return None if raw is None else DataContract.from_json(raw)
    except (WireError, ValueError) as err:
        raise VatraError(f"client {client_id}: the server's data contract is malformed ({err})") from None


def agree(
    cfg: Config,
    own: ClientData,
    federation: DataContract | None,
    rebuild: Callable[[Config], ClientData] | None,
    say: Callable[[str], None],
) -> ClientData:
    """This owner's data, encoded as the federation's contract says (``own`` itself when it already
    is); ConfigError with one line when its columns, categories or classes cannot be."""
    mine = contract_of(own.train)
    if mine is not None:
        try:
            DataContract.from_json(mine.to_json())  # what the server will check of it
        except ValueError as err:
            raise ConfigError(
                f"--data: this owner's columns cannot be told to the federation: {err}"
            ) from None
    if federation is None:  # the first to publish: its contract becomes the federation's
        for column, values in (mine.categories if mine else {}).items():
            if len(values) == 1 and column not in cfg.data.categories:
                say(
                    f"column {column!r}: this owner holds one category only ({values[0]!r}) and sets the "
                    f"federation's categories: pin data.categories.{column} so that owners with others "
                    "can join"
                )
        return own
    if mine is None:
        raise ConfigError(
            "--data: the federation's data is a table with a data contract; this owner's is not"
        )
    problem = conform_problem(mine, federation)
    if problem:
        raise ConfigError(f"--data does not fit the federation's data: {problem}")
    for line in notices(mine, federation):
        say(line)
    if mine == federation:
        return own
    if rebuild is None:
        raise ConfigError(
            "--data: this owner's columns, categories or classes are in another order than the "
            "federation's; pin data.categories (and data.features) as the federation's"
        )
    again = rebuild(pins(cfg, federation))
    if contract_of(again.train) != federation:  # pins fix every order: a bug if this is ever reached
        raise VatraError("--data: the re-encoded data still differs from the federation's data contract")
    say("encoded its data in the federation's columns and categories")
    return again
