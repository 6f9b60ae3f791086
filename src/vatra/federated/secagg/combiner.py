"""Secure aggregation as a :class:`~vatra.federated._base.Combiner`: clients mask, the server unmasks the sum.

Client side (a deployed device): :meth:`SecAggCombiner.keep` holds the trained update in the
client's one protocol endpoint (:class:`~.channel.ClientParty`) and uploads a notice without it;
:meth:`~SecAggCombiner.respond` answers the stages. Server side: :meth:`~SecAggCombiner.wrap`
puts :class:`SecAggExecutor` around the round's executor — with a stage runner (the gRPC hub) the
stages go to the devices, without one (simulation) it keeps each trained update and plays the
devices itself — and :meth:`~SecAggCombiner.sum` runs one protocol run per round
(:func:`~.channel.secure_sum`) and decodes the sum. Only masked words reach it.

What each client masks (:meth:`SecAggCombiner.input_words`): ``[q(w·Δ/unit) …, q(tail) …, w]`` as
words mod 2^bits, the weight w last (summed mod 2^32 whatever ``bits`` is). ``tail`` is the
update's extra coordinates with their own range (the DP hook's clip count); ``weighted`` False
makes every w = 1 (client-level DP's unweighted mean).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np

from vatra.config import Config
from vatra.errors import ConfigError
from vatra.federated._base import EvalRes, Executor, Failure, FitIns, FitRes, RoundSum, StageRunner
from vatra.federated.secagg.channel import (
    ClientParty,
    CountingChannel,
    LocalParties,
    RemoteParties,
    secure_sum,
)
from vatra.federated.secagg.protocol import Quantizer, RoundAborted
from vatra.federated.secagg.server import SecAggServer
from vatra.federated.wire import encode_res
from vatra.resilience.chaos import ClientDropout
from vatra.rundir import RunDir

WEIGHT_WORDS = 1  # the weight w ends each masked vector, summed mod 2^32 whatever secure_aggregation.bits is


class SecAggCombiner:
    """One per process: a deployed client's endpoint (``device``), or the server's side of the protocol."""

    def __init__(
        self,
        cfg: Config,
        *,
        tail: int = 0,
        tail_clip: float = 1.0,
        weighted: bool = True,
        device: bool = False,
        run_dir: RunDir | None = None,
    ) -> None:
        self.cfg = cfg
        self.sa = cfg.federated.secure_aggregation
        self.tail, self.tail_clip, self.weighted = tail, tail_clip, weighted
        self.device = device  # a deployed client: keeps its update and answers the protocol itself
        self.run_dir = run_dir
        self.party: ClientParty | None = None
        self.executor: SecAggExecutor | None = None
        self.facts: dict[str, Any] = {}

    # ------------------------------------------------------------ client side
    def keep(self, res: FitRes) -> FitRes:
        """Deployed client: the update stays here; the upload says 'trained'.

        One protocol endpoint for the client's whole life: it trains each round once, rounds only
        going up, and masks each update in one protocol run of its round (:class:`ClientParty`):
        a server that ran two sums over the same update with other survivors could subtract them."""
        if not self.device:  # a simulated client: the server side plays its device
            return res
        if self.party is None:
            self.party = ClientParty(res.client_id, self.sa, wide=WEIGHT_WORDS)
        self.party.trained(res.round, partial(self.input_words, res))  # SecAggError for an old round
        return FitRes(res.client_id, res.round, res.num_samples, np.zeros(0, np.float32), res.metrics)

    def respond(self, blob: bytes) -> bytes:
        if self.party is None:
            raise ConfigError("secure-aggregation message before any training on this client")
        return self.party.respond_or_refuse(blob)

    def input_words(self, res: FitRes, clients: int) -> np.ndarray:
        """A client's masked-sum input: [q(w·Δ/unit) …, q(tail) …, w] as words mod 2^bits."""
        w = min(res.num_samples, self.sa.max_weight) if self.weighted else 1
        unit = self.sa.max_weight if self.weighted else 1
        d = res.update.size - self.tail
        body = Quantizer(self.sa.bits, self.sa.clip, clients).encode(res.update[:d] * (w / unit))
        tail = Quantizer(self.sa.bits, self.tail_clip, clients).encode(res.update[d:])
        return np.concatenate([body, tail, np.array([w], dtype=np.uint32)])

    # ------------------------------------------------------------ server side
    def wrap(self, executor: Executor, stages: StageRunner | None) -> Executor:
        self.executor = SecAggExecutor(executor, self, stages)
        return self.executor

    def decode(self, res: FitRes) -> FitRes:
        """A deployed client's 'trained' notice gets a zero placeholder (never its update)."""
        if res.update.size == 0 and self.executor is not None:
            res.update = np.zeros(self.executor.expected, np.float32)
        return res

    def _log(self, kind: str, **facts: Any) -> None:
        if self.run_dir is not None:
            self.run_dir.log_event(kind, **facts)

    def sum(self, rnd: int, results: list[FitRes]) -> RoundSum | None:
        """One protocol run over the round's survivors; None when it aborts or its weight is impossible."""
        assert self.executor is not None, "secure aggregation needs wrap(executor) before sum"
        link = self.executor.link
        cids = sorted(r.client_id for r in results)
        dim = self.executor.expected + WEIGHT_WORDS  # the update (with its tail), its weight
        seed = self.cfg.run.seed * 100_003 + rnd
        server = SecAggServer(rnd, self.sa, cids, dim, seed=seed, wide=WEIGHT_WORDS)
        try:
            words = secure_sum(server, link)
        except RoundAborted as err:
            self.facts = {"secagg_aborted": True, "secagg_threshold": server.t, "secagg_dropouts": None}
            self._log("secagg_aborted", round=rnd, reason=str(err), survivors=server.survivors)
            if server.rejected:
                self._log("secagg_rejected", round=rnd, clients=server.rejected)
            return None
        n1 = len(server.keys)
        unit = self.sa.max_weight if self.weighted else 1
        d = self.executor.expected - self.tail
        total = Quantizer(self.sa.bits, self.sa.clip, n1).decode_sum(words[:d]) * unit
        tail = Quantizer(self.sa.bits, self.tail_clip, n1).decode_sum(words[d:-1])
        weight = float(words[-1])
        survivors = server.survivors["summed"]
        self.facts = {
            "secagg_threshold": server.t,
            "secagg_survivors": survivors,
            "secagg_dropouts": len(cids) - survivors,
            "secagg_aborted": False,
        }
        if rejected := {**link.rejected, **server.rejected}:
            self._log("secagg_rejected", round=rnd, clients=rejected)
        if weight > unit * survivors or (not self.weighted and weight != survivors):
            # an honest client's weight is at most max_weight (1 when unweighted); the sum hides who
            # sent more, so the round's result is refused, not one client's
            self.facts["secagg_aborted"] = True
            why = f"summed weight {weight:.0f} of {survivors} clients, each at most {unit}"
            self._log("secagg_weight_refused", round=rnd, reason=why)
            return None
        return RoundSum(np.concatenate([total, tail]), weight, survivors)

    def round_metrics(self, rnd: int, metrics: dict[str, Any]) -> None:
        metrics.update(self.facts)
        if self.executor is not None:
            link = self.executor.link
            metrics["bytes_up"] += link.bytes_up
            metrics["bytes_down"] += link.bytes_down
            link.bytes_up = link.bytes_down = 0

    def summary(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "secure_aggregation": {
                "mode": self.sa.mode,
                "threshold": max((r.get("secagg_threshold") or 0 for r in rows), default=0),
                "dropouts_survived": sum(r.get("secagg_dropouts") or 0 for r in rows),
                "rounds_aborted": sum(bool(r.get("secagg_aborted")) for r in rows),
            }
        }


class SecAggExecutor:
    """Wraps the round's executor for secure aggregation. With a stage runner the deployed clients
    keep their updates and answer the stages themselves; without one (simulation) this object plays
    the devices: it keeps each trained update and answers through a byte-counting channel, and the
    round loop sees placeholders only."""

    def __init__(self, inner: Executor, combiner: SecAggCombiner, stages: StageRunner | None) -> None:
        self.inner = inner
        self.combiner = combiner
        self.expected = 0
        self.updates: dict[int, FitRes] = {}
        self.link: CountingChannel
        if stages is not None:
            self.link = RemoteParties(stages)
        else:
            self.link = LocalParties(combiner.sa, self._words, wide=WEIGHT_WORDS)
        if (drop := combiner.cfg.chaos.drop_clients_at) is not None:
            self.link.chaos = ClientDropout(drop.round, drop.stage, drop.count)  # the highest ids drop

    def available(self) -> list[int]:
        return self.inner.available()

    def fit(
        self, rnd: int, ins: dict[int, FitIns], expected: int
    ) -> tuple[list[FitRes], list[Failure], int, int]:
        self.combiner.facts = {}
        self.expected = expected + self.combiner.tail  # uploads carry the tail (clip count) too
        results, failures, down, up = self.inner.fit(rnd, ins, expected)
        if not isinstance(self.link, LocalParties):
            return results, failures, down, up
        self.updates = {r.client_id: r for r in results}
        self.link.trained(rnd, list(self.updates))  # each simulated device masks its update in round rnd only
        meta = [
            FitRes(r.client_id, r.round, r.num_samples, np.zeros(0, np.float32), r.metrics) for r in results
        ]
        return meta, failures, down, sum(len(encode_res(m)) for m in meta)

    def _words(self, cid: int, clients: int) -> np.ndarray:
        """What simulated device ``cid`` masks: its update (:meth:`SecAggCombiner.input_words`)."""
        return self.combiner.input_words(self.updates[cid], clients)

    def evaluate(self, rnd: int, ins: dict[int, FitIns]) -> tuple[list[EvalRes], list[Failure]]:
        return self.inner.evaluate(rnd, ins)

    @property
    def declared(self) -> dict[int, int] | None:
        """The training rows each deployed client declared at join (None in simulation)."""
        return getattr(self.inner, "declared", None)
