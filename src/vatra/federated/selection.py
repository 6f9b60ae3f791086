"""The simple selectors: every available client, or a seeded uniform sample of them; and the seeded
uniform sample of the clients that evaluate (``federated.evaluate_clients``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from vatra.federated._base import Selector


def sorted_ids(available: Sequence[int]) -> np.ndarray:
    """``available`` as a sorted int64 array (a sort only when it is not sorted yet: ids usually are)."""
    pool = np.asarray(available, dtype=np.int64)
    return pool if bool(np.all(pool[1:] > pool[:-1])) else np.unique(pool)


class AllSelector(Selector):
    """Every available client, every round (``k`` is ignored)."""

    name = "all"

    def select(self, rnd: int, available: Sequence[int], k: int) -> list[int]:
        return sorted(available)


class RandomSelector(Selector):
    """``k`` clients uniformly at random without replacement; the draw depends only on (seed, round)."""

    name = "random"

    def select(self, rnd: int, available: Sequence[int], k: int) -> list[int]:
        pool = sorted_ids(available)
        rng = np.random.default_rng([self.seed, 4, rnd])
        return sorted(rng.choice(pool, size=min(k, len(pool)), replace=False).tolist())


def evaluation_count(how: int | float, available: int) -> int:
    """Clients to ask on an evaluation round: a count (capped at ``available``) or a fraction (≥ 1)."""
    if isinstance(how, float):
        return min(available, max(1, round(how * available)))
    return min(available, how)


def evaluation_sample(seed: int, rnd: int, available: Sequence[int], how: int | float) -> list[int]:
    """The clients that evaluate in round ``rnd``: every available one when the count covers them,
    else a uniform draw without replacement that depends only on (seed, round) — unbiased for the
    clients' mean metrics, whichever selector picks the trainers."""
    pool = sorted_ids(available)
    k = evaluation_count(how, len(pool))
    if k >= len(pool):
        return pool.tolist()
    rng = np.random.default_rng([seed, 6, rnd])
    return np.sort(rng.choice(pool, size=k, replace=False)).tolist()
