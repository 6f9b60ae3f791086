"""``balance.method = "proportional"``: the split that equalises the ranks' predicted busy times."""

from __future__ import annotations

from vatra.balance._base import BalancePolicy
from vatra.balance.split import change_bounds, equal_time_split, proportional_split


class ProportionalPolicy(BalancePolicy):
    """The equal-time split of the time models, blended with the current one by ``smoothing``, and
    no rank's batch moved by more than ``max_change`` of itself."""

    def propose(self, current: list[int]) -> list[int]:
        cfg, total = self.cfg, sum(current)
        caps = self.caps or [total] * len(current)
        target = equal_time_split(total, self.models, lo=cfg.min_batch, hi=caps)
        blended = [
            cfg.smoothing * c + (1.0 - cfg.smoothing) * t for c, t in zip(current, target, strict=True)
        ]
        lo, hi = change_bounds(current, caps, cfg.max_change, cfg.min_batch)
        return proportional_split(total, blended, lo=lo, hi=hi)
