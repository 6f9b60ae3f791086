"""The deployed server's hub against an authenticated client that misbehaves: races, floods, oracles.

Most tests drive :class:`~vatra.federated.grpc.hub.Hub`'s handlers directly with a stand-in gRPC
context (deterministic: the interleavings are forced, not raced); one runs a real TLS server.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest
from tests._fl_helpers import Background, start_client, start_server
from tests.conftest import small_config

from vatra.config import Config
from vatra.data import DatasetSpec
from vatra.federated import EvalRes, FitIns, FitRes, UploadHook
from vatra.federated.certs import client_credentials, generate
from vatra.federated.client import LocalClient, TaskRefused
from vatra.federated.data import build_federation, spec_to_json
from vatra.federated.grpc import Hub, RemoteServer
from vatra.federated.wire import decode, decode_ins, encode, encode_eval_res, encode_res
from vatra.rundir import RunDir, read_jsonl

SIZE = 8  # floats in the stand-in model
DIGITS = DatasetSpec("classification", (64,), 10)  # what a digits owner declares at join


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


def _hub(tmp_path: Path, cfg: Config | None = None, spec: DatasetSpec | None = DIGITS) -> Hub:
    cfg = cfg or _cfg()
    run_dir = RunDir(tmp_path / "run")
    run_dir.create()
    creds = SimpleNamespace(check=lambda cid, token: token == "token")
    hub = Hub(cfg, creds, run_dir, UploadHook(), spec)  # type: ignore[arg-type]
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


# ------------------------------------------------------------------ item 2: the phase race


def test_an_evaluation_report_for_the_next_round_never_lands_in_its_fit_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: the round loop evaluates round 1, then posts round 2's fit task. The attacker's
    # report claims round 2 and is read while round 1 evaluates; before its result is taken, the
    # client's honest round-1 report (from another of its threads) closes the evaluation and the
    # loop posts round 2's training: the interleaving the race needed, forced.
    hub = _hub(tmp_path)
    weights = np.zeros(SIZE, np.float32)
    module = sys.modules[Hub.__module__]
    read = module.decode_eval_res

    def read_then_next_phase(blob: bytes) -> EvalRes:
        res = read(blob)
        if res.round == 2:
            hub.submit(_report(0, 1), _Context(0))
            _wait(lambda: (hub.round, hub.phase, bool(hub.tasks)) == (2, "fit", True), "round 2's fit task")
        return res  # type: ignore[no-any-return]

    monkeypatch.setattr(module, "decode_eval_res", read_then_next_phase)

    def round_loop() -> Any:
        reports, _ = hub.evaluate(1, {0: FitIns(0, 1, [weights])})
        return reports, hub.fit(2, {0: FitIns(0, 2, [weights])}, SIZE)

    loop = Background(round_loop)
    assert _task(hub, 0).config["phase"] == "evaluate"
    # Execute: the crafted report for round 2.
    ctx = _refused(hub.submit, _report(0, 2), _Context(0))
    # The client then answers round 2's fit task honestly.
    fit = _task(hub, 0)
    hub.submit(encode_res(FitRes(0, 2, 10, np.zeros(SIZE, np.float32))), _Context(0))
    reports, (results, failures, _, _) = loop.join_result(30)
    # Assert: refused with its reason logged; round 2's results are the one FitRes, nothing failed.
    assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT and "ended" in ctx.details
    assert fit.round == 2 and [type(r) for r in reports] == [EvalRes]
    assert [type(r) for r in results] == [FitRes] and failures == []
    rejected = _events(hub, "update_rejected")
    assert len(rejected) == 1 and rejected[0]["round"] == 1 and "ended" in rejected[0]["reason"]


def test_a_fit_task_takes_only_a_fit_result(tmp_path: Path) -> None:
    hub = _hub(tmp_path)
    loop = Background(lambda: hub.fit(1, {0: FitIns(0, 1, [np.zeros(SIZE, np.float32)])}, SIZE))
    _task(hub, 0)
    ctx = _refused(hub.submit, _report(0, 1), _Context(0))
    assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT
    results, failures, _, _ = loop.join_result(30)
    assert results == [] and [f.client_id for f in failures] == [0]


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
    good = spec_to_json(DIGITS)
    # Execute
    hello = encode({"kind": "join", "spec": {**good, **change}, "num_train": 10})
    ctx = _refused(hub.join, hello, _Context(0))
    # Assert: one line, one event, no model spec; the next good client sizes the model.
    assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT and why in ctx.details and "\n" not in ctx.details
    assert hub.spec is None and [e["client"] for e in _events(hub, "join_refused")] == [0]
    hub.join(encode({"kind": "join", "spec": good, "num_train": 10}), _Context(1))
    assert spec_to_json(hub.wait_spec()) == good


def test_a_server_without_eval_data_outlives_a_bad_first_joiner_and_logs_each_task_once(
    tmp_path: Path,
) -> None:
    # Prepare: a real TLS server sized by its first joiner; the first to join sends input_shape [-4].
    cfg = _cfg(clients=2, rounds=2, local_steps=2, heartbeat_s=0.5, heartbeat_misses=20, val_fraction=0.2)
    generate(tmp_path / "certs", 2)
    server, address = start_server(cfg, tmp_path / "certs", tmp_path / "run")
    ca, token = client_credentials(tmp_path / "certs", 0)
    bad = RemoteServer(address, ca, 0, token)
    spec = {**spec_to_json(DIGITS), "input_shape": [-4]}
    with pytest.raises(grpc.RpcError) as err:
        bad.call("Join", encode({"kind": "join", "spec": spec, "num_train": 10}), timeout=60)
    bad.close()
    # Execute: the honest clients join and run the federation.
    clients = [start_client(cfg, address, c, tmp_path / "certs") for c in range(2)]
    summary = server.join_result(180)
    # Assert: refused in one line; the run finished; each task logged once per client, round, phase.
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "input_shape" in str(err.value.details())
    assert summary["rounds"] == 2 and [c.join_result(30) for c in clients] == [2, 2]
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    assert [e["client"] for e in events if e["event"] == "join_refused"] == [0]
    sent = [(e["client"], e["round"], e["phase"]) for e in events if e["event"] == "task_sent"]
    assert sorted(sent) == sorted({(c, r, p) for c in (0, 1) for r in (1, 2) for p in ("fit", "eval")})


# ------------------------------------------------------------------ item 9: the poll flood


def test_thousands_of_rapid_polls_log_the_task_once_and_count_its_bytes_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: a long poll that answers at once (POLL_WAIT_S 0) and a re-fetch interval no test
    # machine outruns; (raising=False: the names the fix introduced).
    module = sys.modules[Hub.__module__]
    monkeypatch.setattr(module, "POLL_WAIT_S", 0.0)
    monkeypatch.setattr(module, "REFETCH_S", 60.0, raising=False)
    hub = _hub(tmp_path)
    loop = Background(lambda: hub.fit(1, {0: FitIns(0, 1, [np.zeros(SIZE, np.float32)])}, SIZE))
    _wait(lambda: bool(hub.tasks), "the task")
    # Execute: 3000 polls as fast as one thread sends them.
    kinds = [decode(hub.poll(b"", _Context(0)))[0]["kind"] for _ in range(3000)]
    # Assert: handed out once, one event, its bytes counted once.
    task = hub.tasks[0]
    assert kinds.count("fit_ins") == 1 and kinds.count("wait") == 2999
    assert len(_events(hub, "task_sent")) == 1 and hub.bytes_down == len(task)
    # A client that lost the answer gets it again once the interval passed: not logged or counted again.
    monkeypatch.setattr(module, "REFETCH_S", 0.0, raising=False)
    assert hub.poll(b"", _Context(0)) == task
    assert len(_events(hub, "task_sent")) == 1 and hub.bytes_down == len(task)
    hub.submit(encode_res(FitRes(0, 1, 10, np.zeros(SIZE, np.float32))), _Context(0))
    assert len(loop.join_result(30)[0]) == 1


# ------------------------------------------------------------------ item 10: the evaluation oracle


def test_one_evaluation_report_per_client_per_round_and_only_from_a_client_handed_the_task(
    tmp_path: Path,
) -> None:
    # Prepare: round 3's evaluation posted to clients 0 and 1; client 2 has no task.
    hub = _hub(tmp_path)
    weights = np.zeros(SIZE, np.float32)
    loop = Background(lambda: hub.evaluate(3, {c: FitIns(c, 3, [weights]) for c in (0, 1)}))
    assert _task(hub, 0).round == 3
    # Execute: client 0 reports, then reports again and polls for the task again; client 1
    # reports without ever fetching its task (it never scored the model it was meant to); client 2
    # reports for a round it was not asked to evaluate.
    hub.submit(_report(0, 3), _Context(0))
    again = _refused(hub.submit, _report(0, 3), _Context(0))
    repoll = decode(hub.poll(b"", _Context(0)))[0]["kind"]
    unfetched = _refused(hub.submit, _report(1, 3), _Context(1))
    unasked = _refused(hub.submit, _report(2, 3), _Context(2))
    reports, failures = loop.join_result(30)
    # Assert: one report, client 0's; every other one refused with its reason logged.
    assert [(r.client_id, r.round) for r in reports] == [(0, 3)] and repoll == "wait"
    assert "already returned" in again.details and "before it was handed" in unfetched.details
    assert "no eval task" in unasked.details
    assert [f.client_id for f in failures] == [1]
    assert [e["client"] for e in _events(hub, "update_rejected")] == [0, 1, 2]


def test_a_client_evaluates_once_per_round_and_only_the_round_it_is_in(tmp_path: Path) -> None:
    # Prepare: a deployed client's LocalClient (its own rows, some held out).
    cfg = _cfg(val_fraction=0.3)
    fed = build_federation(cfg)
    local = LocalClient(cfg, fed.spec, fed.client_data)
    weights = np.asarray(local.init, np.float32)
    # Execute: round 2 scored, then asked again with other weights (a server probing its held-out
    # rows, or re-running the round); then asked for round 1, and for round 3 once it trains round 4.
    first = local.evaluate(FitIns(0, 2, [weights]))
    probe = local.evaluate(FitIns(0, 2, [np.zeros_like(weights)]))
    with pytest.raises(TaskRefused, match="is in round 2"):
        local.evaluate(FitIns(0, 1, [weights]))
    local.fit(FitIns(0, 4, [weights], {"local_steps": 1}))
    with pytest.raises(TaskRefused, match="is in round 4"):
        local.evaluate(FitIns(0, 3, [weights]))
    # Assert: the probe got round 2's report again, not a score of the zero weights.
    assert first.num_examples > 0 and probe == first
    assert local.evaluate(FitIns(0, 4, [np.zeros_like(weights)])).metrics != first.metrics
    assert local.evaluate(FitIns(1, 2, [weights])).client_id == 1  # each owner keeps its own rounds
