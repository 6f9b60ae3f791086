"""A run's model rebuilt in one process: its spec, its architecture and a checkpoint version's weights.

The architecture comes from the run's ``config.toml`` (``model.*``) and the data spec: a table's
from its fitted ``data/preprocess.json`` (no training rows read), any other source's from its
builder. The weights come from the run's checkpoint store: a version's DCP files are fetched
(checksums verified) and loaded into the plain model's state dict. DCP reshards on load, so a
checkpoint written under DDP, FSDP or tensor parallelism (sharded over many ranks) loads into one
process alike.
"""

from __future__ import annotations

import json
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from vatra.config import Config, load_config
from vatra.data import DataContext, DatasetSpec, build_dataset
from vatra.data._base import TargetSpec
from vatra.data.tabular import Preprocess
from vatra.data.tabular.preprocess import table_spec
from vatra.errors import ConfigError
from vatra.models import build_model
from vatra.resilience import LATEST, open_store
from vatra.resilience.snapshot import DCP_METADATA
from vatra.resilience.store import StoreError
from vatra.rundir import RunDir


@dataclass
class RunModel:
    """What :func:`load_run_model` rebuilds: the model in eval mode with its weights, and where from."""

    cfg: Config
    model: nn.Module
    spec: DatasetSpec
    preprocess: Preprocess | None
    standardize: dict[str, list[float]] | None  # array inputs (npz): the training mean and std
    checkpoint: dict[str, Any]  # version, step, time of the checkpoint the weights come from
    class_outputs: int | None = None  # a meta-learned model: its first N outputs are the task's classes


def run_config(run_dir: Path) -> Config:
    rd = RunDir(run_dir)
    if not rd.config.is_file():
        raise ConfigError(
            f"{run_dir}: not a run folder (no config.toml) nor a model folder (no vatra-model.json)"
        )
    return load_config(rd.config)


def run_spec(
    cfg: Config, run_dir: Path
) -> tuple[DatasetSpec, Preprocess | None, dict[str, list[float]] | None]:
    """The data spec the run's model was built for, and its fitted preprocessing: a table's
    :class:`Preprocess`, or array inputs' (npz) standardisation statistics."""
    path = run_dir / "data" / "preprocess.json"
    saved = _read_json(path) if path.is_file() else None
    if saved is not None and "format" in saved:
        pre = Preprocess.load(path)
        return table_spec(pre), pre, None
    heads = {name: h.task for name, h in cfg.train.multitask.heads.items()}
    ctx = DataContext(seed=cfg.run.seed, run_dir=run_dir, task=cfg.train.task, head_tasks=heads)
    spec = build_dataset(cfg.data, ctx, cfg.train.task).spec
    if saved is not None and {"mean", "std"} <= set(saved):
        return spec, None, {"mean": list(saved["mean"]), "std": list(saved["std"])}
    return spec, None, None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"vatra.load: cannot read the fitted preprocessing {path}: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"vatra.load: {path} is not a fitted preprocessing")
    return raw


def spec_to_dict(spec: DatasetSpec) -> dict[str, Any]:
    return {
        "kind": spec.kind,
        "input_shape": list(spec.input_shape),
        "num_classes": spec.num_classes,
        "image_shape": list(spec.image_shape) if spec.image_shape else None,
        "heads": {k: [h.kind, h.size] for k, h in spec.heads.items()},
        "categorical": dict(spec.categorical),
        "feature_names": list(spec.feature_names),
    }


def spec_from_dict(raw: dict[str, Any]) -> DatasetSpec:
    return DatasetSpec(
        raw["kind"],
        tuple(raw["input_shape"]),
        int(raw["num_classes"]),
        tuple(raw["image_shape"]) if raw.get("image_shape") else None,
        heads={k: TargetSpec(kind, size) for k, (kind, size) in raw.get("heads", {}).items()},
        categorical=dict(raw.get("categorical", {})),
        feature_names=tuple(raw.get("feature_names", ())),
    )


def build_run_model(cfg: Config, spec: DatasetSpec) -> nn.Module:
    """The run's architecture with fresh weights (a user's builder must be importable here)."""
    heads = {name: h.size for name, h in cfg.train.multitask.heads.items()}
    try:
        return build_model(cfg.model, spec, heads)
    except ConfigError as err:
        raise ConfigError(
            f"{err}; a model folder exported as torchscript or onnx needs no model code"
        ) from None


def load_run_model(run_dir: Path, version: str | None = None) -> RunModel:
    """The run's model with the weights of checkpoint ``version`` (a version id, tag or unique
    prefix; default the ``latest`` tag), in eval mode on the CPU."""
    cfg = run_config(run_dir)
    spec, pre, standardize = run_spec(cfg, run_dir)
    model = build_run_model(cfg, spec)
    store = open_store(cfg.store, RunDir(run_dir).checkpoints)
    try:
        manifest = store.manifest(version or LATEST)
    except StoreError as err:
        if version is None and not store.versions():
            raise ConfigError(
                f"{run_dir}: the run saved no checkpoint, so it has no weights to load; train with "
                "checkpoint.enabled = true"
            ) from None
        raise ConfigError(f"vatra.load: {err}") from None
    files = [n for n in manifest["files"] if n == DCP_METADATA or n.endswith(".distcp")]
    with tempfile.TemporaryDirectory(prefix="vatra-load-") as tmp:
        try:
            store.fetch(manifest, files, Path(tmp))
        except StoreError as err:
            raise ConfigError(f"vatra.load: checkpoint {manifest['version']}: {err}") from None
        load_dcp_weights(model, Path(tmp), manifest["version"])
    model.eval()
    info = {k: manifest.get(k) for k in ("version", "step", "time", "world_size")}
    return RunModel(cfg, model, spec, pre, standardize, info)


def load_dcp_weights(model: nn.Module, folder: Path, version: str) -> None:
    """The model's parameters and buffers from a DCP checkpoint folder, in this one process.

    A run saves ``{"model": ..., "optim": ...}`` keyed by parameter names; a model trained with a
    loss that has parameters of its own saved them under ``model.model.*`` (the Objective wrapper).
    Only the model's entries are read; sharded entries are gathered whole by DCP's planner.
    """
    saved = set(dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata)
    own = model.state_dict()
    for inner in ("", "model."):
        if all(f"model.{inner}{k}" in saved for k in own):
            break
    else:
        absent = sorted(k for k in own if f"model.{k}" not in saved)[:3]
        raise ConfigError(
            f"checkpoint {version} does not hold this model's weights (no {absent}); was the run's "
            "config.toml changed after training?"
        )
    state = {"model": {inner + k: v for k, v in own.items()}}
    with warnings.catch_warnings():  # one process without a process group is what is meant here
        warnings.filterwarnings("ignore", message=r"torch.distributed is disabled, unavailable or uninit")
        try:
            dcp.load(state, storage_reader=dcp.FileSystemReader(str(folder)), no_dist=True)
        except Exception as err:  # DCP's planner: a shape that differs from the config's model
            raise ConfigError(f"checkpoint {version} does not fit the run's model: {err}") from None
    with torch.no_grad():
        model.load_state_dict({k.removeprefix(inner): v for k, v in state["model"].items()})
