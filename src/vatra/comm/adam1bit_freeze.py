"""1-bit Adam's optimizer side: when to freeze Adam's second moment (:class:`VarianceWatch`), the
freeze itself (:func:`freeze_`), and Adam / AdamW whose step uses the averaged momentum with the
frozen variance once frozen (:class:`FrozenAdam`, :class:`FrozenAdamW`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch.optim.lr_scheduler import LambdaLR

__all__ = ["FrozenAdam", "FrozenAdamW", "VarianceWatch", "freeze_", "frozen_optimizer", "rebind_scheduler"]


class _FrozenVariance(torch.optim.Optimizer):
    """Over torch's Adam / AdamW: once every group has ``frozen_step`` (set by :func:`freeze_`),
    :meth:`step` takes ``p.grad`` as the new momentum m̄ (the hook's average) and updates with the
    frozen second moment; before that, torch's own step, unchanged. ``frozen_step`` is a group key,
    so checkpoints and healing's snapshots carry it with the optimizer's state."""

    decoupled: ClassVar[bool]

    @property
    def frozen(self) -> bool:
        return self.param_groups[0].get("frozen_step") is not None

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        if not self.frozen:
            return super().step(closure)
        for group in self.param_groups:
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            beta1, _ = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                st["step"] += 1
                st["exp_avg"].copy_(p.grad)
                if self.decoupled and wd:
                    p.mul_(1.0 - lr * wd)
                denom = st["exp_avg_sq"].sqrt().add_(eps)  # v̂: bias correction folded in at the freeze
                p.addcdiv_(st["exp_avg"], denom, value=-lr / (1.0 - beta1 ** float(st["step"])))
        return None


class FrozenAdam(_FrozenVariance, torch.optim.Adam):
    decoupled = False


class FrozenAdamW(_FrozenVariance, torch.optim.AdamW):
    decoupled = True


def frozen_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The same optimizer (groups, hyperparameters, state) as its frozen-variance class."""
    cls = FrozenAdamW if isinstance(optimizer, torch.optim.AdamW) else FrozenAdam
    new = cls(optimizer.param_groups)
    new.load_state_dict(optimizer.state_dict())
    return new


def freeze_(optimizer: torch.optim.Optimizer, step: int) -> None:
    """Freeze v at this point: Adam's bias correction of v, ``1 − β₂ᵗ``, is folded into it."""
    for group in optimizer.param_groups:
        _, beta2 = group["betas"]
        group["frozen_step"] = step
        for p in group["params"]:
            st = optimizer.state.get(p)
            if st:
                st["exp_avg_sq"].div_(1.0 - beta2 ** float(st["step"]))


@dataclass
class VarianceWatch:
    """When Adam's second moment has settled, after the LR warm-up (``after`` steps): the
    bias-corrected ‖v̂‖ has either stopped moving (changed by less than ``tol``, relative, on each of
    the last ``window`` steps) or stopped growing (no new high since the LR warm-up for ``window``
    steps). Past its peak a frozen v̂ can only overestimate the variance to come, so the steps after
    the freeze are no larger than Adam's; one frozen while it still grows makes them too large.
    Every rank sees the same averaged gradients in the warm-up, so every rank decides alike with
    no message. :attr:`why` says which held."""

    tol: float
    window: int
    after: int
    last: float | None = None
    calm: int = 0  # steps in a row that moved by less than tol
    high: float = 0.0  # the highest |v̂| since the LR warm-up
    since_high: int = 0
    why: str = ""

    def settled(self, optimizer: torch.optim.Optimizer, step: int) -> bool:
        norm = _variance_norm(optimizer)
        last, self.last = self.last, norm
        if last is None or not math.isfinite(norm) or last == 0.0:
            self.calm = 0
            return False
        self.calm = self.calm + 1 if abs(norm - last) / last < self.tol else 0
        if step < self.after:
            return False
        if norm > self.high:
            self.high, self.since_high = norm, 0
        else:
            self.since_high += 1
        if self.calm >= self.window:
            self.why = f"|v̂| moved by less than {self.tol:.0%} per step for {self.window} steps"
        elif self.since_high >= self.window:
            self.why = f"|v̂| past its peak: no new high for {self.window} steps"
        return bool(self.why)


def _variance_norm(optimizer: torch.optim.Optimizer) -> float:
    """‖v̂‖ over every parameter: ‖v‖ / (1 − β₂ᵗ)."""
    total = 0.0
    for group in optimizer.param_groups:
        _, beta2 = group["betas"]
        vs = [optimizer.state[p]["exp_avg_sq"] for p in group["params"] if p in optimizer.state]
        if not vs:
            continue
        t = float(optimizer.state[group["params"][0]]["step"])
        total += float(torch.stack(torch._foreach_norm(vs, 2.0)).norm()) ** 2 / (1.0 - beta2**t) ** 2
    return total**0.5


def rebind_scheduler(scheduler: LambdaLR, optimizer: torch.optim.Optimizer) -> LambdaLR:
    """``scheduler``'s schedule on ``optimizer`` (which has the same groups), where it was."""
    new = LambdaLR(optimizer, scheduler.lr_lambdas)
    new.load_state_dict(scheduler.state_dict())
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr(), strict=True):
        group["lr"] = lr
    return new
