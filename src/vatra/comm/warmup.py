"""When compression starts: after a warm-up that ends when training says so, not at a share of
``train.steps``.

Early gradients change fast, and a compressor that drops most of them then (with error feedback
delivering it steps later) costs accuracy; once the loss curve has turned from its steep fall into
its slow tail, the same compressor does not. :class:`LossSettled` watches a smoothed loss and says
when that turn has happened; :class:`CompressionStart` runs it inside the comm plugin on a value
every rank agrees on (the loss averaged over the ranks, one 4-byte all-reduce per warm-up step), so
every rank decides on the same step without a broadcast. After the decision, DGC's sparsity ramp
(``HookState.ratio_at``) takes the sent share down geometrically to ``comm.ratio`` over as many
steps again as the warm-up took.

``comm.start_step = N`` still fixes the step. Either way the run records when and why compression
started: an event ``compression_started`` (``step``, ``reason``) in events.jsonl and
``summary.json["compression_started_step"]``.
"""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from vatra.comm._base import Compressor
    from vatra.comm.topology import Topology
    from vatra.config import Config
    from vatra.config._comm import CommConfig
    from vatra.engine import Trainer

__all__ = ["CompressionStart", "LossSettled", "compression_start"]

WINDOW = 20  # steps: the span a fall is measured over, and the EMA's span
TURN = 0.25  # settled: the last window's fall is under this share of the steepest window's fall
FELL = 0.05  # ...and the curve has fallen at all: some window's fall was this share of its start


class LossSettled:
    """Decides when a loss curve has settled: its exponential moving average (span ``window``)
    fell over the last ``window`` steps by at most ``turn`` of its steepest fall over any
    ``window`` steps so far.

    Relative to the steepest fall rather than to a fixed threshold, so that the same rule fits a
    loss of 2.3 and one of 0.02 (the reason states both falls as shares of the curve's starting
    level); and only once some window fell by ``fell`` of the starting level, so that a flat start
    (the loss has not begun to fall: the LR warm-up, a slow first epoch) is not taken for a settled
    curve. Never before ``min_steps`` (the LR
    schedule's warm-up) nor before two windows of history; at ``max_steps`` it decides anyway
    (the curve never settled, e.g. a loss still falling steeply: the old fixed warm-up).

    Call :meth:`update` once per completed step with a value every rank agrees on; it returns the
    reason the first time it decides, and None before and after.
    """

    def __init__(
        self, min_steps: int, max_steps: int, window: int = WINDOW, turn: float = TURN, fell: float = FELL
    ) -> None:
        if window < 1 or not 0.0 < turn < 1.0:
            raise ValueError(f"window must be ≥ 1 and turn in (0, 1), got {window} and {turn}")
        self.min_steps, self.max_steps, self.window, self.turn = min_steps, max_steps, window, turn
        self.fell = fell
        self.ema: float | None = None
        self.start_level = 0.0  # the first loss fed
        self.history: deque[float] = deque(maxlen=window + 1)  # the EMA over the last window + 1 steps
        self.steepest = 0.0  # largest relative fall over a window so far
        self.seen = 0  # finite values fed
        self.decided: int | None = None  # the step compression starts at
        self.reason: str | None = None

    def update(self, step: int, loss: float) -> str | None:
        """Feed the loss of the step that just completed (``step`` steps are done); the reason,
        the first time compression should start with step index ``step``."""
        if self.decided is not None:
            return None
        if math.isfinite(loss):
            alpha = 2.0 / (self.window + 1)
            if self.ema is None:
                self.start_level = self.ema = loss
            self.ema = (1 - alpha) * self.ema + alpha * loss
            self.history.append(self.ema)
            self.seen += 1
        reason = self._reason(step)
        if reason is not None:
            self.decided, self.reason = step, reason
        return reason

    def _reason(self, step: int) -> str | None:
        if step >= self.max_steps:
            return f"loss did not settle by step {self.max_steps}: the warm-up's limit"
        if len(self.history) <= self.window:
            return None
        fall = self.history[0] - self.history[-1]
        self.steepest = max(self.steepest, fall)  # from the first full window on, LR warm-up included
        if step < self.min_steps or self.seen < 2 * self.window:
            return None
        level = max(abs(self.start_level), 1e-12)
        if self.steepest < self.fell * level or fall > self.turn * self.steepest:
            return None
        return (
            f"loss settled: its average fell {100 * fall / level:.1f} % of its starting level over the "
            f"last {self.window} steps, under {self.turn:g} of its steepest fall "
            f"({100 * self.steepest / level:.1f} %)"
        )

    def state_dict(self) -> dict[str, Any]:
        keys = ("ema", "start_level", "steepest", "seen", "decided", "reason")
        return {"history": list(self.history), **{k: getattr(self, k) for k in keys}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ema, self.start_level = state["ema"], state["start_level"]
        self.steepest, self.seen = state["steepest"], state["seen"]
        self.history = deque(state["history"], maxlen=self.window + 1)
        self.decided, self.reason = state["decided"], state["reason"]


class CompressionStart:
    """The comm plugin's side of the decision: feeds :class:`LossSettled` the loss averaged over
    the ranks, moves the hook's ``start_step`` (and the sparsity ramp's length) once it decides,
    and records the event. With a fixed start (``comm.start_step = N``, or a method that needs no
    warm-up) it only records the event when that step begins.

    A per-rank state for checkpoints (``trainer.state.rank_states["comm_warmup"]``): a resumed run
    continues the same curve and decides on the step the uninterrupted one did.
    """

    NEVER = 2**62  # the hook's start_step while the decision is pending

    def __init__(self, fixed: int | None, reason: str, detector: LossSettled | None, ramp: bool) -> None:
        self.fixed, self.fixed_reason, self.detector, self.ramp = fixed, reason, detector, ramp
        self.recorded = False

    @property
    def start_step(self) -> int:
        """The hook's start step now: the fixed one, the decided one, or never yet."""
        if self.detector is None:
            assert self.fixed is not None
            return self.fixed
        return self.NEVER if self.detector.decided is None else self.detector.decided

    def on_step_start(self, trainer: Trainer, state: Any) -> None:
        """Set the hook ``state``'s start (None: a hook that keeps its own, torch's PowerSGD) and
        record the event as the first compressed step begins."""
        if state is not None:
            state.start_step = self.start_step
            if self.detector is not None and self.detector.decided is not None and self.ramp:
                state.sparsity_warmup = self.detector.decided  # DGC's ramp, as long as the warm-up
        step = trainer.state.step
        if not self.recorded and step >= self.start_step:
            reason = self.fixed_reason if self.detector is None else self.detector.reason
            trainer.log_event("compression_started", reason=reason)
            self.recorded = True

    def on_step_end(self, trainer: Trainer, topology: Topology, loss: float) -> None:
        """Feed the step's loss, averaged over the ranks (every rank calls this: a collective)."""
        if self.detector is None or self.detector.decided is not None:
            return
        mean = torch.tensor([loss if math.isfinite(loss) else math.nan])  # fp32, as any gradient
        topology.all_reduce_(mean)  # NaN on any rank stays NaN: that step is not fed
        self.detector.update(trainer.state.step, float(mean) / topology.world_size)

    def summary(self) -> int | None:
        """``summary.json["compression_started_step"]``: None where compression never started."""
        return self.start_step if self.recorded else None

    def state_dict(self) -> dict[str, dict[str, Any]]:
        detector = self.detector.state_dict() if self.detector is not None else {}
        return {"warmup": {**detector, "recorded": self.recorded}}

    def load_state_dict(self, state: dict[str, dict[str, Any]]) -> None:
        part = dict(state.get("warmup", {}))
        self.recorded = bool(part.pop("recorded", False))
        if self.detector is not None and part:
            self.detector.load_state_dict(part)


def compression_start(
    asked: CommConfig, resolved: CommConfig, cfg: Config, compressor: Compressor | None
) -> CompressionStart:
    """How this run decides its first compressed step: ``asked`` is the ``comm`` section as
    configured, ``resolved`` after :func:`vatra.comm.recipe.resolve_recipe` (whose ``start_step``
    is then the limit of a signal-driven warm-up)."""
    start = int(resolved.start_step)
    if asked.start_step != "auto":
        return CompressionStart(start, f"comm.start_step = {start}", None, ramp=False)
    if compressor is not None and compressor.dense_share > 0.0:
        detector = LossSettled(min_steps=cfg.optim.warmup_steps, max_steps=start)
        ramp = asked.sparsity_warmup == "auto" and int(resolved.sparsity_warmup) > 0
        return CompressionStart(None, "", detector, ramp)
    if start == 0:
        return CompressionStart(0, f"{asked.method} needs no warm-up", None, ramp=False)
    why = f"the uncompressed warm-up ended (comm.start_step = auto: {start})"
    return CompressionStart(start, why, None, ramp=False)
