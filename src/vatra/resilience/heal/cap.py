"""The cap on healing actions per window: healing that keeps firing is a failure, not a fix."""

from __future__ import annotations

from collections import deque

from vatra.errors import VatraError


class HealingFailed(VatraError):
    """Healing could not hold the run; the last good checkpoint and the logs are kept."""


class ActionCap:
    """At most ``max_actions`` capped actions in any ``window_steps`` executed steps.

    The clock counts steps executed, not ``state.step``: a rollback moves the step number back,
    but the work and the actions it cost still count.
    """

    def __init__(self, max_actions: int, window_steps: int) -> None:
        self.max_actions = max_actions
        self.window_steps = window_steps
        self.times: deque[int] = deque()

    def admit(self, clock: int, what: str) -> None:
        """Record one action at ``clock``; raise :class:`HealingFailed` when it exceeds the cap."""
        while self.times and self.times[0] <= clock - self.window_steps:
            self.times.popleft()
        if len(self.times) >= self.max_actions:
            raise HealingFailed(
                f"healing could not hold the run: {len(self.times)} actions in the last "
                f"{self.window_steps} steps (heal.max_actions = {self.max_actions}) and another was "
                f"needed ({what}); stopping with the last good checkpoint and the logs kept"
            )
        self.times.append(clock)
