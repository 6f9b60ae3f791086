"""A simulated mixed cluster, as a gymnasium environment, for learning a balancer with PPO.

Each episode draws a cluster: per-rank compute per sample ``c_r`` (log-uniform over ``speeds`` times
a base cost), a fixed cost per step ``a_r``, and, on some episodes, a memory budget that caps one
rank's batch. A decision sets the next split; the environment runs one window of it (busy time per
rank ``a_r + c_r · b_r`` with multiplicative noise, the step as long as the slowest rank) and
rewards the window's compute balance (mean busy time over the slowest rank's), the figure the
online balancer records as ``compute_balance``.

The balancer sees per rank: its share of the global batch, its measured busy time relative to the
slowest, the share the equal-time split of the fitted time models gives it, and its cap as a share
of the global batch. An action is one number per rank in [−1, 1], a correction to the equal-time
split: the rank's batch there is multiplied by ``(1 + max_change) ** action``, then the split is
made whole within the caps and ``max_change`` of the current batch (the online safety limits) by
:func:`~vatra.balance.split.proportional_split`. The policy so learns what the analytic split
misses (noise in one window's measurement, a fixed cost not yet identifiable, caps) rather than the
split itself; an untrained policy, whose actions are near 0, is the unsmoothed equal-time rule.
"""

from __future__ import annotations

import math
from typing import Any

import gymnasium as gym
import numpy as np

from vatra.balance.split import (
    HISTORY,
    TimeModel,
    change_bounds,
    equal_time_split,
    fit_time_model,
    proportional_split,
)


def features(
    sizes: list[int], busy: list[float], models: list[TimeModel], caps: list[int], min_batch: int
) -> tuple[np.ndarray, list[int]]:
    """What a learned balancer sees (the same features online and in the simulator), and the
    equal-time split of the fitted models, which its action corrects."""
    total = sum(sizes)
    slowest = max(busy) or 1.0
    target = equal_time_split(total, models, lo=min_batch, hi=caps)
    obs = [b / total for b in sizes] + [t / slowest for t in busy] + [t / total for t in target]
    return np.asarray(obs + [c / total for c in caps], dtype=np.float32), target


def apply_action(
    sizes: list[int],
    target: list[int],
    action: np.ndarray,
    caps: list[int],
    max_change: float,
    min_batch: int,
) -> list[int]:
    """The split an action asks for: the equal-time split ``target`` with rank r's batch multiplied by
    ``(1 + max_change) ** action[r]``, made whole within the caps and ``max_change`` of each rank's
    current batch (an action of zeros moves as far towards the equal-time split as the limits allow)."""
    total = sum(sizes)
    factors = (1.0 + max_change) ** np.clip(np.asarray(action, dtype=float), -1.0, 1.0)
    lo, hi = change_bounds(sizes, caps, max_change, min_batch)
    desired = [max(t * f, 1e-3) for t, f in zip(target, factors, strict=True)]
    return proportional_split(total, desired, lo=lo, hi=hi)


class ClusterEnv(gym.Env[np.ndarray, np.ndarray]):
    """A mixed cluster of ``ranks`` ranks sharing ``global_batch`` samples a step."""

    def __init__(
        self,
        ranks: int = 4,
        global_batch: int = 128,
        *,
        episode: int = 20,
        max_change: float = 0.5,
        min_batch: int = 1,
        noise: float = 0.05,
        speeds: tuple[float, float] = (1.0, 5.0),
        fixed: float = 0.3,
        cap_probability: float = 0.3,
    ) -> None:
        if global_batch < ranks * min_batch:
            raise ValueError(
                f"global_batch {global_batch} cannot give {ranks} ranks {min_batch} samples each"
            )
        self.ranks, self.total, self.episode = ranks, global_batch, episode
        self.max_change, self.min_batch, self.noise = max_change, min_batch, noise
        self.speeds, self.fixed, self.cap_probability = speeds, fixed, cap_probability
        self.observation_space = gym.spaces.Box(0.0, np.inf, shape=(4 * ranks,), dtype=np.float32)
        self.action_space = gym.spaces.Box(-1.0, 1.0, shape=(ranks,), dtype=np.float32)
        self.true: list[TimeModel] = []
        self.caps: list[int] = []
        self.sizes: list[int] = []
        self.busy: list[float] = []
        self.history: list[list[tuple[float, float]]] = []
        self.t = 0

    # ------------------------------------------------------------- cluster
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        rng, n = self.np_random, self.ranks
        per_sample = 1e-3 * np.exp(rng.uniform(math.log(self.speeds[0]), math.log(self.speeds[1]), n))
        base = 1e-3 * self.total / n
        self.true = [TimeModel(float(self.fixed * base * rng.uniform()), float(c)) for c in per_sample]
        self.caps = [self.total] * n
        if rng.uniform() < self.cap_probability:
            share = rng.uniform(0.5, 0.9) * self.total / n  # one rank cannot hold an even share
            self.caps[int(rng.integers(n))] = max(self.min_batch, int(share))
        self.sizes = proportional_split(self.total, [1.0] * n, lo=self.min_batch, hi=self.caps)  # even
        self.history = [[] for _ in range(n)]
        self.t = 0
        self._run_window()
        return self._obs(), {}

    def _run_window(self) -> float:
        """Busy times of one window at the current split; returns its utilisation."""
        noise = 1.0 + self.noise * self.np_random.standard_normal(self.ranks)
        self.busy = [float(m(b) * max(z, 0.1)) for m, b, z in zip(self.true, self.sizes, noise, strict=True)]
        for r, (b, t) in enumerate(zip(self.sizes, self.busy, strict=True)):
            self.history[r] = [*self.history[r][-(HISTORY - 1) :], (float(b), t)]
        return float(np.mean(self.busy) / max(self.busy))  # the compute balance

    def models(self) -> list[TimeModel]:
        return [fit_time_model([b for b, _ in h], [t for _, t in h]) for h in self.history]

    def _features(self) -> tuple[np.ndarray, list[int]]:
        return features(self.sizes, self.busy, self.models(), self.caps, self.min_batch)

    def _obs(self) -> np.ndarray:
        return self._features()[0]

    def run_split(self, sizes: list[int]) -> float:
        """Run one window at ``sizes`` (any balancer's choice); returns its utilisation."""
        self.sizes = list(sizes)
        self.t += 1
        return self._run_window()

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict]:
        target = self._features()[1]
        sizes = apply_action(self.sizes, target, action, self.caps, self.max_change, self.min_batch)
        reward = self.run_split(sizes)
        return self._obs(), reward, False, self.t >= self.episode, {"sizes": sizes}
