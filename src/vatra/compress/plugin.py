"""The ``[edge]`` training plugin: fake quantization from ``edge.qat_start_step``, pruning on its schedule."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from vatra.compress.prune import magnitude_masks, structured_masks
from vatra.compress.qat import is_prepared, prepare_qat
from vatra.compress.qat4 import convert_int4w, is_int4w_prepared, prepare_int4w
from vatra.config import EdgeConfig
from vatra.data import BatchedDataset
from vatra.engine import Plugin
from vatra.engine.objective import call_model

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
        if self.cfg.qat != "none" and step >= self.cfg.qat_start_step and not self._prepared(trainer.model):
            # int4w swaps the Linear modules for torchao's, holding the same Parameters: DDP's
            # reducer and the optimizer keep working on them
            n = prepare_int4w(trainer.model) if self.cfg.qat == "int4w" else prepare_qat(trainer.model)
            trainer.log_event("qat_prepared", layers=n, qat=self.cfg.qat)
        due = scheduled_sparsity(self.cfg, step, self.total_steps)
        if due > self.sparsity and self._reprune_now(step):
            cut = structured_masks if self.cfg.prune == "structured" else magnitude_masks
            self.masks = cut(trainer.model, due)
            self.sparsity = due
            self._apply()

    def _prepared(self, model: nn.Module) -> bool:
        return is_int4w_prepared(model) if self.cfg.qat == "int4w" else is_prepared(model)

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
        if self.cfg.qat == "int4w" and is_int4w_prepared(trainer.model):
            summary["edge"]["converted"] = self._convert(trainer)

    def _convert(self, trainer: Trainer) -> dict[str, Any]:
        """QAT's convert step on a copy of the trained model (the checkpoint keeps the float weights,
        which ``vatra edge export --quant int4w`` converts the same way): how many layers, and the
        converted model's largest output difference from the fake-quantized one on validation rows."""
        converted = convert_int4w(copy.deepcopy(trainer.model)).eval()
        layers = sum(1 for m in converted.modules() if "Intx" in type(getattr(m, "weight", None)).__name__)
        out: dict[str, Any] = {"layers": layers, "max_abs_diff_vs_fake_quant": None}
        val = trainer.val_data
        if isinstance(val, BatchedDataset) and len(val) > 0:
            inputs, _ = val.get_batch(np.arange(min(len(val), 256)))
            was_training = trainer.model.training
            trainer.model.eval()
            with torch.no_grad():
                want, got = call_model(trainer.model, inputs), call_model(converted, inputs)
            trainer.model.train(was_training)
            if isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor):
                out["max_abs_diff_vs_fake_quant"] = float((want - got).abs().max())
        trainer.log_event("qat_converted", qat="int4w", **out)
        return out
