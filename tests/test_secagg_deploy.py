"""Secure aggregation's gRPC side, without a network: one deadline a round, malformed replies dropped."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from vatra.federated.grpc.stages import HubStages, secagg_reply
from vatra.federated.secagg.messages import pack
from vatra.federated.wire import encode


class _Events:
    def __init__(self) -> None:
        self.logged: list[tuple[str, dict[str, Any]]] = []

    def log_event(self, kind: str, **facts: Any) -> None:
        self.logged.append((kind, facts))


def _hub(**extra: Any) -> Any:  # stands in for grpc.hub.Hub
    cfg = SimpleNamespace(round_deadline_s=30.0, heartbeat_s=1.0, heartbeat_misses=5)
    return SimpleNamespace(
        cfg=cfg,
        cond=threading.Condition(),
        last_seen={},
        stage_tasks={},
        stage_replies={},
        run_dir=_Events(),
        **extra,
    )


class _Aborted(Exception):
    pass


class _Context:
    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code = code
        raise _Aborted(details)


def test_a_silent_client_costs_the_round_one_deadline_not_one_per_stage() -> None:
    # Prepare: the round's deadline is 0.5 s away; client 1 heartbeats (seen "in the future")
    # but never answers. The per-stage round_deadline_s (30 s) would make each stage wait 30 s.
    hub = _hub(round_deadline=time.monotonic() + 0.5)
    hub.last_seen = {1: time.monotonic() + 60}
    channel = HubStages(hub)
    # Execute: two stages in a row.
    start = time.monotonic()
    first = channel.deliver("advertise", 1, {1: b"request"})
    second = channel.deliver("share_keys", 1, {1: b"request"})
    # Assert: the first waits for the deadline, the second sees it passed (one 0.2 s poll);
    # client 1 is a drop-out of both, logged with the reason.
    assert 0.4 < time.monotonic() - start < 1.5
    assert first == second == {}
    assert [(e, f["stage"], f["reason"]) for e, f in hub.run_dir.logged] == [
        ("secagg_dropout", "advertise", "past the round deadline"),
        ("secagg_dropout", "share_keys", "past the round deadline"),
    ]


def test_without_a_hub_deadline_the_round_deadline_starts_at_advertise() -> None:
    hub = _hub(round_deadline=0.0)  # not set yet (a hub before the per-round deadline)
    hub.cfg.round_deadline_s = 0.3
    hub.last_seen = {1: time.monotonic() + 60}
    channel = HubStages(hub)
    start = time.monotonic()
    channel.deliver("advertise", 1, {1: b"request"})
    channel.deliver("share_keys", 1, {1: b"request"})
    assert time.monotonic() - start < 1.0


@pytest.mark.parametrize(
    ("blob", "why"),
    [
        (b"not a message", "malformed secure-aggregation reply"),
        (encode({"kind": "fit_res"}, {}), "not a secure-aggregation message"),
        (pack("advertise", 1, [1, 2]), "not a dict"),  # type: ignore[arg-type]
        (pack("share_keys", 1, {"ciphertexts": {}}), "a share_keys reply needs ciphertexts, b_commit"),
        (pack("commit", 1, {}), "unknown stage"),
    ],
    ids=["garbage", "other kind", "list body", "missing field", "unknown stage"],
)
def test_malformed_reply_drops_the_client_with_a_logged_reason(blob: bytes, why: str) -> None:
    # Prepare: client 3 has a pending stage.
    hub = _hub()
    hub.stage_tasks = {3: b"request"}
    context: Any = _Context()
    # Execute
    with pytest.raises(_Aborted):
        secagg_reply(hub, 3, blob, context)
    # Assert: recorded as its drop-out for the stage (the channel stops waiting), logged, told.
    assert why in hub.stage_replies[3]
    assert hub.run_dir.logged[0][0] == "secagg_malformed_reply" and why in hub.run_dir.logged[0][1]["reason"]
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT


def test_well_formed_reply_and_refusal_are_accepted() -> None:
    hub = _hub()
    hub.stage_tasks = {3: b"request", 4: b"request"}
    ok = pack("advertise", 1, {"c_pk": b"a" * 32, "s_pk": b"b" * 32})
    refusal = pack("advertise", 1, {"error": "client 4: refusing"})
    context: Any = _Context()
    secagg_reply(hub, 3, ok, context)
    secagg_reply(hub, 4, refusal, context)
    assert hub.stage_replies == {3: ok, 4: refusal} and not hub.run_dir.logged
