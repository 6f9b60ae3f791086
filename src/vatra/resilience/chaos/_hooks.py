"""The training faults of ``chaos``, one hook each: what it installs on the model at fit start and
what it does at the start and the end (after backward) of each training step.

:class:`~vatra.resilience.chaos.training.TrainingFaults` runs them, in this module's order (which
is also the order of their events and of their model hooks), and tells each step its *data step*.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from vatra.config import ChaosConfig
from vatra.errors import ConfigError

if TYPE_CHECKING:
    from vatra.engine import Trainer


class FaultHook:
    """One fault. Call order: ``wanted(cfg)``; ``install`` once at fit start (returns the hook
    handles to remove at the end); then per step ``begin`` (before the forward passes) and ``end``
    (after backward: evaluation's forward passes stay clean)."""

    def __init__(self, cfg: ChaosConfig) -> None:
        self.cfg = cfg
        self.in_step = False  # between begin and end: training forward passes

    @classmethod
    def wanted(cls, cfg: ChaosConfig) -> bool:
        raise NotImplementedError

    def install(self, trainer: Trainer) -> list[Any]:
        return []

    def begin(self, trainer: Trainer, data_step: int, where: dict[str, int]) -> None:
        self.in_step = True

    def end(self) -> None:
        self.in_step = False


class NanOutput(FaultHook):
    """``inject_nan_at``: a forward hook makes the model's output NaN, so the loss and every
    gradient are NaN (on every rank)."""

    active = False

    @classmethod
    def wanted(cls, cfg: ChaosConfig) -> bool:
        return bool(cfg.inject_nan_at)

    def install(self, trainer: Trainer) -> list[Any]:
        return [trainer.model.register_forward_hook(self._hook)]

    def begin(self, trainer: Trainer, data_step: int, where: dict[str, int]) -> None:
        super().begin(trainer, data_step, where)
        self.active = data_step in self.cfg.inject_nan_at
        if self.active and trainer.dist.is_main:
            trainer.log_event("chaos", fault="nan", **where)

    def end(self) -> None:
        super().end()
        self.active = False

    def _hook(self, module: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor | None:
        return output * float("nan") if self.active else None


class SlowRank(FaultHook):
    """``slow_rank``: that rank sleeps ``slow_rank_s`` in the forward pass of every step."""

    slow = False

    @classmethod
    def wanted(cls, cfg: ChaosConfig) -> bool:
        return cfg.slow_rank is not None

    def install(self, trainer: Trainer) -> list[Any]:
        if self.cfg.slow_rank != trainer.dist.rank:
            return []
        trainer.log_event(
            "chaos", fault="slow_rank", slow_rank=self.cfg.slow_rank, sleep_s=self.cfg.slow_rank_s
        )
        return [trainer.model.register_forward_pre_hook(self._hook)]

    def begin(self, trainer: Trainer, data_step: int, where: dict[str, int]) -> None:
        super().begin(trainer, data_step, where)
        self.slow = True

    def end(self) -> None:
        super().end()
        self.slow = False

    def _hook(self, module: torch.nn.Module, args: Any) -> None:
        if self.slow:
            self.slow = False  # once per step, however many micro-batches
            time.sleep(self.cfg.slow_rank_s)


class SpeedFactors(FaultHook):
    """``speed_factors``: rank r's every training forward pass is followed by a sleep of
    (factor − 1) × 3 × that pass's time (backward costs about twice the forward), so the rank
    computes about ``factor`` times slower, in proportion to its batch, as slower hardware does."""

    factor = 1.0  # this rank's entry
    forward_t0 = 0.0

    @classmethod
    def wanted(cls, cfg: ChaosConfig) -> bool:
        return bool(cfg.speed_factors)

    def install(self, trainer: Trainer) -> list[Any]:
        factors = self.cfg.speed_factors
        self.factor = factors[trainer.dist.rank]
        handles = []
        if self.factor > 1.0:
            handles.append(trainer.model.register_forward_pre_hook(self._clock_hook))
            handles.append(trainer.model.register_forward_hook(self._slower_hook))
        if trainer.dist.is_main:
            trainer.log_event("chaos", fault="speed_factors", speed_factors=list(factors))
        return handles

    def _clock_hook(self, module: torch.nn.Module, args: Any) -> None:
        self.forward_t0 = time.perf_counter()

    def _slower_hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.in_step:
            time.sleep((self.factor - 1.0) * 3.0 * (time.perf_counter() - self.forward_t0))


class GpuMemory(FaultHook):
    """``gpu_memory_gb``: rank r's CUDA allocator holds at most that many GB (a real limit: its
    allocations beyond it raise ``torch.OutOfMemoryError``); GPU only."""

    @classmethod
    def wanted(cls, cfg: ChaosConfig) -> bool:
        return bool(cfg.gpu_memory_gb)

    def install(self, trainer: Trainer) -> list[Any]:
        device = trainer.dist.device
        if device.type != "cuda":
            raise ConfigError(
                "chaos.gpu_memory_gb limits a GPU's memory, but this rank trains on the CPU; emulate the "
                "limit with chaos.oom_batch (samples per rank) instead"
            )
        gb = self.cfg.gpu_memory_gb[trainer.dist.rank]
        if gb:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, gb * 1e9 / total), device)
            trainer.log_event("chaos", fault="gpu_memory_gb", limit_gb=gb)
        return []


class OomBatch(FaultHook):
    """``oom_batch``: a training forward pass of more than ``oom_batch[r]`` samples on rank r raises
    ``torch.OutOfMemoryError`` (device memory for that many, on a machine without it)."""

    limit = 0  # this rank's entry

    @classmethod
    def wanted(cls, cfg: ChaosConfig) -> bool:
        return bool(cfg.oom_batch)

    def install(self, trainer: Trainer) -> list[Any]:
        self.limit = self.cfg.oom_batch[trainer.dist.rank]
        if not self.limit:
            return []
        return [trainer.model.register_forward_pre_hook(self._hook, with_kwargs=True)]

    def _hook(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        if not self.in_step:
            return
        first = next(
            (t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.dim() > 0), None
        )
        if first is not None and first.shape[0] > self.limit:
            raise torch.OutOfMemoryError(
                f"chaos.oom_batch: this rank has memory for {self.limit} samples, not {first.shape[0]}"
            )


class GradSpike(FaultHook):
    """``grad_spike_at``: parameter hooks multiply every gradient by ``grad_spike_factor`` before
    DDP averages them (on every rank)."""

    active = False

    @classmethod
    def wanted(cls, cfg: ChaosConfig) -> bool:
        return bool(cfg.grad_spike_at)

    def install(self, trainer: Trainer) -> list[Any]:
        factor = self.cfg.grad_spike_factor
        return [
            p.register_hook(lambda g: g * factor if self.active else g)
            for p in trainer.model.parameters()
            if p.requires_grad
        ]

    def begin(self, trainer: Trainer, data_step: int, where: dict[str, int]) -> None:
        super().begin(trainer, data_step, where)
        self.active = data_step in self.cfg.grad_spike_at
        if self.active and trainer.dist.is_main:
            trainer.log_event("chaos", fault="grad_spike", **where)

    def end(self) -> None:
        super().end()
        self.active = False


class LrSpike(FaultHook):
    """``lr_spike_at``: the LR of the steps on the data of steps s … s + ``lr_spike_steps`` − 1 is
    multiplied by ``lr_spike_factor``; the scheduler sets the planned LR again after each step."""

    @classmethod
    def wanted(cls, cfg: ChaosConfig) -> bool:
        return bool(cfg.lr_spike_at)

    def begin(self, trainer: Trainer, data_step: int, where: dict[str, int]) -> None:
        super().begin(trainer, data_step, where)
        cfg = self.cfg
        if any(s <= data_step < s + cfg.lr_spike_steps for s in cfg.lr_spike_at):
            for group in trainer.optimizer.param_groups:
                group["lr"] *= cfg.lr_spike_factor
        if data_step in cfg.lr_spike_at and trainer.dist.is_main:
            trainer.log_event(
                "chaos", fault="lr_spike", **where, factor=cfg.lr_spike_factor, steps=cfg.lr_spike_steps
            )


# In this order: their events and their model hooks keep it.
HOOKS: tuple[type[FaultHook], ...] = (
    NanOutput,
    SlowRank,
    SpeedFactors,
    GpuMemory,
    OomBatch,
    GradSpike,
    LrSpike,
)
