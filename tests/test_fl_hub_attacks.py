"""The deployed server's hub against an authenticated client that misbehaves: races, floods, oracles.

Most tests drive :class:`~vatra.federated.hub.Hub`'s handlers directly with a stand-in gRPC
context (deterministic: the interleavings are forced, not raced); one runs a real TLS server.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from tests._fl_helpers import start_client, start_server
from tests.conftest import small_config

from vatra.config import Config
from vatra.federated import EvalRes, FitIns, UploadHook
from vatra.federated.certs import client_credentials, generate
from vatra.federated.data import build_federation, spec_to_json
from vatra.federated.transport import Hub, RemoteServer
from vatra.federated.wire import decode, decode_ins, encode, encode_eval_res
from vatra.rundir import RunDir, read_jsonl

SIZE = 8  # floats in the stand-in model


class _Aborted(Exception):
    pass


class _Context:
    """A gRPC ServicerContext as the handlers use it: metadata, peer, abort."""

    def __init__(self, cid: int) -> None:
        self.metadata = (("x-vatra-client", str(cid)), ("x-vatra-token", "token"))
        self.code: grpc.StatusCode | None = None
        self.details = ""

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata

    def peer(self) -> str:
        return "ipv4:127.0.0.1:50000"

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details
        raise _Aborted(details)


def _cfg(**federated: Any) -> Config:
    base = {"clients": 3, "heartbeat_s": 5.0, "round_deadline_s": 30.0}
    return small_config(federated={**base, **federated}, monitor={"report": False})


def _hub(tmp_path: Path, cfg: Config | None = None, spec: Any = "digits") -> Hub:
    cfg = cfg or _cfg()
    run_dir = RunDir(tmp_path / "run")
    run_dir.create()
    creds = SimpleNamespace(check=lambda cid, token: token == "token")
    known = build_federation(cfg).spec if spec == "digits" else spec
    hub = Hub(cfg, creds, run_dir, UploadHook(), known)  # type: ignore[arg-type]
    for cid in range(cfg.federated.clients):  # alive: a task posted to a silent client fails at once
        hub.heartbeat(b"", _Context(cid))
    return hub


def _events(hub: Hub, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_jsonl(hub.run_dir.events) if e["event"] == kind]


def _task(hub: Hub, cid: int, timeout: float = 10.0) -> FitIns:
    """Poll as client ``cid`` until it is handed a task."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        blob = hub.poll(b"", _Context(cid))
        if decode(blob)[0]["kind"] == "fit_ins":
            return decode_ins(blob)
    raise AssertionError(f"client {cid} was handed no task within {timeout} s")


def _refused(fn: Any, *args: Any) -> _Context:
    """Call a handler as ``args[-1]``'s client and return its context once it aborted."""
    ctx = args[-1]
    with pytest.raises(_Aborted):
        fn(*args)
    return ctx  # type: ignore[no-any-return]


def _report(cid: int, rnd: int) -> bytes:
    return encode_eval_res(EvalRes(cid, rnd, 5, {"accuracy": 0.6}))


def _wait(predicate: Any, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


# ------------------------------------------------------------------ item 6: the first joiner's spec


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"input_shape": [-4]}, "input_shape"),
        ({"input_shape": [10**30]}, "input_shape"),
        ({"input_shape": [8] * 9}, "dimensions"),
        ({"num_classes": -1}, "num_classes"),
        ({"categorical": {"a": 0}}, "cardinality"),
        ({"kind": "telepathy"}, "kind"),
        ({"input_shape": [2_000_000]}, "max_message_mb"),  # 64 M parameters: 256 MB a message
        ({"kind": "lm"}, "cannot be built"),  # the config's MLP models no language
    ],
)
def test_a_first_joiner_whose_spec_cannot_size_the_model_is_refused_and_the_server_waits(
    tmp_path: Path, change: dict[str, Any], why: str
) -> None:
    # Prepare: no --eval-data, so the first joiner's spec would size the model.
    cfg = _cfg()
    hub = _hub(tmp_path, cfg, spec=None)
    good = spec_to_json(build_federation(cfg).spec)
    # Execute
    hello = encode({"kind": "join", "spec": {**good, **change}, "num_train": 10})
    ctx = _refused(hub.join, hello, _Context(0))
    # Assert: one line, one event, no model spec; the next good client sizes the model.
    assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT and why in ctx.details and "\n" not in ctx.details
    assert hub.spec is None and [e["client"] for e in _events(hub, "join_refused")] == [0]
    hub.join(encode({"kind": "join", "spec": good, "num_train": 10}), _Context(1))
    assert spec_to_json(hub.wait_spec()) == good


def test_a_server_without_eval_data_outlives_a_bad_first_joiner(
    tmp_path: Path,
) -> None:
    # Prepare: a real TLS server sized by its first joiner; the first to join sends input_shape [-4].
    cfg = _cfg(clients=2, rounds=2, local_steps=2, heartbeat_s=0.5, heartbeat_misses=20, val_fraction=0.2)
    generate(tmp_path / "certs", 2)
    server, address = start_server(cfg, tmp_path / "certs", tmp_path / "run")
    ca, token = client_credentials(tmp_path / "certs", 0)
    bad = RemoteServer(address, ca, 0, token)
    spec = {**spec_to_json(build_federation(cfg).spec), "input_shape": [-4]}
    with pytest.raises(grpc.RpcError) as err:
        bad.call("Join", encode({"kind": "join", "spec": spec, "num_train": 10}), timeout=60)
    bad.close()
    # Execute: the honest clients join and run the federation.
    clients = [start_client(cfg, address, c, tmp_path / "certs") for c in range(2)]
    summary = server.join_result(180)
    # Assert: refused in one line; the run finished.
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "input_shape" in str(err.value.details())
    assert summary["rounds"] == 2 and [c.join_result(30) for c in clients] == [2, 2]
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    assert [e["client"] for e in events if e["event"] == "join_refused"] == [0]
