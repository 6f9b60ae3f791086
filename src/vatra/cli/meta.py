"""``vatra meta CONFIG`` (meta-learning on the built-in worker) and ``vatra meta adapt RUN``."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import typer
from typer.core import TyperGroup

from vatra.cli.app import app
from vatra.cli.train import (
    SET_HELP,
    LocalAddr,
    MaxRestarts,
    Nnodes,
    NodeRank,
    Nproc,
    RdzvConf,
    RdzvEndpoint,
    RdzvId,
    RunDirOpt,
    launch_run,
)
from vatra.config import load_config
from vatra.errors import ConfigError


class _ConfigOrCommand(TyperGroup):
    """``vatra meta CONFIG ...`` runs the config (the ``run`` command); ``vatra meta adapt ...``
    is the sub-command of that name."""

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:  # typer's own copy of click's types
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            args = ["run", *args]
        return super().resolve_command(ctx, args)


meta_app = typer.Typer(
    cls=_ConfigOrCommand,
    rich_markup_mode=None,
    no_args_is_help=True,
    help="Meta-learn an initialisation that adapts to a new task from a few labelled examples: "
    "vatra meta CONFIG (MAML, FO-MAML, ANIL, Reptile across ranks), vatra meta adapt RUN.",
)
app.add_typer(meta_app, name="meta")


@meta_app.command("run", hidden=True)
def meta_run(
    config: Path = typer.Argument(
        ..., help="TOML config with a meta section, e.g. examples/meta_digits.toml."
    ),
    nproc: Nproc = None,
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    run_dir: RunDirOpt = None,
    max_restarts: MaxRestarts = 0,
    nnodes: Nnodes = "1",
    rdzv_endpoint: RdzvEndpoint = None,
    rdzv_id: RdzvId = "vatra",
    rdzv_conf: RdzvConf = [],  # noqa: B006  (typer reads the default; it is never mutated)
    node_rank: NodeRank = None,
    local_addr: LocalAddr = None,
) -> None:
    """Meta-train on N local processes (or many nodes): each step is one meta-step over
    meta.tasks_per_step episodes shared out across the ranks; the vatra train options apply."""
    overrides = [*set_, "meta.enabled=true"]
    cfg = load_config(config, overrides, run="meta")
    if nnodes == "1":  # the world size is known: refuse a meta-batch that does not split before any start
        cfg.meta.check_world(nproc or cfg.dist.nproc)
    flags = (nnodes, rdzv_endpoint, rdzv_id, rdzv_conf, node_rank, local_addr, max_restarts)
    launch_run(cfg, config, overrides, nproc, run_dir, "vatra meta", flags)


@meta_app.command("adapt")
def meta_adapt(
    run: Path = typer.Argument(..., help="The run folder of a finished vatra meta run."),
    data: str = typer.Option(
        ..., "--data", help="The new task's labelled rows: a .csv/.parquet file or .npz."
    ),
    shots: str = typer.Option(
        "1,5,10", "--shots", help="Labelled examples per class to adapt on, e.g. 1,5,10."
    ),
    repeats: int = typer.Option(5, "--repeats", min=1, help="Support sets drawn per K (the spread)."),
    steps: int | None = typer.Option(None, "--steps", min=1, help="Inner steps (default: as meta-trained)."),
    lr: float | None = typer.Option(
        None, "--lr", help="Inner LR (default: as meta-trained, Meta-SGD's learned)."
    ),
    set_: list[str] = typer.Option([], "--set", help="Override a data option of the run: data.key=value."),
    out: Path | None = typer.Option(None, "--out", help="Also write the curve as JSON here."),
    save: Path | None = typer.Option(
        None,
        "--save",
        help="Also write the model adapted on the largest K (the curve's first draw) as a model "
        "folder here, for vatra.load, vatra serve and vatra model register.",
    ),
    fmt: str = typer.Option(
        "safetensors", "--format", help="--save's weights format: safetensors, torchscript or onnx."
    ),
) -> None:
    """Fine-tune the meta-learned initialisation on K labelled examples per class of a new task and
    print its accuracy on the remaining rows against K (mean and spread over the repeats)."""
    ks = _shots(shots)
    if save is not None:
        from vatra.cli.meta_save import SAVE
        from vatra.serve.export import check_destination

        check_destination(save, fmt, SAVE)
    cfg = load_config(run / "config.toml", set_) if (run / "config.toml").is_file() else None
    if cfg is None:
        raise ConfigError(f"{run}: no config.toml; pass the run folder of a 'vatra meta' run")
    from vatra.losses import build_loss  # torch, the data stack: once the arguments are good
    from vatra.meta.adapt import accuracy_curve, load_init, model_spec
    from vatra.models import build_model

    init = load_init(run)
    with tempfile.TemporaryDirectory(prefix="vatra-adapt-") as tmp:
        task = _read_task(cfg, data, run, Path(tmp))
        model = build_model(cfg.model, model_spec(init, task.spec), {})
        loss = build_loss(cfg.train, task.spec)
        points = accuracy_curve(
            model, loss, init, task.x, task.y, ks, repeats=repeats, steps=steps, lr=lr, seed=cfg.run.seed
        )
        print(
            f"vatra: {len(task.y)} rows of {data}; accuracy on the rows not drawn, over {repeats} draws per K"
        )
        print(f"  K = 0 (the initialisation, not adapted): {points[0].before:.3f}")
        for p in points:
            print(f"  K = {p.shots:>3} per class: {p.accuracy:.3f} ± {p.accuracy_std:.3f}")
        if out is not None:
            rows: list[dict[str, Any]] = [vars(p) for p in points]
            out.write_text(json.dumps({"data": data, "curve": rows}, indent=2) + "\n")
        if save is not None:
            from vatra.cli.meta_save import save_adapted

            k = max(ks)
            folder, done = save_adapted(
                run,
                task,
                init,
                model,
                loss,
                shots=k,
                steps=steps,
                lr=lr,
                seed=cfg.run.seed,
                save=save,
                fmt=fmt,
            )
            print(
                f"vatra: adapted on {len(done.support)} rows (K = {k} per class, the curve's first draw; "
                f"accuracy {done.accuracy:.3f} on the other {done.scored}); {fmt} model folder: {folder}"
            )


def _read_task(cfg: Any, data: str, run: Path, tmp: Path) -> Any:
    """The new data's rows (training split, then validation split), read with the run's data options
    through a stand-in run folder (the run's own is never written to)."""
    from vatra.cli.meta_save import NewTask, stand_in
    from vatra.federated.data import load_source, source_config
    from vatra.meta.tasks import rows_of

    folder = stand_in(run, tmp)
    train, val, spec = load_source(cfg, data, "--data", folder)
    parts = [rows_of(d) for d in (train, val) if d is not None]
    x = _cat([p[0] for p in parts])
    y = _concat([p[1] for p in parts])
    return NewTask(source_config(cfg, data, "--data"), x, y, spec, folder)


def _shots(text: str) -> list[int]:
    try:
        ks = [int(k) for k in text.split(",") if k.strip()]
    except ValueError:
        ks = []
    if not ks or min(ks) < 1:
        raise ConfigError(f"--shots {text!r}: give positive whole numbers separated by commas, e.g. 1,5,10")
    return ks


def _cat(parts: list[Any]) -> Any:
    import torch

    return torch.cat(parts)


def _concat(parts: list[Any]) -> Any:
    import numpy as np

    return np.concatenate(parts)
