"""``balance.method = "static"``: the configured split, kept; the balancer only measures."""

from __future__ import annotations

from vatra.balance._base import BalancePolicy


class StaticPolicy(BalancePolicy):
    """Proposes the current split: it never changes."""

    def propose(self, current: list[int]) -> list[int]:
        return current
