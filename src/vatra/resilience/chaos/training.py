"""Training faults on purpose (the ``chaos`` section): NaN loss, gradient and LR spikes, a slow rank."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from vatra.config import ChaosConfig
from vatra.engine import Plugin
from vatra.errors import ConfigError

if TYPE_CHECKING:
    from vatra.data import Batch
    from vatra.engine import Trainer


class TrainingFaults(Plugin):
    """Injects the training faults of ``chaos``; placed first so every other plugin sees them.

    The step-keyed faults are faults of the data: a fault "at step s" is in the batches an
    undisturbed run trains on at step s (its data step), as a real bad batch is. Real loss spikes
    come from particular batches meeting a particular model state (PaLM, §5.1), and a fault keyed
    to the step number would meet every replay of that number again, which no rollback can heal
    (it stands for a broken schedule, not for bad data). So after a rollback, whose sampler keeps
    its position, the replayed step numbers train on new data and do not meet the fault again,
    while a resume from a checkpoint, which replays the data, does. The plugin counts the batches
    the trainer draws (it wraps ``trainer.next_batch``; healing draws through it to skip data): a
    step's data step is 1 + the batches drawn before it // ``train.grad_accum``. A resumed process
    starts counting at the restored step. Faults act through hooks, so the engine is untouched:

    - ``inject_nan_at``: a forward hook makes the model's output NaN, so the loss and every
      gradient are NaN (on every rank).
    - ``grad_spike_at``: parameter hooks multiply every gradient by ``grad_spike_factor`` before
      DDP averages them (on every rank).
    - ``lr_spike_at``: the LR of the steps on the data of steps s … s + ``lr_spike_steps`` − 1 is
      multiplied by ``lr_spike_factor``; the scheduler sets the planned LR again after each step.
    - ``slow_rank``: that rank sleeps ``slow_rank_s`` in the forward pass of every step.
    - ``oom_batch``: a training forward pass of more than ``oom_batch[r]`` samples on rank r
      raises ``torch.OutOfMemoryError`` (device memory for that many, on a machine without it).
    - ``gpu_memory_gb``: rank r's CUDA allocator holds at most that many GB (a real limit: its
      allocations beyond it raise ``torch.OutOfMemoryError``); GPU only.
    - ``speed_factors``: rank r's every training forward pass is followed by a sleep of
      (factor − 1) × 3 × that pass's time (backward costs about twice the forward), so the rank
      computes about ``factor`` times slower, in proportion to its batch, as slower hardware does.

    Each ``chaos`` event carries ``at_step`` (the step that met the fault) and ``data_step``.
    """

    def __init__(self, cfg: ChaosConfig) -> None:
        self.cfg = cfg
        self.nan = self.spike = self.slow = False  # what the running step does
        n = cfg.lr_spike_steps
        self.lr_spike_steps = {s + i for s in cfg.lr_spike_at for i in range(n)}
        self.drawn: int | None = None  # batches drawn by the trainer (set at the first step)
        self.handles: list[Any] = []
        self.trainer: Trainer | None = None  # whose next_batch is wrapped
        self.factor = 1.0  # this rank's chaos.speed_factors entry
        self.in_step = False  # between on_step_start and after_backward: training forward passes
        self.forward_t0 = 0.0
        self.oom_limit = 0  # this rank's chaos.oom_batch entry
        self.step_drawn = 0  # batches drawn before this step (a redone step draws them again)

    @classmethod
    def wanted(cls, cfg: ChaosConfig) -> bool:
        return bool(
            cfg.inject_nan_at
            or cfg.grad_spike_at
            or cfg.lr_spike_at
            or cfg.slow_rank is not None
            or cfg.speed_factors
            or cfg.oom_batch
            or cfg.gpu_memory_gb
        )

    def on_fit_start(self, trainer: Trainer) -> None:
        model = trainer.model
        try:  # the per-rank lists name every rank
            self.cfg.check_world_size(trainer.dist.world_size)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if self.cfg.inject_nan_at:
            self.handles.append(model.register_forward_hook(self._nan_hook))
        if self.cfg.slow_rank is not None and self.cfg.slow_rank == trainer.dist.rank:
            self.handles.append(model.register_forward_pre_hook(self._slow_hook))
            trainer.log_event(
                "chaos", fault="slow_rank", slow_rank=self.cfg.slow_rank, sleep_s=self.cfg.slow_rank_s
            )
        factors = self.cfg.speed_factors
        if factors:
            self.factor = factors[trainer.dist.rank]
            if self.factor > 1.0:
                self.handles.append(model.register_forward_pre_hook(self._clock_hook))
                self.handles.append(model.register_forward_hook(self._slower_hook))
            if trainer.dist.is_main:
                trainer.log_event("chaos", fault="speed_factors", speed_factors=list(factors))
        if self.cfg.gpu_memory_gb:
            self._limit_gpu_memory(trainer)
        if self.cfg.oom_batch:
            self.oom_limit = self.cfg.oom_batch[trainer.dist.rank]
            if self.oom_limit:
                self.handles.append(model.register_forward_pre_hook(self._oom_hook, with_kwargs=True))
        if self.cfg.grad_spike_at:
            factor = self.cfg.grad_spike_factor
            for p in model.parameters():
                if p.requires_grad:
                    self.handles.append(p.register_hook(lambda g: g * factor if self.spike else g))
        draw = trainer.next_batch

        def counted() -> Batch:
            self.drawn = (self.drawn or 0) + 1
            return draw()

        trainer.next_batch = counted  # type: ignore[method-assign]  # an instance attribute, removed at the end
        self.trainer = trainer

    def on_step_start(self, trainer: Trainer) -> None:
        accum = trainer.cfg.train.grad_accum
        if self.drawn is None:  # the first step of this process: at the restored step if resumed
            self.drawn = trainer.state.step * accum
        self.step_drawn = self.drawn
        data_step = self.drawn // accum + 1
        self.nan = data_step in self.cfg.inject_nan_at
        self.spike = data_step in self.cfg.grad_spike_at
        self.slow = self.in_step = True
        if data_step in self.lr_spike_steps:
            for group in trainer.optimizer.param_groups:
                group["lr"] *= self.cfg.lr_spike_factor
        if trainer.dist.is_main:
            where = {"at_step": trainer.state.step + 1, "data_step": data_step}
            for fault, active in (("nan", self.nan), ("grad_spike", self.spike)):
                if active:
                    trainer.log_event("chaos", fault=fault, **where)
            if data_step in self.cfg.lr_spike_at:
                trainer.log_event(
                    "chaos",
                    fault="lr_spike",
                    **where,
                    factor=self.cfg.lr_spike_factor,
                    steps=self.cfg.lr_spike_steps,
                )

    def after_backward(self, trainer: Trainer) -> None:
        self.nan = self.spike = self.slow = self.in_step = False  # evaluation's forward passes stay clean

    def _limit_gpu_memory(self, trainer: Trainer) -> None:
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

    def on_oom(self, trainer: Trainer, ranks: list[int]) -> None:
        self.drawn = self.step_drawn  # the redone step is the same data step

    def _oom_hook(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        if not self.in_step:
            return
        first = next(
            (t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.dim() > 0), None
        )
        if first is not None and first.shape[0] > self.oom_limit:
            raise torch.OutOfMemoryError(
                f"chaos.oom_batch: this rank has memory for {self.oom_limit} samples, not {first.shape[0]}"
            )

    def _nan_hook(self, module: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor | None:
        return output * float("nan") if self.nan else None

    def _slow_hook(self, module: torch.nn.Module, args: Any) -> None:
        if self.slow:
            self.slow = False  # once per step, however many micro-batches
            time.sleep(self.cfg.slow_rank_s)

    def _clock_hook(self, module: torch.nn.Module, args: Any) -> None:
        self.forward_t0 = time.perf_counter()

    def _slower_hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.in_step:
            time.sleep((self.factor - 1.0) * 3.0 * (time.perf_counter() - self.forward_t0))

    def _remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        if self.trainer is not None:
            del self.trainer.next_batch  # the class's method again
            self.trainer = None

    def on_fit_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        self._remove()

    def on_failure(self, trainer: Trainer, exc: BaseException) -> None:
        self._remove()
