"""The pluggable families of federated learning: ``Strategy``, ``Selector``, ``UploadHook``, and the
``Executor`` (where clients run) and ``Combiner`` (how their uploads are summed) the hooks plug into.

One round, driven by :class:`vatra.federated.server.FederatedServer`::

    available = executor.available()                    # clients that can train now
    selected  = selector.select(round, available, k)
    ins       = strategy.configure_round(round, selected)   # {client_id: FitIns}
    results, failures = executor.fit(round, ins)        # clients train; hook.encode runs on each client
    # every result passes check_fit_numbers and selector/strategy/hook.check_result, or its client
    # is a Failure of the round (``update_rejected``) before any state below sees it
    selector.observe(round, results, failures)
    merged    = hook.combine(round, results)            # e.g. secure aggregation: the sum only
    strategy.aggregate(round, merged, failures)         # None keeps the previous model
    # evaluate (every ``federated.evaluate_every`` rounds), as Flower's evaluate phase:
    server    = evaluator.score(strategy.server_models())     # the server's own held-out data, if any
    ins       = strategy.configure_evaluate(round, available)
    reports   = executor.evaluate(round, ins)           # each client scores on its own held-out rows
    # every report passes check_eval_numbers and strategy.check_eval, or it is dropped
    metrics   = strategy.aggregate_evaluate(round, reports)   # weighted by their validation sizes

Updates travel as flat float32 vectors (``FitRes.update``: the client's weights after training
minus the weights it was sent, in the order of :class:`vatra.federated.params.ParamLayout`).
Linear strategies (fedavg, fedprox, fedadam, fedyogi, and clustered per cluster) only need the
sample-weighted mean of the updates, so a secure-aggregation layer may replace the result list with
one ``FitRes`` per group (per cluster for clustered) whose ``update`` is the weighted mean and whose
``num_samples`` is the total weight: :func:`weighted_mean` gives the same answer either way.

Everything is called from one thread of the server process; implementations need no locking.

Layers, each importing only those below it: this module and the round loop (``server``, ``client``,
strategies, ``wire``); ``privacy`` (the DP hook) and ``secagg`` (the secure-aggregation combiner),
independent of each other; ``private`` (composes them); the drivers, ``simulation`` and ``grpc``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from vatra.losses import is_main_family, lower_is_better

if TYPE_CHECKING:
    from vatra.config import FederatedConfig
    from vatra.federated.params import ParamLayout


@dataclass
class FitIns:
    """What the server sends one client for one round."""

    client_id: int
    round: int
    models: list[np.ndarray]  # flat float32 vectors; more than one = the client picks (clustered)
    config: dict[str, Any] = field(default_factory=dict)  # local_steps, mu, personal_layers, ...


@dataclass
class FitRes:
    """What one client returns: its update and the facts selectors and strategies use."""

    client_id: int
    round: int
    num_samples: int  # aggregation weight
    update: np.ndarray  # flat float32: trained weights − sent weights
    metrics: dict[str, Any] = field(default_factory=dict)  # loss_before, loss_after, duration_s, model, ...
    payload: dict[str, np.ndarray] = field(default_factory=dict)  # an encoded update (UploadHook) on the wire


@dataclass
class EvalRes:
    """What one client reports after scoring the model(s) it was sent on its own held-out rows."""

    client_id: int
    round: int
    num_examples: int  # its validation rows: the weight of its metrics
    metrics: dict[str, Any] = field(default_factory=dict)  # accuracy, loss, ... (the task's metrics)


@dataclass(frozen=True)
class Failure:
    """A selected client that returned nothing usable this round, and why."""

    client_id: int
    reason: str


MAX_REPORTED = float(np.finfo(np.float32).max)  # a loss, a metric or a time a client computed in float32
MAX_COUNT = 2**53  # the wire's integer bound: counts add up exactly in float64


def reported_number(v: Any) -> float | None:
    """``v`` as a float when it is a real number (not a bool), else None."""
    return None if isinstance(v, bool) or not isinstance(v, int | float) else float(v)


def check_range(
    metrics: dict[str, Any], name: str, lo: float, hi: float, *, required: bool = False
) -> str | None:
    """Why ``metrics[name]`` is refused (missing when required, not a number, outside [lo, hi]), or None."""
    if name not in metrics:
        return f"metric {name!r} is missing" if required else None
    v = reported_number(metrics[name])
    if v is None or not lo <= v <= hi:  # NaN fails both comparisons
        return f"metric {name!r} = {metrics[name]!r} is outside [{lo:g}, {hi:g}]"
    return None


def check_fit_numbers(res: FitRes) -> str | None:
    """The numbers of a fit result the server itself computes with: its sample count (the weight of
    its update), ``duration_s`` (the round's slowest client) and ``train_loss`` (the round's mean)."""
    n = res.num_samples
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_COUNT:
        return f"num_samples {n!r} is outside [1, 2^53]"
    return check_range(res.metrics, "duration_s", 0.0, MAX_REPORTED) or check_range(
        res.metrics, "train_loss", -MAX_REPORTED, MAX_REPORTED
    )


def check_eval_numbers(rep: EvalRes) -> str | None:
    """An evaluation report's count and metrics: each count × metric product and their sums stay
    finite (|metric| ≤ float32's largest, count ≤ 2^53), so the weighted means cannot overflow."""
    n = rep.num_examples
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_COUNT:
        return f"num_examples {n!r} is outside [0, 2^53]"
    for name in rep.metrics:
        if reason := check_range(rep.metrics, name, -MAX_REPORTED, MAX_REPORTED):
            return reason
    return None


def aggregate_client_metrics(results: Sequence[EvalRes]) -> dict[str, Any]:
    """``client_<metric>``: the mean over clients weighted by ``num_examples``; ``mean_client_<metric>``
    and ``worst_client_<metric>`` over the clients that reported, for each metric that can be a task's
    main one (accuracy, ndcg@k, r2, perplexity, loss; a multitask head's too)."""
    scored = [r for r in results if r.num_examples > 0 and r.metrics]
    if not scored:
        return {}
    total = float(sum(r.num_examples for r in scored))
    out: dict[str, Any] = {"evaluated_clients": len(scored), "evaluated_examples": int(total)}
    names = sorted({k for r in scored for k, v in r.metrics.items() if isinstance(v, int | float)})
    for name in names:
        vals = [(r.num_examples, float(r.metrics[name])) for r in scored if name in r.metrics]
        if vals and all(np.isfinite(v) for _, v in vals):
            out[f"client_{name}"] = sum(n * v for n, v in vals) / sum(n for n, _ in vals)
    for name in (n for n in names if is_main_family(n)):  # accuracy, r2, ndcg@k, ..., each head's
        per = [float(r.metrics[name]) for r in scored if name in r.metrics]
        if per:
            out[f"mean_client_{name}"] = float(np.mean(per))
            out[f"worst_client_{name}"] = float(max(per) if lower_is_better(name) else min(per))
    return out


def weighted_mean(results: Sequence[FitRes]) -> np.ndarray:
    """Sample-weighted mean of the updates, accumulated in float64 (order-independent to ~1e-16)."""
    if not results:
        raise ValueError("weighted_mean needs at least one result")
    total = float(sum(r.num_samples for r in results))
    acc = np.zeros(results[0].update.shape, dtype=np.float64)
    for r in results:
        acc += (r.num_samples / total) * r.update.astype(np.float64)
    return acc


class Strategy:
    """Base of the aggregation strategies; holds the server's model state.

    Call order: ``initialize`` once (fresh start) or ``load_state`` (resume); then per round
    ``configure_round`` → ``aggregate`` → ``evaluate``; ``state`` after each round for the
    checkpoint. ``aggregate`` returns the new global vector (or None when nothing changed).

    A user's subclass named by import string (``federated.strategy = "pkg.mod:MyStrategy"``) works
    like a built-in: the server calls it as ``MyStrategy(federated_config, layout)``.
    """

    name = "base"

    def __init__(self, cfg: FederatedConfig, layout: ParamLayout) -> None:
        self.cfg = cfg
        self.layout = layout
        self.weights: np.ndarray = np.zeros(layout.size, dtype=np.float32)  # the global model

    def initialize(self, weights: np.ndarray, seed: int) -> None:
        self.weights = weights.astype(np.float32, copy=True)

    def fit_config(self) -> dict[str, Any]:
        return {"local_steps": self.cfg.local_steps, "local_epochs": self.cfg.local_epochs, "mu": 0.0}

    def configure_round(self, rnd: int, selected: Sequence[int]) -> dict[int, FitIns]:
        return {c: FitIns(c, rnd, [self.weights], self.fit_config()) for c in selected}

    def aggregate(
        self, rnd: int, results: Sequence[FitRes], failures: Sequence[Failure]
    ) -> np.ndarray | None:
        raise NotImplementedError

    def check_result(self, res: FitRes) -> str | None:
        """Why a client's result must be refused before :meth:`aggregate` (a metric it reads that is
        missing or out of range), or None. The server drops a refused client for the round."""
        return None

    def check_eval(self, rep: EvalRes) -> str | None:
        """Why an evaluation report must be refused before :meth:`aggregate_evaluate`, or None."""
        return None

    # -------------------------------------------------------------- evaluate
    def server_models(self) -> list[np.ndarray]:
        """The model(s) the server scores on its own held-out data: the global model."""
        return [self.weights]

    def configure_evaluate(self, rnd: int, clients: Sequence[int]) -> dict[int, FitIns]:
        """What each client scores on its own validation rows: the global model, by default."""
        return {c: FitIns(c, rnd, [self.weights], self.fit_config()) for c in clients}

    def aggregate_evaluate(self, rnd: int, results: Sequence[EvalRes]) -> dict[str, Any]:
        """The clients' metrics, each weighted by its validation rows (``client_<name>``), and the mean
        and worst client figure of each main-metric candidate (accuracy, r2, loss, ...) for fairness."""
        return aggregate_client_metrics(results)

    def update_size(self) -> int:
        """Length of the update vector clients must return (checked before aggregation)."""
        return self.layout.size

    # --------------------------------------------------------------- checkpoint
    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """(JSON-able facts, named arrays) that restore this strategy exactly."""
        return {}, {"weights": self.weights}

    def load_state(self, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        self.weights = arrays["weights"]


class Selector:
    """Base of client selection: ``select`` before a round, ``observe`` after it.

    Deterministic for a seed: randomness comes from ``numpy.random.default_rng([seed, round])``.
    A user's subclass named by import string (``federated.selection = "pkg.mod:MySelector"``) works
    like a built-in: the server calls it as ``MySelector(federated_config, seed)``.
    """

    name = "base"

    def __init__(self, cfg: FederatedConfig, seed: int) -> None:
        self.cfg = cfg
        self.seed = seed

    def select(self, rnd: int, available: Sequence[int], k: int) -> list[int]:
        raise NotImplementedError

    def observe(self, rnd: int, results: Sequence[FitRes], failures: Sequence[Failure]) -> None:
        """Feedback from the round just finished (losses, durations, drop-outs)."""

    def check_result(self, res: FitRes) -> str | None:
        """Why a result must be refused before :meth:`observe` reads it, or None."""
        return None

    def state(self) -> dict[str, Any]:
        return {}

    def load_state(self, state: dict[str, Any]) -> None:
        del state


class Executor(Protocol):
    """Runs one round's client work somewhere: a process pool (simulation) or gRPC clients (the hub).

    An executor may also carry ``declared`` (the training rows each client declared when it joined;
    robust screening compares them), and a hook's :meth:`UploadHook.wrap` may wrap it.
    """

    def available(self) -> list[int]:
        """Clients that can be selected now (may wait for enough of them)."""
        ...

    def fit(
        self, rnd: int, ins: dict[int, FitIns], expected: int
    ) -> tuple[list[FitRes], list[Failure], int, int]:
        """(accepted results, failures, bytes down, bytes up); results must have ``expected`` floats."""
        ...

    def evaluate(self, rnd: int, ins: dict[int, FitIns]) -> tuple[list[EvalRes], list[Failure]]:
        """Each client's report on its own held-out rows (those without any report 0 examples)."""
        ...


@runtime_checkable
class StageRunner(Protocol):
    """An executor whose clients are devices that answer protocol stages themselves (the gRPC hub).

    Secure aggregation runs its stages through it; an executor without it (simulation) has its
    clients' protocol endpoints played in the server process by the combiner.
    """

    def run_stage(self, stage: str, rnd: int, requests: dict[int, bytes]) -> dict[int, bytes | str]:
        """Hand each client its packed request; the packed replies of those that answered (a str:
        why a client's reply was refused). Clients that went silent are absent."""
        ...


@dataclass
class RoundSum:
    """What a :class:`Combiner` gives for one round: the sum of the uploads and of their weights."""

    total: np.ndarray  # float64: Σ w·update over the survivors (the update's extra coordinates too)
    weight: float  # Σ w (each w = num_samples, capped; 1 per client when unweighted)
    survivors: int  # clients whose upload is in the sum


class Combiner(Protocol):
    """How a round's uploads are summed when the server may not see them one by one (secure
    aggregation). Client side: :meth:`keep` (what the upload says instead of the update) and
    :meth:`respond` (the protocol's stages); server side: :meth:`wrap` once, then per round
    :meth:`decode` per arriving result, :meth:`sum`, :meth:`round_metrics`."""

    def wrap(self, executor: Executor, stages: StageRunner | None) -> Executor:
        """The executor the round loop talks to; ``stages`` reaches deployed clients (None: simulated)."""
        ...

    def keep(self, res: FitRes) -> FitRes:
        """Client: keep the update for the protocol; what is uploaded instead."""
        ...

    def respond(self, blob: bytes) -> bytes:
        """Client: the answer to one packed protocol request."""
        ...

    def decode(self, res: FitRes) -> FitRes:
        """Server: an arriving result (a deployed client's notice gets a placeholder update)."""
        ...

    def sum(self, rnd: int, results: list[FitRes]) -> RoundSum | None:
        """The round's sum, or None when the round is refused (logged)."""
        ...

    def round_metrics(self, rnd: int, metrics: dict[str, Any]) -> None:
        """Add this round's facts (threshold, survivors, protocol bytes) to its metrics row."""
        ...

    def summary(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """The run summary's part about this combiner."""
        ...


class UploadHook:
    """The upload path between a client's update and the strategy (identity by default).

    ``encode`` runs on the client before upload (compression, clipping and noise, masking);
    ``decode`` runs on the server per arriving result; ``combine`` runs once per round before
    ``Strategy.aggregate`` and may replace the list (secure aggregation: the weighted mean only).
    """

    name = "none"

    def encode(self, res: FitRes, ins: FitIns) -> FitRes:
        return res

    def decode(self, res: FitRes) -> FitRes:
        return res

    def combine(self, rnd: int, results: list[FitRes]) -> list[FitRes]:
        return results

    def check_result(self, res: FitRes) -> str | None:
        """Server: why a decoded result must be refused before :meth:`combine`, or None."""
        return None

    # Server-side round hooks (secure aggregation and privacy use them; identity by default).
    def wrap(self, executor: Executor) -> Executor:
        """The client executor the server talks to (a hook may need a channel to the clients)."""
        return executor

    def allow_round(self, rnd: int) -> bool:
        """False stops training before round ``rnd`` (a privacy budget)."""
        return True

    def round_metrics(self, rnd: int, metrics: dict[str, Any]) -> None:
        """Add this round's facts (ε, secure-aggregation survivors, protocol bytes) to its metrics row."""

    def resume(self, rows: list[dict[str, Any]]) -> None:
        """Rebuild state (an accountant) from the metrics rows of a resumed run whose checkpoint has
        no hook state (older runs); :meth:`load_state` is preferred."""

    def state(self) -> dict[str, Any]:
        """JSON-able server-side state saved in the server checkpoint (an accountant's)."""
        return {}

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state` on resume."""
        del state

    def encode_eval(self, res: EvalRes) -> EvalRes:
        """A client's evaluation report before it leaves the client (privacy: a metric whitelist)."""
        return res

    def summary(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        return {}

    def client_plugins(self, model: Any) -> list[Any]:
        """Engine plugins for a client's local training (DP-SGD)."""
        return []

    def respond(self, blob: bytes) -> bytes:
        """A deployed client's answer to a protocol message (secure-aggregation stages)."""
        raise NotImplementedError(f"upload hook {self.name!r} answers no protocol messages")
