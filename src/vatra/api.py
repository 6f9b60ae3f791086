"""``vatra.fit``: train a user's model on a user's data, in one process or in each of many."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vatra.assembly import build_plugins, prepare_run
from vatra.asyncrun import fit_async
from vatra.config import Config, config_from_dict, load_config
from vatra.engine import DistContext, Plugin, Trainer
from vatra.errors import ConfigError
from vatra.monitor.mlflow_tracking import RUN_ID
from vatra.serve import Predictor, load
from vatra.serve.tracking import log_model

__all__ = ["FitResult", "Predictor", "as_config", "fit", "load"]

RUN_DIR_ENV = "VATRA_RUN_DIR"  # set by `vatra run`: every rank and every restart use this folder


@dataclass
class FitResult:
    """What ``fit`` returns on every rank: the summary, the trained model and the run folder."""

    summary: dict[str, Any]
    model: nn.Module
    run_dir: Path


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
    where = run_dir or os.environ.get(RUN_DIR_ENV)
    if cfg.dist.mode == "async":  # workers and parameter servers, each supervised in place
        summary, trained, path = fit_async(
            cfg, model=model, train=train, val=val, loss=loss, plugins=tuple(plugins), run_dir=where
        )
        return FitResult(summary, trained, path)
    ctx = DistContext.from_env(cfg.dist)
    try:
        cfg, rd = prepare_run(cfg, ctx, where, data_given=train is not None)
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
        if ctx.is_main and RUN_ID in trainer.state.extras:  # monitor.mlflow_uri: the model too
            log_model(cfg.monitor.mlflow_uri, trainer.state.extras[RUN_ID], rd)
        return FitResult(summary, trainer.model, rd.path)
    finally:
        ctx.destroy()
