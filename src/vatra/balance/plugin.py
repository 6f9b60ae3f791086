"""The balancer plugin: measures each rank's compute, and resizes the per-rank batches between steps.

Measured per rank and step: the *busy* time, from the first forward pass of the step to the moment
the last gradient is accumulated (:class:`ComputeClock`), which is what the rank's hardware spends
on its batch. The wait for the slowest rank comes after it, in DDP's final all-reduce, and is not
counted. Utilisation is busy time over the step's wall time (communication and the optimizer count
as not busy); the compute balance is the mean busy time over the slowest rank's (what a split can
change: 1 when no rank waits for another's compute).

Every ``balance.every`` steps the ranks exchange what the window measured (one all-reduce of a
W × 3 table: samples, busy seconds, wall seconds per rank), and rank 0's decision is broadcast
(``proportional``'s arithmetic is the same on every rank; a policy network's need not be):

1. each rank's time model ``fixed + per_sample · batch`` is fitted to its recent windows
   (:func:`~vatra.balance.split.fit_time_model`);
2. the split that equalises the predicted times (:func:`~vatra.balance.split.equal_time_split`),
   blended with the current one by ``smoothing``, and no rank's batch moved by more than
   ``max_change`` of itself;
3. it is adopted only when the compute it saves on the slowest rank is at least ``hysteresis`` of
   the measured step (no flapping on a steady cluster, and no reshuffling of microseconds where the
   step is mostly communication and overhead).

Rank 0 records each decision as a ``balance`` event. ``static`` keeps the configured split and only
measures; ``ppo`` takes its proposal from a learned policy (:mod:`vatra.balance.ppo`).
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Any

import torch

from vatra.balance.split import (
    HISTORY,
    TimeModel,
    change_bounds,
    equal_time_split,
    fit_time_model,
    predicted_step,
    proportional_split,
)
from vatra.config import BalanceConfig
from vatra.data import GlobalBatchSampler
from vatra.engine import Plugin

if TYPE_CHECKING:
    from vatra.engine import Trainer


class ComputeClock:
    """Busy seconds of one training step: each micro-batch from its forward pass to the gradient of
    the module's first parameter, which backward computes last (the monitor's compute clock marks
    the same moment), summed. Active between :meth:`start` and :meth:`stop` only, so evaluation is
    not counted; two hooks, none per parameter."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.active = False
        self.busy = 0.0
        self.begin: float | None = None
        self.last: float | None = None
        self.handles: list[Any] = [module.register_forward_pre_hook(self._forward)]
        first = next((p for p in module.parameters() if p.requires_grad), None)
        if first is not None:
            self.handles.append(first.register_hook(self._grad))

    def _close_micro(self) -> None:
        if self.begin is not None and self.last is not None and self.last > self.begin:
            self.busy += self.last - self.begin
        self.begin = self.last = None

    def _forward(self, module: torch.nn.Module, args: Any) -> None:
        if self.active:
            self._close_micro()
            self.begin = time.perf_counter()

    def _grad(self, grad: torch.Tensor) -> None:
        if self.active:
            self.last = time.perf_counter()

    def start(self) -> None:
        self.active, self.busy, self.begin, self.last = True, 0.0, None, None

    def stop(self) -> float:
        """The step's busy seconds."""
        self._close_micro()
        self.active = False
        return self.busy

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def compute_balance(rows: list[list[float]]) -> float:
    """Mean busy time over the slowest rank's: 1 when every rank computes as long as the slowest
    (none waits for it), 1/W when one rank does all the work. Communication and optimizer time,
    which no split changes, are left out (they are in ``utilisation``)."""
    busy = [row[1] for row in rows]
    return sum(busy) / (len(busy) * max(busy)) if max(busy) > 0 else 1.0


class BalancePolicy:
    """The decision rule of ``proportional`` (and ``static``'s bookkeeping), apart from the training
    loop: fed each window's per-rank measurements, it proposes the next split. Deterministic, so
    every rank, fed the same table, decides the same."""

    def __init__(self, cfg: BalanceConfig, world_size: int) -> None:
        self.cfg = cfg
        self.history: list[deque[tuple[float, float]]] = [deque(maxlen=HISTORY) for _ in range(world_size)]
        self.models: list[TimeModel] = []
        self.busy: list[float] = []  # the last window's busy seconds per step, per rank
        self.caps: list[int] | None = None  # largest batch per rank (memory), when known

    def observe(self, rows: list[list[float]], steps: int, accum: int) -> None:
        """One window: per rank (samples, busy seconds, wall seconds) over ``steps`` steps."""
        for r, (samples, busy, _) in enumerate(rows):
            self.history[r].append((samples / (steps * accum), busy / steps))
        self.busy = [busy / steps for _, busy, _ in rows]
        self.models = [fit_time_model([b for b, _ in h], [t for _, t in h]) for h in self.history]

    def decide(self, current: list[int], step_s: float | None = None) -> tuple[list[int], bool, float, float]:
        """(the next split, whether it changed, predicted busy s of the slowest rank now, and after).

        A new split is taken only when it saves at least ``hysteresis`` of the measured step
        (``step_s``; default the slowest rank's busy time): where the step is mostly communication
        and overhead, a split that only reshuffles microseconds of compute is not worth a change.
        """
        models = self.models
        proposed = current if self.cfg.method == "static" else self._propose(current)
        before, after = predicted_step(models, current), predicted_step(models, proposed)
        step = max(step_s or 0.0, before)
        changed = proposed != current and before - after >= self.cfg.hysteresis * step
        return (proposed if changed else current), changed, before, after

    def _propose(self, current: list[int]) -> list[int]:
        """The equal-time split, smoothed towards ``current`` and within ``max_change`` of it."""
        cfg, total = self.cfg, sum(current)
        caps = self.caps or [total] * len(current)
        target = equal_time_split(total, self.models, lo=cfg.min_batch, hi=caps)
        blended = [
            cfg.smoothing * c + (1.0 - cfg.smoothing) * t for c, t in zip(current, target, strict=True)
        ]
        lo, hi = change_bounds(current, caps, cfg.max_change, cfg.min_batch)
        return proportional_split(total, blended, lo=lo, hi=hi)


class Balancer(Plugin):
    """Measures busy time and utilisation per rank; with ``proportional`` resizes the split."""

    def __init__(self, cfg: BalanceConfig) -> None:
        self.cfg = cfg
        self.clock: ComputeClock | None = None
        self.sampler: GlobalBatchSampler | None = None
        self.policy: BalancePolicy | None = None
        self.busy = 0.0
        self.window = [0.0, 0.0, 0.0]  # this rank's samples, busy s, wall s since the last decision

    @classmethod
    def wanted(cls, cfg: BalanceConfig) -> bool:
        return cfg.method != "off"

    def on_fit_start(self, trainer: Trainer) -> None:
        sampler = trainer.sampler
        if not isinstance(sampler, GlobalBatchSampler):
            return  # the trainer refused what balancing cannot serve; nothing to size here
        self.sampler = sampler
        self.clock = ComputeClock(trainer.trainable)
        if self.cfg.method == "ppo":
            from vatra.balance.ppo import LearnedPolicy

            self.policy = LearnedPolicy(self.cfg, len(sampler.sizes))
        else:
            self.policy = BalancePolicy(self.cfg, len(sampler.sizes))
        if trainer.dist.is_main:
            trainer.log_event(
                "balance",
                method=self.cfg.method,
                sizes=list(sampler.sizes),
                global_batch=sampler.global_batch,
            )

    def on_step_start(self, trainer: Trainer) -> None:
        if self.clock is not None:
            self.clock.start()

    def after_backward(self, trainer: Trainer) -> None:
        if self.clock is not None:
            self.busy = self.clock.stop()

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        if self.sampler is None:
            return
        batch = self.sampler.batch_size
        wall = float(metrics["step_time_s"])
        metrics["batch_size"] = batch
        metrics["busy_time_s"] = self.busy
        metrics["utilisation"] = min(self.busy / wall, 1.0) if wall > 0 else 0.0
        w = self.window
        w[0] += batch * trainer.cfg.train.grad_accum
        w[1] += self.busy
        w[2] += wall
        if trainer.state.step % self.cfg.every == 0:
            self._decide(trainer, self.cfg.every, metrics)

    def _decide(self, trainer: Trainer, steps: int, metrics: dict[str, Any]) -> None:
        assert self.sampler is not None and self.policy is not None
        ctx, sampler = trainer.dist, self.sampler
        table = torch.zeros(ctx.world_size, 3, dtype=torch.float64)
        table[ctx.rank] = torch.tensor(self.window, dtype=torch.float64)
        rows = ctx.all_reduce_sum(table).tolist()
        self.window = [0.0, 0.0, 0.0]
        current = list(sampler.sizes)
        self.policy.observe(rows, steps, trainer.cfg.train.grad_accum)
        step_s = max(row[2] for row in rows) / steps
        decided = self.policy.decide(current, step_s)
        # Rank 0's decision for all: a policy network need not give bit-equal outputs on every rank.
        shared: tuple[list[int], bool, float, float] = ctx.broadcast_object(decided)  # type: ignore[assignment]
        sizes, changed, before, after = shared
        sampler.resize(sizes)
        utilisation = [row[1] / row[2] if row[2] > 0 else 0.0 for row in rows]
        metrics["rank_batch_size"] = current  # what the window ran (the report draws it per rank)
        metrics["rank_utilisation"] = utilisation
        if ctx.is_main:
            trainer.log_event(
                "balance",
                sizes=sizes,
                previous=current,
                changed=changed,
                predicted_step_s=[before, after],
                step_s=step_s,
                samples_per_s=[row[0] / row[1] if row[1] > 0 else 0.0 for row in rows],
                utilisation=utilisation,
                mean_utilisation=sum(utilisation) / len(utilisation),
                compute_balance=compute_balance(rows),
            )

    def _remove(self) -> None:
        if self.clock is not None:
            self.clock.remove()
            self.clock = None

    def on_fit_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        if self.sampler is not None:
            summary["balance_sizes"] = list(self.sampler.sizes)
        self._remove()

    def on_failure(self, trainer: Trainer, exc: BaseException) -> None:
        self._remove()
