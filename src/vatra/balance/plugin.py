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

Rank 0 records each decision as a ``balance`` event. The policy is the one ``balance.method`` names
(:data:`vatra.balance._base.POLICIES`): ``static`` keeps the configured split and only measures,
``proportional`` is the rule above, ``ppo`` takes its proposal from a learned policy
(:mod:`vatra.balance.ppo`).

With ``balance.adaptive`` the table has a fourth column, each rank's peak memory in the window:
before the split is decided, the global batch is set from the gradient noise scale and the ranks'
memory caps (:mod:`vatra.balance.adaptive`) and the current split rescaled to it; the policy then
divides it as above. The trainer's micro-steps then synchronise the gradients themselves
(:mod:`vatra.balance.guarded`): an out-of-memory rank (``on_oom``) is capped at half its batch, its
share goes to the ranks with room (or the global batch shrinks), and the step is redone.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Any

import torch

from vatra.balance._base import BalancePolicy, build_policy
from vatra.balance.adaptive import (
    NoiseScale,
    PeakMemory,
    goodput_batch,
    lr_multiplier,
    memory_cap,
    next_global_batch,
)
from vatra.balance.guarded import GuardedSteps
from vatra.balance.split import HISTORY, fit_time_model, proportional_split
from vatra.config import BalanceConfig
from vatra.data import GlobalBatchSampler
from vatra.engine import Plugin
from vatra.engine.batches import balance_sizes
from vatra.errors import ConfigError

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


class Balancer(Plugin):
    """Measures busy time and utilisation per rank; with ``proportional`` resizes the split."""

    def __init__(self, cfg: BalanceConfig) -> None:
        self.cfg = cfg
        self.clock: ComputeClock | None = None
        self.sampler: GlobalBatchSampler | None = None
        self.policy: BalancePolicy | None = None
        self.busy = 0.0
        # this rank's samples, busy s, wall s since the last decision (adaptive: and its peak memory,
        # the memory it held before training and its budget, bytes)
        self.window = [0.0] * (6 if cfg.adaptive else 3)
        # adaptive: the noise scale, peak memory per rank and window, caps, the starting global batch
        self.noise = NoiseScale(cfg.noise_smoothing)
        self.memory: PeakMemory | None = None
        self.budget: float | None = None
        self.base_memory = 0.0
        self.memory_rows: list[tuple[float, float]] = []  # per rank: (memory before training, budget)
        self.step_history: deque[tuple[float, float]] = deque(maxlen=HISTORY)  # (global batch, step s)
        self.memory_history: list[deque[tuple[float, float]]] = []
        self.oom_caps: list[int] = []
        self.start_batch = 0
        self.lr_scale = 1.0

    @classmethod
    def wanted(cls, cfg: BalanceConfig) -> bool:
        return cfg.method != "off"

    def micro_steps(self, trainer: Trainer) -> GuardedSteps | None:
        """adaptive: the trainer's micro-steps sync the gradients here, so an OOM rank redoes the step."""
        if self.cfg.adaptive and isinstance(trainer.sampler, GlobalBatchSampler):
            return GuardedSteps(trainer.sampler)
        return None

    def on_fit_start(self, trainer: Trainer) -> None:
        sampler = trainer.sampler
        if not isinstance(sampler, GlobalBatchSampler):
            return  # the trainer refused what balancing cannot serve; nothing to size here
        self.sampler = sampler
        self.clock = ComputeClock(trainer.trainable)
        self.policy = build_policy(self.cfg, len(sampler.sizes))
        world = len(sampler.sizes)
        if self.cfg.adaptive:
            self.memory = PeakMemory(trainer.dist.device)
            self.budget = self.memory.budget(self.cfg.memory_budget_gb)
            self.base_memory = float(self.memory.current())
            self._reset_window()
            self.memory_history = [deque(maxlen=HISTORY) for _ in range(world)]
            self.oom_caps = [sum(sampler.sizes) * 64] * world  # no cap until a rank runs out of memory
            self.start_batch = sum(balance_sizes(self.cfg, world, trainer.cfg.train.batch_size))
            trainer.state.rank_states["balance"] = self  # the noise scale and the caps, for exact resume
        if trainer.dist.is_main:
            trainer.log_event(
                "balance",
                method=self.cfg.method,
                sizes=list(sampler.sizes),
                global_batch=sampler.global_batch,
                adaptive=self.cfg.adaptive,
                memory_budget_gb=None if self.budget is None else self.budget / 1e9,
            )

    # adaptive's state in checkpoints (the time measurements are not: they are the machine's)
    def state_dict(self) -> dict[str, Any]:
        return {"noise": self.noise.state_dict(), "caps": {"oom": list(self.oom_caps)}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.noise.load_state_dict(state["noise"])
        self.oom_caps = [int(c) for c in state["caps"]["oom"]]

    def on_step_start(self, trainer: Trainer) -> None:
        if self.clock is not None:
            self.clock.start()
        if self.memory is not None:
            self.memory.reset()

    def after_backward(self, trainer: Trainer) -> None:
        if self.clock is not None:
            self.busy = self.clock.stop()
        if self.memory is None or self.sampler is None:
            return
        stats = trainer.state.extras.pop("grad_sq", None)
        if stats is not None and not trainer.state.extras.get("amp_overflow"):
            global_sq = float(trainer.state.extras["grad_norm"]) ** 2  # the averaged gradient's, unscaled
            self.noise.update(stats["ranks"], stats["sizes"], stats["accum"], global_sq)
        self.lr_scale = lr_multiplier(
            self.cfg.lr_scaling, trainer.cfg.optim.name, self.sampler.global_batch, self.start_batch
        )
        if self.lr_scale != 1.0:  # the schedule sets its own LR again after the step
            for group in trainer.optimizer.param_groups:
                group["lr"] *= self.lr_scale

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
        if self.memory is not None:
            peak = self.memory.read()
            w[3] = max(w[3], float(peak))
            metrics["peak_memory_gb"] = peak / 1e9
            metrics["global_batch"] = self.sampler.global_batch
            metrics["lr_scale"] = self.lr_scale
            if self.noise.value is not None:
                metrics["noise_scale"] = self.noise.value
        if trainer.state.step % self.cfg.every == 0:
            self._decide(trainer, self.cfg.every, metrics)

    def _decide(self, trainer: Trainer, steps: int, metrics: dict[str, Any]) -> None:
        assert self.sampler is not None and self.policy is not None
        ctx, sampler = trainer.dist, self.sampler
        table = torch.zeros(ctx.world_size, len(self.window), dtype=torch.float64)
        table[ctx.rank] = torch.tensor(self.window, dtype=torch.float64)
        rows = ctx.all_reduce_sum(table).tolist()
        self._reset_window()
        ran = current = list(sampler.sizes)
        self.policy.observe([row[:3] for row in rows], steps, trainer.cfg.train.grad_accum)
        step_s = max(row[2] for row in rows) / steps
        adaptive: dict[str, Any] = {}
        if self.memory is not None:
            current, adaptive = self._resize_global(trainer, current, rows)
        decided = self.policy.decide(current, step_s)
        # Rank 0's decision for all: a policy network need not give bit-equal outputs on every rank.
        shared: tuple[list[int], bool, float, float] = ctx.broadcast_object(decided)  # type: ignore[assignment]
        sizes, changed, before, after = shared
        sampler.resize(sizes)
        utilisation = [row[1] / row[2] if row[2] > 0 else 0.0 for row in rows]
        metrics["rank_batch_size"] = ran  # what the window ran (the report draws it per rank)
        metrics["rank_utilisation"] = utilisation
        if ctx.is_main:
            trainer.log_event(
                "balance",
                sizes=sizes,
                previous=ran,
                changed=changed or sizes != ran,
                predicted_step_s=[before, after],
                step_s=step_s,
                samples_per_s=[row[0] / row[1] if row[1] > 0 else 0.0 for row in rows],
                utilisation=utilisation,
                mean_utilisation=sum(utilisation) / len(utilisation),
                compute_balance=compute_balance(rows),
                **adaptive,
            )

    def _reset_window(self) -> None:
        self.window = [0.0] * len(self.window)
        if self.memory is not None:
            self.window[4:] = [self.base_memory, self.budget or 0.0]

    def caps(self) -> list[int]:
        """adaptive: each rank's largest batch, from its memory model and its out-of-memory errors."""
        caps = list(self.oom_caps)
        if not self.memory_rows:  # before the first decision: no memory measured yet
            return caps
        rows = zip(self.memory_history, self.memory_rows, strict=True)
        for r, (history, (base, budget)) in enumerate(rows):
            if history and budget > 0:
                batches, peaks = zip(*history, strict=True)
                caps[r] = min(caps[r], memory_cap(batches, peaks, budget, base, self.cfg.min_batch))
        return caps

    def _resize_global(
        self, trainer: Trainer, current: list[int], rows: list[list[float]]
    ) -> tuple[list[int], dict[str, Any]]:
        """The current split rescaled to the next global batch (noise scale, memory caps), and what
        the ``balance`` event records of it."""
        steps, accum = self.cfg.every, trainer.cfg.train.grad_accum
        for r, row in enumerate(rows):
            self.memory_history[r].append((row[0] / (steps * accum), row[3]))
        self.memory_rows = [(row[4], row[5]) for row in rows]
        caps = self.caps()
        assert self.policy is not None
        self.policy.caps = caps
        self.step_history.append((float(sum(current)), max(row[2] for row in rows) / steps))
        step_model = None
        if self.cfg.batch_rule == "goodput" and len({b for b, _ in self.step_history}) > 1:
            step_model = fit_time_model(*zip(*self.step_history, strict=True))
        target = goodput_batch(self.noise.value, step_model)
        if self.cfg.batch_rule == "goodput" and step_model is None and self.noise.value is not None:
            # the step time seen at one global batch only: try a larger one, to learn how it grows
            target = sum(current) * (1.0 + self.cfg.max_change)
        total = next_global_batch(
            sum(current),
            target,
            self.start_batch,
            self.cfg.max_total(self.start_batch),
            self.cfg.max_change,
            sum(caps),
        )
        total = max(total, self.cfg.min_batch * len(current))
        resized = proportional_split(total, current, lo=self.cfg.min_batch, hi=caps)
        return resized, {
            "noise_scale": self.noise.value,
            "target_batch": target,
            "global_batch": total,
            "caps": caps,
            "peak_memory_gb": [row[3] / 1e9 for row in rows],
        }

    def on_oom(self, trainer: Trainer, ranks: list[int]) -> None:
        """Ranks ran out of memory: each is capped at half its batch and the step is redone with the
        split that fits (the same global batch where the others have room)."""
        assert self.sampler is not None
        current = list(self.sampler.sizes)
        for r in ranks:
            if current[r] <= self.cfg.min_batch:
                raise ConfigError(
                    f"rank {r} ran out of memory with balance.min_batch = {self.cfg.min_batch} samples; "
                    "lower balance.min_batch, or train a smaller model (or with train.precision = 'bf16')"
                )
            self.oom_caps[r] = max(self.cfg.min_batch, current[r] // 2)
        caps = self.caps()
        total = min(sum(current), sum(caps))
        sizes = proportional_split(total, current, lo=self.cfg.min_batch, hi=caps)
        self.sampler.resize(sizes)
        if trainer.dist.is_main:
            trainer.log_event("balance", reason="oom", ranks=ranks, previous=current, sizes=sizes, caps=caps)

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
