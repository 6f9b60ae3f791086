"""``Policy``: the base class of self-healing policies, the ``Action`` they take, and ``build_policy``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vatra.config import Config
from vatra.registry import POLICIES

if TYPE_CHECKING:
    from vatra.engine import Trainer
    from vatra.monitor.signals import Verdict


def build_policy(value: str, cfg: Config, key: str = "heal.policies") -> Policy:
    """The policy ``value`` names (a built-in or a user's subclass) as ``cls(cfg)``.

    A class that sets no ``name`` in its body is named by ``value``, the import string: actions
    and the run's events show policies by name.
    """
    cls: type[Policy] = POLICIES.load_class(value, Policy, key)
    policy = cls(cfg)
    if not vars(cls).get("name"):
        policy.name = value
    return policy


@dataclass
class Action:
    """One healing action, logged to events.jsonl with its reason and evidence."""

    policy: str
    kind: str  # skip_update | rollback | straggler | prefetch
    reason: str
    evidence: dict[str, Any] = field(default_factory=dict)
    capped: bool = True  # counts against heal.max_actions (actions that change the training)


class Policy:
    """Decides on evidence every rank has in identical form, then acts on every rank.

    Call order per step: ``after_backward`` (the global, pre-clip gradient norm is identical on
    every rank after DDP's all-reduce) → ``on_step_end`` (with the monitor's verdict on the steps
    where one was made, else None; the verdict is broadcast from rank 0). A decision is returned
    as an :class:`Action`; the healer checks the action cap, then calls ``apply``. Because every
    input is identical across ranks, every rank takes the same decision without a collective.

    A user's subclass named by import string (``heal.policies = ["pkg.mod:MyPolicy"]``) works like
    a built-in: the healer builds it as ``MyPolicy(config)`` and calls it in the same order, named
    by its ``name`` or else by the import string.
    """

    name: str = ""  # set in each class body; actions and events name the policy by it

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg.heal
        self.monitor = cfg.monitor

    def on_fit_start(self, trainer: Trainer) -> None: ...

    def after_backward(self, trainer: Trainer, grad_norm: float) -> Action | None:
        return None

    def on_step_end(self, trainer: Trainer, verdict: Verdict | None) -> Action | None:
        return None

    def apply(self, trainer: Trainer, action: Action) -> None: ...

    def close(self, trainer: Trainer) -> None: ...
