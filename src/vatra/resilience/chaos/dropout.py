"""``chaos.drop_clients_at = {round, stage, count}``: federated clients that vanish mid-protocol.

A channel that carries a staged protocol (secure aggregation's) calls the hook at its stage points
with plain values: :meth:`ClientDropout.round_start` when a round's first stage goes out, with the
clients asked, and :meth:`ClientDropout.vanish` before each stage's requests go out. In round
``round``, the ``count`` highest ids of the clients asked at the round's start vanish when
``stage``'s request reaches them; a client gone stays gone for the round (the channel's rule).
"""

from __future__ import annotations

from collections.abc import Iterable


class ClientDropout:
    """One ``drop_clients_at``: which clients vanish, and at which stage of which round."""

    def __init__(self, round: int, stage: str, count: int) -> None:
        self.round, self.stage, self.count = round, stage, count
        self.chosen: set[int] = set()

    def round_start(self, rnd: int, clients: Iterable[int]) -> None:
        """Round ``rnd`` begins with ``clients`` asked: in the chosen round, pick the highest ids."""
        if rnd == self.round:
            self.chosen = set(sorted(clients)[-self.count :])

    def vanish(self, stage: str, rnd: int) -> set[int]:
        """The clients that vanish as ``stage``'s request of round ``rnd`` reaches them."""
        return set(self.chosen) if (rnd, stage) == (self.round, self.stage) else set()
