"""``vatra.fit``: train a user's model on a user's data, in one process or in each of many."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vatra.asyncdp import mode_plugin
from vatra.balance import Balancer
from vatra.comm.plugin import CommPlugin
from vatra.config import Config, config_from_dict, dump_toml, load_config
from vatra.engine import DistContext, Plugin, Trainer
from vatra.errors import ConfigError
from vatra.monitor import (
    JsonlWriter,
    Monitor,
    ProgressDisplay,
    PrometheusExporter,
    StepTracer,
    TensorBoardWriter,
)
from vatra.resilience import CheckpointPlugin, KillInjector, TrainingFaults
from vatra.resilience.heal import Healer
from vatra.rundir import RunDir, new_run_id

RUN_DIR_ENV = "VATRA_RUN_DIR"  # set by `vatra run`: every rank and every restart use this folder


@dataclass
class FitResult:
    """What ``fit`` returns on every rank: the summary, the trained model and the run folder."""

    summary: dict[str, Any]
    model: nn.Module
    run_dir: Path


def build_plugins(
    cfg: Config, run_dir: RunDir, extra: Iterable[Plugin] = (), *, mode: Plugin | None = None
) -> list[Plugin]:
    """The plugins a config asks for, in dispatch order, with the caller's ``extra`` ones.

    Order matters: fault injection first (everything after it sees the fault), then
    communication, balancing, monitoring and healing, checkpointing, the caller's plugins; display and
    run-folder writers last so they record what the others added to the step's metrics.
    """
    plugins: list[Plugin] = []
    if TrainingFaults.wanted(cfg.chaos):
        plugins.append(TrainingFaults(cfg.chaos))
    if cfg.chaos.kill_at_steps:
        plugins.append(KillInjector(cfg.chaos, run_dir))
    if mode is not None:  # an asynchronous worker's link to the servers
        plugins.append(mode)
    else:
        plugins.append(CommPlugin(cfg.comm) if cfg.dist.mode == "sync" else mode_plugin(cfg))
    if Balancer.wanted(cfg.balance):
        plugins.append(Balancer(cfg.balance))
    if cfg.monitor.enabled:
        plugins.append(Monitor(cfg, run_dir))
    if cfg.heal.enabled:
        plugins.append(Healer(cfg))
    if cfg.monitor.prometheus_port is not None:
        plugins.append(PrometheusExporter(cfg.monitor))
    if cfg.monitor.tracing:
        plugins.append(StepTracer(cfg.monitor, run_dir.path))
    if cfg.checkpoint.enabled and cfg.dist.mode != "async":  # async: the servers keep the model
        plugins.append(CheckpointPlugin(cfg, run_dir))
    plugins.extend(extra)
    plugins.append(ProgressDisplay(cfg.run.progress, cfg.run.log_every))
    if cfg.run.tensorboard:
        plugins.append(TensorBoardWriter(run_dir, every=cfg.run.tb_every))
    plugins.append(JsonlWriter(run_dir))
    return plugins


def resolve_run_dir(cfg: Config, ctx: DistContext, given: str | Path | None) -> RunDir:
    """``given``, or a new ``runs/<name>-<timestamp>`` chosen by rank 0 and shared with all ranks."""
    path = str(given) if given else str(Path(cfg.run.out_dir) / new_run_id(cfg.run.name))
    path = str(ctx.broadcast_object(path))
    run_dir = RunDir(Path(path))
    if ctx.is_main:
        run_dir.create()
        if not run_dir.config.exists():  # a resumed run keeps the config it started with
            run_dir.config.write_text(dump_toml(cfg))
    ctx.barrier()
    return run_dir


def _on_rank0(ctx: DistContext, compute: Any) -> Any:
    """``compute()`` on rank 0, its result (or its error) on every rank."""
    from vatra.data import DataContext
    from vatra.data._base import on_rank0

    return on_rank0(
        DataContext(rank=ctx.rank, world_size=ctx.world_size, broadcast=ctx.broadcast_object), compute
    )


def _drift_checked(rd: RunDir) -> bool:
    """Whether this run folder's data already passed ``data.drift_check``: a resumed run reads the
    same pinned version, so it is not checked (and its alarms logged) again. A refused check
    counts for nothing: a restart must be refused again."""
    from vatra.rundir import read_jsonl

    if not rd.events.exists():
        return False
    return any(e.get("event") == "drift_checked" and not e.get("refused") for e in read_jsonl(rd.events))


def _pin_table(cfg: Config, ctx: DistContext) -> Config:
    """A Delta table source read at one version on every rank: rank 0 resolves the latest, so the
    run folder's config.toml and every rank name the same one."""
    from vatra.data.tables.source import pin

    data = _on_rank0(ctx, lambda: pin(cfg).data.model_dump())
    return cfg.model_copy(update={"data": type(cfg.data).model_validate(data)})


def _pin_layout(cfg: Config, ctx: DistContext, given: str | Path | None) -> Config:
    """``parallel.auto``: the layout a resumed run started with (its run folder's config.toml), else
    the planner's choice on rank 0 for this world size, the same on every rank; written into the
    run folder's config.toml, so a resume (or a restart) trains on it again."""
    if given is not None and RunDir(Path(given)).config.exists():
        saved = load_config(RunDir(Path(given)).config).parallel
        if not saved.auto:
            return cfg.model_copy(update={"parallel": saved})

    def choose() -> dict[str, Any]:
        from vatra.parallel.plan import choose

        return choose(cfg, ctx.world_size).model_dump()

    chosen = type(cfg.parallel).model_validate(_on_rank0(ctx, choose))
    pinned = cfg.model_copy(update={"parallel": chosen})
    if ctx.is_main:
        print(
            f"vatra: parallel.auto chose dp {chosen.dp} × fsdp {chosen.fsdp} × tp {chosen.tp} × "
            f"pp {chosen.pp} for {ctx.world_size} rank(s) (vatra plan shows the ranking)",
            flush=True,
        )
        if given is not None and RunDir(Path(given)).config.exists():  # vatra train wrote it: pin there
            RunDir(Path(given)).config.write_text(dump_toml(pinned))
    return pinned


def as_config(config: Config | dict[str, Any] | str | Path) -> Config:
    """A ``Config`` from a Config, a dict of sections, or a TOML file's path."""
    if isinstance(config, Config):
        return config
    if isinstance(config, dict):
        return config_from_dict(config, run="train")
    if isinstance(config, str | Path):
        return load_config(config, run="train")
    raise ConfigError(
        f"vatra.fit: config must be a path, a dict or a vatra.Config, not {type(config).__name__}"
    )


def fit(
    config: Config | dict[str, Any] | str | Path,
    *,
    model: nn.Module | None = None,
    train: Any = None,
    val: Any = None,
    loss: Any = None,
    plugins: Iterable[Plugin] = (),
    run_dir: str | Path | None = None,
) -> FitResult:
    """Train as ``config`` says; anything passed here replaces what the config would build.

    - ``model``: an ``nn.Module`` (default: ``model.*``). Under many processes DDP starts every
      rank from rank 0's weights.
    - ``train`` / ``val``: torch datasets that follow the batch contract — an item is
      ``(inputs, target)`` (default: ``data.*``; with ``train`` given, ``val=None`` means no evaluation).
    - ``loss``: ``(output, target) -> Tensor`` (default: ``train.loss``, by task).
    - ``plugins``: extra :class:`~vatra.engine.Plugin` objects, run before the display and writers.
    - ``run_dir``: the run folder (default: ``$VATRA_RUN_DIR``, set by ``vatra run``, else a new
      ``runs/<name>-<time>``); a folder with checkpoints resumes.

    In one plain process it trains without torch.distributed; under ``vatra run`` or torchrun each
    process calls it, joins the process group from the environment, and trains its share, with
    every plugin the config asks for (checkpoints, healing, compression, monitoring, the report's data).
    """
    cfg = as_config(config)
    if "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if cfg.dist.mode == "async":  # workers and parameter servers, each supervised in place
        from vatra.asyncdp.run import fit_async

        where = run_dir or os.environ.get(RUN_DIR_ENV)
        summary, trained, path = fit_async(
            cfg, model=model, train=train, val=val, loss=loss, plugins=tuple(plugins), run_dir=where
        )
        return FitResult(summary, trained, path)
    ctx = DistContext.from_env(cfg.dist)
    try:
        if train is None and cfg.data.name == "delta":
            cfg = _pin_table(cfg, ctx)
        if cfg.parallel.auto:
            cfg = _pin_layout(cfg, ctx, run_dir or os.environ.get(RUN_DIR_ENV))
        rd = resolve_run_dir(cfg, ctx, run_dir or os.environ.get(RUN_DIR_ENV))
        if train is None and cfg.data.name == "delta" and cfg.data.drift_check and not _drift_checked(rd):
            from vatra.data.tables.source import check_drift

            _on_rank0(ctx, lambda: check_drift(cfg.data, rd.log_event))
        trainer = Trainer.from_config(
            cfg,
            model=model,
            train=train,
            val=val,
            loss=loss,
            dist=ctx,
            plugins=build_plugins(cfg, rd, plugins),
            run_dir=rd,
        )
        summary = trainer.fit()
        # Leave together: no rank tears down its connections while a peer is still in a collective.
        # (The abort at exit it was first added for is fixed in dist.release_process_groups.)
        ctx.barrier()
        return FitResult(summary, trainer.model, rd.path)
    finally:
        ctx.destroy()
