"""Driving one secure-aggregation round over a :class:`Channel`, and the clients' side of it.

The server talks to clients only through ``Channel.exchange`` — one request per client and
stage, a reply from each client still there — so the same driver runs against in-process
parties (:class:`LocalParties`: simulation, tests) and deployed clients (:class:`RemoteParties`,
through an executor's :class:`~vatra.federated._base.StageRunner`: the gRPC hub). A client that
does not answer a stage has dropped out; :class:`vatra.federated.secagg.server.SecAggServer`
decides whether the round survives.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from typing import TYPE_CHECKING, Protocol

import numpy as np

from vatra.config import SecureAggregationConfig
from vatra.federated._base import StageRunner
from vatra.federated.secagg.crypto import SecAggError
from vatra.federated.secagg.messages import pack, unpack
from vatra.federated.secagg.protocol import STAGES, Msg, SecAggClient
from vatra.federated.secagg.server import SecAggServer
from vatra.federated.wire import WireError

if TYPE_CHECKING:
    from vatra.resilience.chaos import ClientDropout


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
WordsFn = Callable[[int], np.ndarray]  # one client's trained update: clients in the round → words


class ClientParty:
    """One client's protocol endpoint: answers a packed request with a packed reply.

    Each trained update is masked by exactly one protocol run, of the round it was trained for.
    :meth:`trained` hands the party round r's update (training rounds only go up); an
    ``advertise`` for round r starts the run and takes the update with it. Refused, and ending
    any run in progress: an ``advertise`` for a round the client did not train, a second run for
    the same round, a run after the update was taken. Otherwise a server could run round r with
    everyone, then a "round r + 1" over the same updates without the victim, and subtract the two
    sums. Any other stage of a round not in progress is refused too.
    """

    def __init__(self, cid: int, cfg: SecureAggregationConfig, *, wide: int = 0) -> None:
        self.cid = cid
        self.cfg = cfg
        self.wide = wide  # trailing words masked mod 2^32 (the weight): SecAggClient.wide
        self.state: SecAggClient | None = None
        self.update: tuple[int, WordsFn] | None = None  # (round, its words): trained, not yet in a run
        self.last_trained: int | None = None

    def trained(self, rnd: int, words: WordsFn) -> None:
        """The update trained for round ``rnd``; SecAggError for a round at or below one already trained."""
        if self.last_trained is not None and rnd <= self.last_trained:
            raise SecAggError(
                f"client {self.cid}: asked to train round {rnd} after round {self.last_trained}; "
                "refusing (a repeated round could unmask this client's update)"
            )
        self.last_trained, self.update = rnd, (rnd, words)

    def respond(self, blob: bytes) -> bytes:
        """Raises SecAggError (e.g. a tampered share) — the client then leaves the round.

        ``respond_or_refuse`` turns that into a reply the server reads as a refusal."""
        try:
            stage, rnd, req = unpack(blob)
        except WireError as err:
            raise SecAggError(f"client {self.cid}: unreadable request ({err})") from None
        if stage == "advertise":
            update, self.update = self.update, None  # one run per update, even a refused one
            if update is None or update[0] != rnd:
                if self.state is not None:
                    self.state.step = len(STAGES)  # a deviating advertise ends the run in progress too
                has = f"its update is round {update[0]}'s" if update else "it has no update left to mask"
                raise SecAggError(f"client {self.cid}: advertise for round {rnd}, but {has}; refusing")
            self.state = SecAggClient(self.cid, rnd, self.cfg, update[1], self.wide)
        st = self.state
        if st is None or st.rnd != rnd:
            raise SecAggError(f"client {self.cid}: {stage} request for round {rnd}, which it has not begun")
        return pack(stage, rnd, st.answer(stage, req))

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
    """Packs requests, counts bytes, applies drop-outs; subclasses deliver the packed bytes.

    ``drops[(rnd, stage)]`` are clients that vanish when that stage's request reaches them (a
    client gone stays gone for the round); ``chaos``, the fault hook of ``chaos.drop_clients_at``
    (:class:`~vatra.resilience.chaos.ClientDropout`), adds its own at each stage point;
    ``tamper`` may rewrite a request on its way (tests).
    """

    def __init__(self) -> None:
        self.drops: dict[tuple[int, str], set[int]] = {}
        self.gone: set[int] = set()
        self.rejected: dict[int, str] = {}
        self.tamper: Callable[[str, int, Msg], Msg] | None = None
        self.chaos: ClientDropout | None = None
        self.bytes_down = 0
        self.bytes_up = 0

    def deliver(self, stage: str, rnd: int, blobs: dict[int, bytes]) -> dict[int, bytes | str]:
        """Packed replies of the clients that answered (a str: the client refused, and why)."""
        raise NotImplementedError

    def exchange(self, stage: str, rnd: int, requests: dict[int, Msg]) -> dict[int, Msg]:
        assert stage in STAGES
        if stage == "advertise":
            self.gone, self.rejected = set(), {}
            if self.chaos is not None:
                self.chaos.round_start(rnd, requests)
        self.gone |= self.drops.get((rnd, stage), set())
        if self.chaos is not None:
            self.gone |= self.chaos.vanish(stage, rnd)
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
    """In-process clients (simulation, tests); :meth:`trained` stands for each round's local training."""

    def __init__(self, cfg: SecureAggregationConfig, inputs: InputFn, *, wide: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.inputs = inputs
        self.wide = wide
        self.parties: dict[int, ClientParty] = {}

    def _party(self, cid: int) -> ClientParty:
        if cid not in self.parties:
            self.parties[cid] = ClientParty(cid, self.cfg, wide=self.wide)
        return self.parties[cid]

    def trained(self, rnd: int, cids: Iterable[int]) -> None:
        """Clients ``cids`` trained round ``rnd``: ``inputs(cid, n1)`` is what each masks in its run."""
        for cid in cids:
            self._party(cid).trained(rnd, partial(self.inputs, cid))

    def deliver(self, stage: str, rnd: int, blobs: dict[int, bytes]) -> dict[int, bytes | str]:
        out: dict[int, bytes | str] = {}
        for cid, blob in blobs.items():
            party = self._party(cid)
            try:
                out[cid] = party.respond(blob)
            except SecAggError as err:
                out[cid] = str(err)
        return out


class RemoteParties(CountingChannel):
    """Deployed clients, each answering for itself, reached through the executor's stage runner."""

    def __init__(self, runner: StageRunner) -> None:
        super().__init__()
        self.runner = runner

    def deliver(self, stage: str, rnd: int, blobs: dict[int, bytes]) -> dict[int, bytes | str]:
        return self.runner.run_stage(stage, rnd, blobs)
