"""Driving one secure-aggregation round over a :class:`Channel`, and the clients' side of it.

The server talks to clients only through ``Channel.exchange`` — one request per client and
stage, a reply from each client still there — so the same driver runs against in-process
parties (simulation, tests) and gRPC clients (deployment). A client that does not answer a
stage has dropped out; :class:`vatra.federated.secagg.server.SecAggServer` decides whether the
round survives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from vatra.config import SecureAggregationConfig
from vatra.federated.secagg.crypto import SecAggError
from vatra.federated.secagg.messages import pack, unpack
from vatra.federated.secagg.protocol import STAGES, Msg, SecAggClient
from vatra.federated.secagg.server import SecAggServer
from vatra.federated.wire import WireError


class Channel(Protocol):
    def exchange(self, stage: str, rnd: int, requests: dict[int, Msg]) -> dict[int, Msg]:
        """Send each client its request; return the replies of those that answered."""
        ...


def secure_sum(server: SecAggServer, channel: Channel) -> np.ndarray:
    """Run the four stages; Σ of the survivors' inputs mod 2^bits, or RoundAborted."""
    rnd = server.rnd
    replies = channel.exchange("advertise", rnd, server.advertise_requests())
    replies = channel.exchange("share_keys", rnd, server.share_keys_requests(replies))
    replies = channel.exchange("masked_input", rnd, server.masked_input_requests(replies))
    replies = channel.exchange("unmask", rnd, server.unmask_requests(replies))
    return server.finish(replies)


InputFn = Callable[[int, int], np.ndarray]  # (client id, clients in the round) → words to mask


class ClientParty:
    """One client's protocol endpoint: answers a packed request with a packed reply.

    One protocol run per round, rounds only going up: an ``advertise`` for a round at or below
    one already started is refused, as is any other stage of a round not in progress (a second
    run over the same input with other survivors would let the server subtract the two sums).
    """

    def __init__(self, cid: int, cfg: SecureAggregationConfig, inputs: InputFn) -> None:
        self.cid = cid
        self.cfg = cfg
        self.inputs = inputs
        self.state: SecAggClient | None = None

    def respond(self, blob: bytes) -> bytes:
        """Raises SecAggError (e.g. a tampered share) — the client then leaves the round.

        ``respond_or_refuse`` turns that into a reply the server reads as a refusal."""
        try:
            stage, rnd, req = unpack(blob)
        except WireError as err:
            raise SecAggError(f"client {self.cid}: unreadable request ({err})") from None
        if stage == "advertise":
            if self.state is not None and rnd <= self.state.rnd:
                self.state.step = len(STAGES)  # a replayed round ends the one in progress too
                began = self.state.rnd
                raise SecAggError(
                    f"client {self.cid}: advertise for round {rnd} after round {began} began; refusing"
                )
            self.state = SecAggClient(self.cid, rnd, self.cfg)
        st = self.state
        if st is None or st.rnd != rnd:
            raise SecAggError(f"client {self.cid}: {stage} request for round {rnd}, which it has not begun")
        return pack(stage, rnd, st.answer(stage, req, lambda: self.inputs(self.cid, st.n1)))

    def respond_or_refuse(self, blob: bytes) -> bytes:
        try:
            return self.respond(blob)
        except SecAggError as err:
            try:
                stage, rnd, _ = unpack(blob)
            except WireError:
                stage, rnd = "unreadable", -1
            return pack(stage, rnd, {"error": str(err)})


class CountingChannel:
    """Packs requests, counts bytes, applies chaos drop-outs; subclasses deliver the packed bytes.

    ``drops[(rnd, stage)]`` are clients that vanish when that stage's request reaches them (a
    client gone stays gone for the round); ``tamper`` may rewrite a request on its way (tests).
    """

    def __init__(self) -> None:
        self.drops: dict[tuple[int, str], set[int]] = {}
        self.gone: set[int] = set()
        self.rejected: dict[int, str] = {}
        self.tamper: Callable[[str, int, Msg], Msg] | None = None
        self.chaos: tuple[int, str, int] | None = None  # (round, stage, count): the highest ids drop
        self.bytes_down = 0
        self.bytes_up = 0

    def deliver(self, stage: str, rnd: int, blobs: dict[int, bytes]) -> dict[int, bytes | str]:
        """Packed replies of the clients that answered (a str: the client refused, and why)."""
        raise NotImplementedError

    def exchange(self, stage: str, rnd: int, requests: dict[int, Msg]) -> dict[int, Msg]:
        assert stage in STAGES
        if stage == "advertise":
            self.gone, self.rejected = set(), {}
            if self.chaos is not None and self.chaos[0] == rnd:
                self.drops[(rnd, self.chaos[1])] = set(sorted(requests)[-self.chaos[2] :])
        self.gone |= self.drops.get((rnd, stage), set())
        blobs = {}
        # a request object sent to many clients (a broadcast) is packed once; the cache holds the
        # object itself so its id cannot be reused by another request while the cache lives
        packed: dict[int, tuple[Msg, bytes]] = {}
        for cid, req in requests.items():
            if cid in self.gone:
                continue
            if self.tamper is not None:
                req = self.tamper(stage, cid, req)
            if id(req) not in packed:
                packed[id(req)] = (req, pack(stage, rnd, req))
            blobs[cid] = packed[id(req)][1]
            self.bytes_down += len(blobs[cid])
        replies: dict[int, Msg] = {}
        for cid, out in self.deliver(stage, rnd, blobs).items():
            if isinstance(out, str):
                self.rejected[cid] = out
                self.gone.add(cid)
                continue
            self.bytes_up += len(out)
            try:
                got_stage, got_rnd, body = unpack(out)
            except WireError as err:
                got_stage, got_rnd, body = stage, rnd, {"error": f"unreadable reply ({err})"}
            if (got_stage, got_rnd) != (stage, rnd):
                body = {"error": f"reply for {got_stage} of round {got_rnd}"}
            if isinstance(body, dict) and "error" in body:
                self.rejected[cid] = str(body["error"])
                self.gone.add(cid)
                continue
            replies[cid] = body  # a malformed body is the server's to judge: it drops the client
        return replies


class LocalParties(CountingChannel):
    """In-process clients (simulation, tests)."""

    def __init__(self, cfg: SecureAggregationConfig, inputs: InputFn) -> None:
        super().__init__()
        self.cfg = cfg
        self.inputs = inputs
        self.parties: dict[int, ClientParty] = {}

    def deliver(self, stage: str, rnd: int, blobs: dict[int, bytes]) -> dict[int, bytes | str]:
        out: dict[int, bytes | str] = {}
        for cid, blob in blobs.items():
            party = self.parties.setdefault(cid, ClientParty(cid, self.cfg, self.inputs))
            try:
                out[cid] = party.respond(blob)
            except SecAggError as err:
                out[cid] = str(err)
        return out
