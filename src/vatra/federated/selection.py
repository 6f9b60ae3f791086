"""The simple selectors: every available client, or a seeded uniform sample of them."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from vatra.federated._base import Selector


class AllSelector(Selector):
    """Every available client, every round (``k`` is ignored)."""

    name = "all"

    def select(self, rnd: int, available: Sequence[int], k: int) -> list[int]:
        return sorted(available)


class RandomSelector(Selector):
    """``k`` clients uniformly at random without replacement; the draw depends only on (seed, round)."""

    name = "random"

    def select(self, rnd: int, available: Sequence[int], k: int) -> list[int]:
        pool = np.array(sorted(available))
        rng = np.random.default_rng([self.seed, 4, rnd])
        return sorted(rng.choice(pool, size=min(k, len(pool)), replace=False).tolist())
