"""Rank 0's progress: a rich bar on a terminal, plain log lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from vatra.engine import Plugin
from vatra.losses import main_metric
from vatra.monitor.narrate import describe

if TYPE_CHECKING:
    from vatra.engine import Trainer


def headline(metrics: dict[str, Any]) -> tuple[str, float] | None:
    """The one validation figure to show for the task (its main metric: accuracy, NDCG, R²,
    perplexity, else the loss)."""
    scored = [
        k.removeprefix("val_")
        for k, v in metrics.items()
        if k.startswith("val_") and isinstance(v, int | float)
    ]
    name = main_metric(scored)
    return (name, float(metrics[f"val_{name}"])) if name is not None else None


def _fmt_eta(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class ProgressDisplay(Plugin):
    """``mode``: rich | plain | off | auto (rich when stdout is a terminal)."""

    def __init__(self, mode: str = "auto", log_every: int = 10) -> None:
        if mode == "auto":
            mode = "rich" if sys.stdout.isatty() else "plain"
        self.mode = mode
        self.log_every = log_every
        self.bar: Progress | None = None
        self.task: Any = None
        self.t0 = 0.0

    def on_fit_start(self, trainer: Trainer) -> None:
        if not trainer.dist.is_main or self.mode == "off":
            return
        self.t0 = time.perf_counter()
        total = trainer.cfg.train.steps
        if self.mode == "rich":
            self.bar = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn(
                    "loss {task.fields[loss]:.4f}  {task.fields[sps]:,.0f} samples/s  {task.fields[val]}"
                ),
                TimeRemainingColumn(),
                transient=False,
            )
            self.bar.start()
            self.task = self.bar.add_task(
                "train", total=total, completed=trainer.state.step, loss=0.0, sps=0.0, val=""
            )
        else:
            ranks = trainer.dist.world_size
            who = f"{ranks} rank(s)" if trainer.dist.collective else f"{ranks} async worker(s), each"
            print(f"vatra: training {total} steps on {who}", flush=True)

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        if not trainer.dist.is_main or self.mode == "off":
            return
        step, total = metrics["step"], trainer.cfg.train.steps
        shown = headline(metrics)
        val = f"val_{shown[0]} {shown[1]:.3f}" if shown else None
        if self.bar is not None:
            fields: dict[str, Any] = {"loss": metrics["loss"], "sps": metrics["samples_per_s"]}
            if val:
                fields["val"] = val
            self.bar.update(self.task, completed=step, **fields)
        elif step % self.log_every == 0 or step == total or val:
            elapsed = time.perf_counter() - self.t0
            eta = elapsed / step * (total - step) if step else 0.0
            line = (
                f"step {step}/{total} loss {metrics['loss']:.4f} lr {metrics['lr']:.2e} "
                f"samples/s {metrics['samples_per_s']:.0f} eta {_fmt_eta(eta)}"
            )
            print(line + (f" {val}" if val else ""), flush=True)

    def on_event(self, trainer: Trainer, kind: str, fields: dict[str, Any]) -> None:
        """A resume, a recovery, a rollback or a skipped step: one line as it happens (rank 0)."""
        if not trainer.dist.is_main or self.mode == "off":
            return
        line = describe(kind, fields)
        if line is None:
            return
        if self.bar is not None:  # above the bar, which stays at the bottom
            self.bar.console.print(f"vatra: {line}", markup=False, highlight=False)
        else:
            print(f"vatra: {line}", flush=True)

    def _stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None

    def on_fit_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        self._stop()
        if trainer.dist.is_main and self.mode != "off":
            shown = headline(summary)
            val = f"val {shown[0]} {shown[1]:.4f}" if shown else "no validation"
            print(
                f"done: {summary['steps']} steps, final loss {summary['final_loss']:.4f}, "
                f"{val}, {summary['samples_per_s']:.0f} samples/s, {summary['wall_s']:.1f} s",
                flush=True,
            )

    def on_failure(self, trainer: Trainer, exc: BaseException) -> None:
        self._stop()
