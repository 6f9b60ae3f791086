"""A run's assembly: the ordered plugin table and :func:`prepare_run`, which every entry point calls.

``vatra.fit`` (and through it ``vatra train``'s worker and a distributed trial's ranks), the
asynchronous roles (:mod:`vatra.asyncrun`) and an in-process tune trial build their plugins here
and pin the run here, so a promise made about a run (the Delta version it reads, the parallel layout
it trains on, the drift check before it) holds for every one of them. This module sits above the
engine and the feature packages and below the entry points: it imports them, they import it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from vatra._io import atomic_write
from vatra.asyncdp import mode_plugin
from vatra.balance import Balancer
from vatra.comm.plugin import CommPlugin
from vatra.compress import EdgeTraining
from vatra.config import Config, dump_toml, load_config
from vatra.data import DataContext
from vatra.data._base import on_rank0
from vatra.data.tables.source import check_drift, pin
from vatra.engine import Plugin
from vatra.meta import MetaLearner
from vatra.monitor import (
    JsonlWriter,
    MlflowTracker,
    Monitor,
    ProgressDisplay,
    PrometheusExporter,
    StepTracer,
    TensorBoardWriter,
)
from vatra.monitor.energy import EnergyPlugin
from vatra.monitor.profile import TraceWindow
from vatra.monitor.rca_plugin import RootCause
from vatra.resilience import CheckpointPlugin, KillInjector, TrainingFaults
from vatra.resilience.heal import Healer
from vatra.rundir import RunDir, new_run_id, read_jsonl

__all__ = ["PLUGINS", "Share", "Slot", "build_plugins", "prepare_run", "resolve_run_dir"]


@dataclass(frozen=True)
class Slot:
    """One place in the dispatch order: the plugin ``build`` makes when the config ``wanted`` it
    (no ``build``: the caller's plugins go there)."""

    name: str
    wanted: Callable[[Config], bool]
    build: Callable[[Config, RunDir], Plugin] | None = None


# Order matters: fault injection first (everything after it sees the fault), then the ranks'
# synchronisation, balancing, monitoring and healing, checkpointing, the caller's plugins; display
# and run-folder writers last so they record what the others added to the step's metrics.
PLUGINS: tuple[Slot, ...] = (
    Slot("faults", lambda c: TrainingFaults.wanted(c.chaos), lambda c, rd: TrainingFaults(c.chaos)),
    Slot("kill", lambda c: bool(c.chaos.kill_at_steps), lambda c, rd: KillInjector(c.chaos, rd)),
    # sync: comm's DDP hook; local_sgd / diloco / hybrid: their plugin; async: the worker's link
    # to the servers, which only its role can make (build_plugins' ``mode``)
    Slot(
        "mode",
        lambda c: c.dist.mode != "async" and not c.meta.enabled,  # meta: its gather is the sync
        lambda c, rd: CommPlugin(c.comm) if c.dist.mode == "sync" else mode_plugin(c),
    ),
    # meta: the meta-step (episodes' meta-gradients gathered across ranks) as the micro-steps
    Slot("meta", MetaLearner.wanted, lambda c, rd: MetaLearner(c, rd)),
    Slot("balance", lambda c: Balancer.wanted(c.balance), lambda c, rd: Balancer(c.balance)),
    # before the monitor and checkpoints: they see the fake-quantized, pruned model
    Slot("edge", lambda c: c.edge.enabled, lambda c, rd: EdgeTraining(c.edge, c.train.steps)),
    Slot("energy", lambda c: c.energy.enabled, lambda c, rd: EnergyPlugin(c)),  # before monitor's report
    Slot("monitor", lambda c: c.monitor.enabled, lambda c, rd: Monitor(c, rd)),
    Slot("heal", lambda c: c.heal.enabled, lambda c, rd: Healer(c)),
    Slot(
        "prometheus",
        lambda c: c.monitor.prometheus_port is not None,
        lambda c, rd: PrometheusExporter(c.monitor),
    ),
    Slot("tracer", lambda c: c.monitor.tracing, lambda c, rd: StepTracer(c.monitor, rd.path)),
    Slot("mlflow", lambda c: bool(c.monitor.mlflow_uri), lambda c, rd: MlflowTracker(c, rd)),
    # async: the servers keep the model
    Slot(
        "checkpoint",
        lambda c: c.checkpoint.enabled and c.dist.mode != "async",
        lambda c, rd: CheckpointPlugin(c, rd),
    ),
    Slot("rca", lambda c: True, lambda c, rd: RootCause(rd)),  # a failure's cause (monitor.rca)
    Slot("caller", lambda c: True),
    Slot("progress", lambda c: True, lambda c, rd: ProgressDisplay(c.run.progress, c.run.log_every)),
    Slot(
        "tensorboard", lambda c: c.run.tensorboard, lambda c, rd: TensorBoardWriter(rd, every=c.run.tb_every)
    ),
    Slot("jsonl", lambda c: True, lambda c, rd: JsonlWriter(rd)),
    # last: a profiled step's span (vatra profile) holds every other plugin's work of that step
    Slot("profile", lambda c: bool(c.monitor.profile_steps), lambda c, rd: TraceWindow(c, rd)),
)


def build_plugins(
    cfg: Config, run_dir: RunDir, extra: Iterable[Plugin] = (), *, mode: Plugin | None = None
) -> list[Plugin]:
    """The plugins ``cfg`` asks for, in :data:`PLUGINS` order, with the caller's ``extra`` ones in
    the caller's slot; ``mode``: an asynchronous worker's link to the servers, in the mode's slot."""
    plugins: list[Plugin] = []
    for slot in PLUGINS:
        if slot.name == "caller":
            plugins.extend(extra)
        elif slot.name == "mode" and mode is not None:
            plugins.append(mode)
        elif slot.build is not None and slot.wanted(cfg):
            plugins.append(slot.build(cfg, run_dir))
    return plugins


class Share(Protocol):
    """What :func:`prepare_run` needs of the job: this process's rank, and rank 0's objects on every
    rank (a :class:`~vatra.engine.DistContext`, or the asynchronous roles' store)."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def is_main(self) -> bool: ...

    def broadcast_object(self, obj: object, src: int = 0) -> object: ...

    def barrier(self) -> None: ...


def prepare_run(
    cfg: Config, ctx: Share, given: str | Path | None = None, *, data_given: bool = False
) -> tuple[Config, RunDir]:
    """The config every rank trains on and its run folder, in this order: a Delta table's version
    pinned (rank 0 resolves the latest), ``parallel.auto``'s layout pinned, the run folder chosen
    (``given``, else a new one) with its config.toml, and ``data.drift_check`` run once per folder.
    ``data_given``: the caller passes its own datasets, so ``data.*`` is not read here."""
    delta = not data_given and cfg.data.name == "delta"
    if delta:
        cfg = _pin_table(cfg, ctx)
    if cfg.parallel.auto:
        cfg = _pin_layout(cfg, ctx, given)
    rd = resolve_run_dir(cfg, ctx, given)
    if delta and cfg.data.drift_check and not _drift_checked(rd):
        data = cfg.data
        _on_rank0(ctx, lambda: check_drift(data, rd.log_event))
    return cfg, rd


def resolve_run_dir(cfg: Config, ctx: Share, given: str | Path | None) -> RunDir:
    """``given``, or a new ``runs/<name>-<timestamp>`` chosen by rank 0 and shared with all ranks."""
    path = str(given) if given else str(Path(cfg.run.out_dir) / new_run_id(cfg.run.name))
    path = str(ctx.broadcast_object(path))
    run_dir = RunDir(Path(path))
    if ctx.is_main:
        run_dir.create()
        if not run_dir.config.exists():  # a resumed run keeps the config it started with
            atomic_write(run_dir.config, dump_toml(cfg), durable=True)
    ctx.barrier()
    return run_dir


def _on_rank0(ctx: Share, compute: Callable[[], Any]) -> Any:
    """``compute()`` on rank 0, its result (or its error) on every rank."""
    return on_rank0(
        DataContext(rank=ctx.rank, world_size=ctx.world_size, broadcast=ctx.broadcast_object), compute
    )


def _drift_checked(rd: RunDir) -> bool:
    """Whether this run folder's data already passed ``data.drift_check``: a resumed run reads the
    same pinned version, so it is not checked (and its alarms logged) again. A refused check
    counts for nothing: a restart must be refused again."""
    if not rd.events.exists():
        return False
    return any(e.get("event") == "drift_checked" and not e.get("refused") for e in read_jsonl(rd.events))


def _pin_table(cfg: Config, ctx: Share) -> Config:
    """A Delta table source read at one version on every rank: rank 0 resolves the latest, so the
    run folder's config.toml and every rank name the same one."""
    data = _on_rank0(ctx, lambda: pin(cfg).data.model_dump())
    return cfg.model_copy(update={"data": type(cfg.data).model_validate(data)})


def _pin_layout(cfg: Config, ctx: Share, given: str | Path | None) -> Config:
    """``parallel.auto``: the layout a resumed run started with (its run folder's config.toml), else
    the planner's choice on rank 0 for this world size, the same on every rank; written into the
    run folder's config.toml, so a resume (or a restart) trains on it again."""
    if given is not None and RunDir(Path(given)).config.exists():
        saved = load_config(RunDir(Path(given)).config).parallel
        if not saved.auto:
            return cfg.model_copy(update={"parallel": saved})
    # here, not at the top: vatra.parallel loads torch's compiler stack (torch._dynamo, ~200
    # modules), which a run without parallel.auto never needs
    from vatra.parallel.plan import choose

    chosen = type(cfg.parallel).model_validate(
        _on_rank0(ctx, lambda: choose(cfg, ctx.world_size).model_dump())
    )
    pinned = cfg.model_copy(update={"parallel": chosen})
    if ctx.is_main:
        print(
            f"vatra: parallel.auto chose dp {chosen.dp} × fsdp {chosen.fsdp} × tp {chosen.tp} × "
            f"pp {chosen.pp} for {ctx.world_size} rank(s) (vatra plan shows the ranking)",
            flush=True,
        )
        if given is not None and RunDir(Path(given)).config.exists():  # vatra train wrote it: pin there
            atomic_write(RunDir(Path(given)).config, dump_toml(pinned), durable=True)
    return pinned
