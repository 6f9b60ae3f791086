"""``TrialPruner``: reports a trial's objective to optuna at each eval step and stops it when pruned."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from vatra.engine import Plugin

if TYPE_CHECKING:
    import optuna

    from vatra.engine.trainer import Trainer


class TrialPruner(Plugin):
    """At each evaluation, rank 0 reports ``objective`` at this step (``trial.report``) and asks the
    study's pruner (``trial.should_prune``); every rank gets the answer, so all ranks of a distributed
    trial stop after the same step. A pruned run ends within one eval interval with ``pruned: true``
    and the step in its summary (the worker then tells the trial PRUNED).

    ``trial`` is given on rank 0 only; an objective the evaluation does not produce is not reported
    (then only the final value counts and nothing is pruned).
    """

    def __init__(self, objective: str, trial: optuna.Trial | None) -> None:
        self.objective = objective
        self.trial = trial
        self.reported: set[int] = set()
        self.pruned_at: int | None = None

    def on_eval_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        step = trainer.state.step
        if step in self.reported or self.pruned_at is not None:
            return  # the final evaluation after a pruned or last step: already judged
        self.reported.add(step)
        prune = False
        value = metrics.get(self.objective)
        if self.trial is not None and isinstance(value, int | float) and math.isfinite(value):
            # with tune.epochs trials differ in batch size: they are compared epoch by epoch
            epochs = trainer.cfg.tune.epochs
            at = (
                round(step / trainer.cfg.train.eval_every)
                if epochs and trainer.cfg.train.eval_every
                else step
            )
            self.trial.report(float(value), at)
            # the last step's value is the trial's result, not a reason to stop it
            prune = step < trainer.cfg.train.steps and self.trial.should_prune()
        # NOTE: a collective per evaluation (a distributed trial): ranks must agree on stopping.
        if bool(trainer.dist.broadcast_object(prune)):
            self.pruned_at = step
            trainer.state.should_stop = True
            trainer.log_event("pruned", objective=self.objective, value=value)

    def on_fit_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        summary["pruned"] = self.pruned_at is not None
        if self.pruned_at is not None:
            summary["pruned_at_step"] = self.pruned_at
