"""Privacy accounting: opacus's RDP accountant for the sampled Gaussian mechanism, ε at a fixed δ."""

from __future__ import annotations

import math


class Accountant:
    """ε after a sequence of Gaussian steps (noise multiplier z, sampling rate q), at ``delta``.

    Client-level DP: one step per round, q = clients per round / clients. Sample-level DP: one
    step per local batch, q = batch / shard. RDP assumes Poisson sampling; vatra samples a fixed
    number per round, the usual approximation (Abadi et al. make the same one).
    """

    def __init__(self, delta: float, history: list[list[float]] | None = None) -> None:
        self.delta = delta
        from opacus.accountants import RDPAccountant  # imported when privacy is on: it costs seconds

        self.rdp = RDPAccountant()
        self.rdp.history = [(float(z), float(q), int(n)) for z, q, n in history or []]

    def history(self) -> list[list[float]]:
        """The steps taken, [[z, q, steps], …] (JSON-able): ``Accountant(delta, history)`` restores it."""
        return [[z, q, n] for z, q, n in self.rdp.history]

    def step(self, noise_multiplier: float, sample_rate: float, steps: int = 1) -> None:
        for _ in range(steps):
            self.rdp.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate)

    def epsilon(self) -> float:
        if not self.rdp.history:
            return 0.0
        if any(z <= 0 for z, _, _ in self.rdp.history):
            return math.inf
        return float(self.rdp.get_epsilon(self.delta))

    def epsilon_after(self, noise_multiplier: float, sample_rate: float, steps: int = 1) -> float:
        """ε if ``steps`` more steps were taken (the accountant itself is unchanged)."""
        if noise_multiplier <= 0:
            return math.inf
        probe = type(self.rdp)()
        probe.history = [*self.rdp.history, (noise_multiplier, sample_rate, steps)]
        return float(probe.get_epsilon(self.delta))
