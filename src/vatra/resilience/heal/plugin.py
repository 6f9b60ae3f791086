"""``Healer``: runs the healing policies, enforces the action cap and logs every action."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from vatra.config import Config
from vatra.engine import Plugin, overrides
from vatra.monitor.rca import event_cause
from vatra.resilience.heal._base import Action, Policy, build_policy
from vatra.resilience.heal.cap import ActionCap

if TYPE_CHECKING:
    from vatra.engine import Trainer
    from vatra.monitor.signals import Verdict


class Healer(Plugin):
    """Placed after the monitor (it reads the monitor's verdict) and before checkpointing.

    Every rank runs every policy on identical inputs, so all ranks act alike. Actions go to
    events.jsonl (rank 0) as ``heal`` events and are counted in ``trainer.state.extras["heal"]``;
    more than ``heal.max_actions`` capped actions within ``heal.window_steps`` steps raise
    :class:`~vatra.resilience.heal.cap.HealingFailed`, which ends the run with one error line.
    """

    def __init__(self, cfg: Config) -> None:
        self.policies: list[Policy] = [
            build_policy(value, cfg, f"heal.policies[{i}]") for i, value in enumerate(cfg.heal.policies)
        ]
        # Per hook, the policies that implement it (in order): these run on every step.
        self.deciding_after_backward = [p for p in self.policies if overrides(p, Policy, "after_backward")]
        self.deciding_on_step_end = [p for p in self.policies if overrides(p, Policy, "on_step_end")]
        self.cap = ActionCap(cfg.heal.max_actions, cfg.heal.window_steps)
        self.clock = 0  # steps executed, including those a rollback undid
        self.counts: dict[str, int] = {}

    def on_fit_start(self, trainer: Trainer) -> None:
        trainer.state.extras["heal"] = {"actions": self.counts}
        for p in self.policies:
            p.on_fit_start(trainer)

    def _act(self, trainer: Trainer, policy: Policy, action: Action) -> None:
        if action.capped:
            self.cap.admit(self.clock, f"{action.kind}: {action.reason}")
        policy.apply(trainer, action)
        self.counts[action.kind] = self.counts.get(action.kind, 0) + 1
        if trainer.dist.is_main:  # events.jsonl and the console's line
            evidence = {
                k: v if not isinstance(v, float) or math.isfinite(v) else str(v)
                for k, v in action.evidence.items()
            }
            fields: dict[str, Any] = {"policy": action.policy, "action": action.kind, "reason": action.reason}
            if action.kind in ("rollback", "skip_update"):  # an anomaly acted on: its cause too
                fields["cause"] = event_cause("heal", fields, f"healing: {action.kind} ({action.reason})")
            trainer.log_event("heal", **fields, evidence=evidence)

    def after_backward(self, trainer: Trainer) -> None:
        if trainer.state.extras.get("amp_overflow"):
            return  # fp16's scaler skips this update and lowers its scale: nothing to heal
        grad_norm = float(trainer.state.extras.get("grad_norm", 0.0))
        for p in self.deciding_after_backward:
            action = p.after_backward(trainer, grad_norm)
            if action is not None:
                self._act(trainer, p, action)

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        self.clock += 1
        verdict: Verdict | None = trainer.state.extras.get("monitor")  # None but at the step it arrives
        for p in self.deciding_on_step_end:
            action = p.on_step_end(trainer, verdict)
            if action is not None:
                self._act(trainer, p, action)
        metrics["heal_actions"] = sum(self.counts.values())

    def _close(self, trainer: Trainer) -> None:
        for p in self.policies:
            p.close(trainer)

    def on_fit_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        self._close(trainer)
        summary["heal_actions"] = dict(self.counts)

    def on_failure(self, trainer: Trainer, exc: BaseException) -> None:
        self._close(trainer)
