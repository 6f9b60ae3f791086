"""A peer that opens calls and never sends their body cannot lock clients out of a deployed server,
and a client waits out a busy server instead of exiting."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from tests._fl_helpers import start_client, start_server
from tests.conftest import small_config

from vatra.federated.certs import ServerCredentials, client_credentials, generate
from vatra.federated.data import build_federation
from vatra.federated.grpc.guard import (
    PER_CLIENT_RPCS,
    SIZE_LIMIT,
    TokenAuth,
    guarded_server,
    max_concurrent_rpcs,
)
from vatra.federated.grpc.remote import BASE_S, CAP_S, SERVICE, RemoteServer, backoff_s, retry_busy
from vatra.rundir import read_jsonl

NO_TOKEN = (("x-vatra-client", "0"), ("x-vatra-token", "guess"))


class SilentCalls:
    """The attacker: keeps ``calls`` calls open on ``connections`` connections, each sending its
    headers and never a body (a request stream that never yields), opening a new one whenever the
    server ends one, until :meth:`stop`."""

    def __init__(
        self, address: str, ca: bytes, metadata: Any, calls: int, connections: int, method: str = "Join"
    ) -> None:
        self.stopped = threading.Event()
        own = [("grpc.use_local_subchannel_pool", 1)]  # one connection per channel
        tls = grpc.ssl_channel_credentials(ca)
        self.channels = [grpc.secure_channel(address, tls, options=own) for _ in range(connections)]
        self.method = method
        self.metadata = metadata
        self.calls = calls
        self.opened = 0
        self.ended: list[grpc.StatusCode] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _never(self, ended: threading.Event) -> Iterator[bytes]:
        while not ended.wait(0.1) and not self.stopped.is_set():
            pass  # gRPC's thread that sends the body waits here until the call is over
        yield from ()

    def _open(self, i: int) -> grpc.Future:
        self.opened += 1
        ended = threading.Event()
        join = self.channels[i % len(self.channels)].stream_unary(f"/{SERVICE}/{self.method}")
        call = join.future(self._never(ended), metadata=self.metadata)
        call.add_done_callback(lambda _: ended.set())
        return call

    def _run(self) -> None:
        held = [self._open(i) for i in range(self.calls)]
        while not self.stopped.wait(0.25):
            for i, call in enumerate(held):
                if call.done():
                    self.ended.append(call.code())
                    held[i] = self._open(i)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(10)
        for channel in self.channels:
            channel.close()


def test_clients_join_and_finish_while_an_unauthenticated_peer_holds_calls_open(tmp_path: Path) -> None:
    # Prepare: a two-client deployment, and a peer without a token holding as many silent calls
    # as the old server admitted at once (4 per client + 16), over several connections.
    cfg = small_config(
        federated={"clients": 2, "rounds": 1, "local_steps": 2, "min_clients": 2}, monitor={"report": False}
    )
    certs = tmp_path / "certs"
    generate(certs, 2)
    fed = build_federation(cfg)
    server, address = start_server(cfg, certs, tmp_path / "run", eval_data=fed.server_val, spec=fed.spec)
    ca = client_credentials(certs, 0)[0]
    calls = max_concurrent_rpcs(cfg.federated.clients)
    attacker = SilentCalls(address, ca, NO_TOKEN, calls, connections=calls // PER_CLIENT_RPCS)
    start = time.monotonic()
    try:
        time.sleep(1.0)  # the attack is in place before any client comes
        # Execute: the honest clients join and train while the attack goes on.
        clients = [
            start_client(cfg, address, c, certs, data=fed.client_data(c), retry_s=30) for c in range(2)
        ]
        server.join_result(120)
        trained = [c.join_result(60) for c in clients]
        answered = attacker.ended.count(grpc.StatusCode.UNAUTHENTICATED)
    finally:
        attacker.stop()
    seconds = time.monotonic() - start
    # Assert: the run finished with both clients; every silent call was refused, not held; the
    # attack is in events.jsonl, rate-limited (one event per host per 10 s, with the count held back).
    assert trained == [1, 1]
    assert answered > calls
    rejected = [e for e in read_jsonl(tmp_path / "run" / "events.jsonl") if e["event"] == "rejected"]
    assert 1 <= len(rejected) <= 1 + seconds / 10
    assert "wrong token" in rejected[0]["reason"] and rejected[0]["peer"].startswith("ipv4:127.0.0.1:")


@pytest.fixture
def busy_server(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A TLS server behind TokenAuth (silent bodies cut after 0.5 s) whose Poll refuses its first
    ``busy[0]`` calls as busy and blocks a call whose body is ``b"block"``."""
    generate(tmp_path / "certs", 2)
    events: list[dict[str, Any]] = []
    state: dict[str, Any] = {"busy": 0, "served": 0, "release": threading.Event()}

    def poll(request: bytes, context: grpc.ServicerContext) -> bytes:
        if state["busy"] > 0:
            state["busy"] -= 1
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "Concurrent RPC limit exceeded!")
        if request == b"block":
            state["release"].wait(30)
        state["served"] += 1
        return b"ok"

    creds = ServerCredentials(tmp_path / "certs")
    auth = TokenAuth(
        creds, lambda event, **f: events.append({"event": event, **f}), every_s=0.0, body_wait_s=0.5
    )
    server = guarded_server(auth, 2, 1 << 20, 1 << 20)
    handler = grpc.unary_unary_rpc_method_handler(poll)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Poll": handler}),))
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(creds.key, creds.cert)]))
    server.start()
    ca, token = client_credentials(tmp_path / "certs", 0)
    try:
        yield {
            "address": f"127.0.0.1:{port}",
            "ca": ca,
            "token": token,
            "md": (("x-vatra-client", "0"), ("x-vatra-token", token)),
            "other": RemoteServer(f"127.0.0.1:{port}", ca, 1, client_credentials(tmp_path / "certs", 1)[1]),
            "events": events,
            "state": state,
        }
    finally:
        state["release"].set()
        server.stop(0)


def test_an_authenticated_silent_call_takes_its_clients_place_and_is_cut(busy_server: dict[str, Any]) -> None:
    # Execute: client 0 opens more silent calls than its share, on one connection.
    address, ca, md = busy_server["address"], busy_server["ca"], busy_server["md"]
    attacker = SilentCalls(address, ca, md, PER_CLIENT_RPCS + 2, 1, method="Poll")
    try:
        deadline = time.monotonic() + 20
        while grpc.StatusCode.RESOURCE_EXHAUSTED not in attacker.ended:
            assert time.monotonic() < deadline, f"no call over the share was refused: {set(attacker.ended)}"
            time.sleep(0.05)
        # Client 1 is served while client 0's calls wait; then the silent ones are cut (0.5 s).
        assert busy_server["other"].call("Poll", b"x", timeout=10, retry=False) == b"ok"
        while grpc.StatusCode.CANCELLED not in attacker.ended:
            assert time.monotonic() < deadline, f"no silent call was cut: {set(attacker.ended)}"
            time.sleep(0.05)
    finally:
        attacker.stop()
    reasons = [e["reason"] for e in busy_server["events"] if e["event"] == "rejected"]  # all logged here
    assert any("already has 4 calls in flight" in r for r in reasons)
    assert any("no request message within 0.5 s" in r for r in reasons)
    assert busy_server["state"]["served"] == 1  # no silent call reached the handler


def test_a_client_call_waits_out_a_busy_server(busy_server: dict[str, Any]) -> None:
    remote = RemoteServer(busy_server["address"], busy_server["ca"], 0, busy_server["token"], busy_s=30)
    busy_server["state"]["busy"] = 3
    start = time.monotonic()
    assert remote.call("Poll", b"x", timeout=10) == b"ok"
    assert busy_server["state"]["served"] == 1 and time.monotonic() - start >= 0.5 * (BASE_S * 7)
    busy_server["state"]["busy"] = 1
    with pytest.raises(grpc.RpcError) as err:  # a heartbeat sends once
        remote.call("Poll", b"x", timeout=10, retry=False)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    remote.close()


class Refusal(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def test_retry_busy_backs_off_exponentially_with_jitter_up_to_a_cap_and_a_budget() -> None:
    # Prepare: a fake clock that the sleeps advance.
    now = [0.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    refusals = [Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, "Concurrent RPC limit exceeded!")] * 8

    def send() -> str:
        if refusals:
            raise refusals.pop()
        return "ok"

    # Execute / Assert: eight refusals, then the answer; waits double up to the cap, jittered.
    assert retry_busy(send, 60.0, sleep=sleep, clock=lambda: now[0], rng=lambda: 0.999) == "ok"
    assert len(slept) == 8
    assert slept[:3] == pytest.approx([0.2 * 0.9995, 0.4 * 0.9995, 0.8 * 0.9995])
    assert max(slept) <= CAP_S and slept[-1] == pytest.approx(CAP_S * 0.9995)
    assert [backoff_s(3, rng=lambda: 0.0), backoff_s(50, rng=lambda: 0.0)] == [0.8, CAP_S / 2]
    # A budget runs out: the last refusal is raised.
    refusals[:] = [Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy")] * 100
    now[0] = 0.0
    with pytest.raises(Refusal):
        retry_busy(send, 5.0, sleep=sleep, clock=lambda: now[0], rng=lambda: 0.5)
    assert now[0] <= 5.0
    # Never retried: a size refusal (vatra's or gRPC's own) and any other code.
    for refusal in (
        Refusal(
            grpc.StatusCode.RESOURCE_EXHAUSTED, f"client 0: a 9-byte message, over the 8-byte {SIZE_LIMIT}"
        ),
        Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max (9 vs. 8)"),
        Refusal(grpc.StatusCode.INVALID_ARGUMENT, "bad"),
    ):
        refusals[:] = [refusal]
        slept.clear()
        with pytest.raises(Refusal):
            retry_busy(send, 60.0, sleep=sleep, clock=lambda: now[0])
        assert slept == []
