"""The balancing policy's base: what a policy is fed each window and how its proposal is taken, and
the policies by name (``balance.method``)."""

from __future__ import annotations

from collections import deque

from vatra.balance.split import HISTORY, TimeModel, fit_time_model, predicted_step
from vatra.config import BalanceConfig
from vatra.registry import Registry

POLICIES = Registry(
    "balance policy",
    "balance.method",
    {
        "ppo": "vatra.balance.ppo:LearnedPolicy",
        "proportional": "vatra.balance.proportional:ProportionalPolicy",
        "static": "vatra.balance.static:StaticPolicy",
    },
)


class BalancePolicy:
    """A decision rule apart from the training loop: fed each window's per-rank measurements, it
    proposes the next split. Deterministic (or rank 0's decision is broadcast), so every rank, fed
    the same table, decides the same.

    Call order, once per ``balance.every`` steps: :meth:`observe` (the window's table: each rank's
    time model is refitted), then :meth:`decide` (the subclass's :meth:`propose`, taken only when
    the time models predict it saves at least ``hysteresis`` of the step). ``caps`` (each rank's
    largest batch, from its memory) is set by the plugin before ``decide`` under ``adaptive``.
    """

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
        proposed = self.propose(current)
        before, after = predicted_step(models, current), predicted_step(models, proposed)
        step = max(step_s or 0.0, before)
        changed = proposed != current and before - after >= self.cfg.hysteresis * step
        return (proposed if changed else current), changed, before, after

    def propose(self, current: list[int]) -> list[int]:
        """The split this policy would run next, from the time models (``self.models``)."""
        raise NotImplementedError


def build_policy(cfg: BalanceConfig, world_size: int) -> BalancePolicy:
    """The policy ``balance.method`` names, for ``world_size`` ranks."""
    policy = POLICIES.load_class(cfg.method, BalancePolicy)
    return policy(cfg, world_size)
