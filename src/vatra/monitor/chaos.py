"""Training faults on purpose (the ``chaos`` section): NaN loss, gradient and LR spikes, a slow rank."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from vatra.config import ChaosConfig
from vatra.engine import Plugin

if TYPE_CHECKING:
    from vatra.engine import Trainer


class TrainingFaults(Plugin):
    """Injects the training faults of ``chaos``; placed first so every other plugin sees them.

    Each step-keyed fault fires once per step number: after a rollback re-runs step s, a fault at
    s does not fire again (a fault is an event in time, not a property of the step). The step of a
    fault is the number the step's metrics carry (``state.step + 1`` while it runs). Faults act
    through hooks, so the engine itself is untouched:

    - ``inject_nan_at``: a forward hook makes the model's output NaN, so the loss and every
      gradient are NaN (on every rank).
    - ``grad_spike_at``: parameter hooks multiply every gradient by ``grad_spike_factor`` before
      DDP averages them (on every rank).
    - ``lr_spike_at``: the LR of steps s … s + ``lr_spike_steps`` − 1 is multiplied by
      ``lr_spike_factor`` (each step once); the scheduler sets the planned LR again after each step.
    - ``slow_rank``: that rank sleeps ``slow_rank_s`` in the forward pass of every step.
    """

    def __init__(self, cfg: ChaosConfig) -> None:
        self.cfg = cfg
        self.fired: set[tuple[str, int]] = set()
        self.nan = self.spike = self.slow = False  # what the running step does
        n = cfg.lr_spike_steps
        self.lr_spike_steps = sorted({s + i for s in cfg.lr_spike_at for i in range(n)})
        self.handles: list[Any] = []

    @classmethod
    def wanted(cls, cfg: ChaosConfig) -> bool:
        return bool(cfg.inject_nan_at or cfg.grad_spike_at or cfg.lr_spike_at or cfg.slow_rank is not None)

    def on_fit_start(self, trainer: Trainer) -> None:
        model = trainer.model
        if self.cfg.inject_nan_at:
            self.handles.append(model.register_forward_hook(self._nan_hook))
        if self.cfg.slow_rank is not None and self.cfg.slow_rank == trainer.dist.rank:
            self.handles.append(model.register_forward_pre_hook(self._slow_hook))
            trainer.log_event(
                "chaos", fault="slow_rank", slow_rank=self.cfg.slow_rank, sleep_s=self.cfg.slow_rank_s
            )
        if self.cfg.grad_spike_at:
            factor = self.cfg.grad_spike_factor
            for p in model.parameters():
                if p.requires_grad:
                    self.handles.append(p.register_hook(lambda g: g * factor if self.spike else g))

    def _once(self, fault: str, step: int, steps: list[int]) -> bool:
        if step in steps and (fault, step) not in self.fired:
            self.fired.add((fault, step))
            return True
        return False

    def on_step_start(self, trainer: Trainer) -> None:
        step = trainer.state.step + 1
        self.nan = self._once("nan", step, self.cfg.inject_nan_at)
        self.spike = self._once("grad_spike", step, self.cfg.grad_spike_at)
        self.slow = True
        lr_spike_starts = step in self.cfg.lr_spike_at and ("lr_spike", step) not in self.fired
        if self._once("lr_spike", step, self.lr_spike_steps):
            for group in trainer.optimizer.param_groups:
                group["lr"] *= self.cfg.lr_spike_factor
        if trainer.dist.is_main:
            for fault, active in (("nan", self.nan), ("grad_spike", self.spike)):
                if active:
                    trainer.log_event("chaos", fault=fault, at_step=step)
            if lr_spike_starts:
                trainer.log_event(
                    "chaos",
                    fault="lr_spike",
                    at_step=step,
                    factor=self.cfg.lr_spike_factor,
                    steps=self.cfg.lr_spike_steps,
                )

    def after_backward(self, trainer: Trainer) -> None:
        self.nan = self.spike = self.slow = False  # evaluation's forward passes stay clean

    def _nan_hook(self, module: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor | None:
        return output * float("nan") if self.nan else None

    def _slow_hook(self, module: torch.nn.Module, args: Any) -> None:
        if self.slow:
            self.slow = False  # once per step, however many micro-batches
            time.sleep(self.cfg.slow_rank_s)

    def _remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def on_fit_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        self._remove()

    def on_failure(self, trainer: Trainer, exc: BaseException) -> None:
        self._remove()
