"""The ``[edge]`` training plugin: fake quantization from ``edge.qat_start_step``, pruning on its schedule."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from vatra.compress.prune import magnitude_masks
from vatra.compress.qat import is_prepared, prepare_qat
from vatra.config import EdgeConfig
from vatra.engine import Plugin

if TYPE_CHECKING:
    from vatra.engine import Trainer


def scheduled_sparsity(cfg: EdgeConfig, step: int, total_steps: int) -> float:
    """The sparsity due at optimizer step ``step``: 0 before prune_start_step; then all of it
    (oneshot) or s·(1 − (1 − t)³) with t the share of [start, end] passed (gradual)."""
    if cfg.prune == "none" or step < cfg.prune_start_step:
        return 0.0
    if cfg.prune_schedule == "oneshot":
        return cfg.sparsity
    end = cfg.prune_end_step or max(cfg.prune_start_step + 1, (3 * total_steps) // 4)
    t = min(1.0, (step - cfg.prune_start_step) / (end - cfg.prune_start_step))
    return cfg.sparsity * (1.0 - (1.0 - t) ** 3)


class EdgeTraining(Plugin):
    """QAT and pruning during training, the same on every rank (each rank holds the same replica
    under DDP, so each computes the same masks from the same weights: no collective needed)."""

    def __init__(self, cfg: EdgeConfig, total_steps: int) -> None:
        self.cfg = cfg
        self.total_steps = total_steps
        self.masks: dict[nn.Parameter, torch.Tensor] = {}
        self.sparsity = 0.0

    def on_step_start(self, trainer: Trainer) -> None:
        step = trainer.state.step  # steps done so far: a resumed run picks up where it was
        if self.cfg.qat != "none" and step >= self.cfg.qat_start_step and not is_prepared(trainer.model):
            n = prepare_qat(trainer.model)
            trainer.log_event("qat_prepared", layers=n, qat=self.cfg.qat)
        due = scheduled_sparsity(self.cfg, step, self.total_steps)
        if due > self.sparsity and self._reprune_now(step):
            self.masks = magnitude_masks(trainer.model, due)
            self.sparsity = due
            self._apply()

    def _reprune_now(self, step: int) -> bool:
        return (
            self.cfg.prune_schedule == "oneshot"
            or not self.masks
            or (step - self.cfg.prune_start_step) % self.cfg.prune_every == 0
            or step >= (self.cfg.prune_end_step or (3 * self.total_steps) // 4)
        )

    def after_update(self, trainer: Trainer) -> None:
        self._apply()  # the optimizer moved the cut weights: back to zero

    def _apply(self) -> None:
        with torch.no_grad():
            for param, mask in self.masks.items():
                param.mul_(mask)

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        if self.cfg.prune != "none":
            metrics["sparsity"] = self.sparsity

    def on_fit_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        summary["edge"] = {"qat": self.cfg.qat, "prune": self.cfg.prune, "sparsity": self.sparsity}
