"""Roll back to the last good state on NaN/Inf or divergence and skip the faulty window's data."""

from __future__ import annotations

import copy
import math
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vatra.config import Config
from vatra.monitor.signals import LOSS_STREAMS
from vatra.resilience.heal._base import Action, Policy
from vatra.resilience.heal.cap import HealingFailed
from vatra.resilience.snapshot import copy_state
from vatra.resilience.store import LAST_GOOD

if TYPE_CHECKING:
    from vatra.engine import Checkpointer, Trainer
    from vatra.monitor.signals import Verdict


@dataclass
class Snapshot:
    """An in-memory copy of everything a rollback restores (used when no checkpoint plugin runs)."""

    step: int
    model: dict[str, Any]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    scaler: dict[str, Any]
    plugins: dict[str, dict[str, Any]]  # trainer.state.rank_states: error-feedback residuals

    @classmethod
    def take(cls, trainer: Trainer, reuse: Snapshot | None = None) -> Snapshot:
        """Copy the trainer's state; with ``reuse``, into that older snapshot's tensors (one batched
        copy instead of an allocation and a deepcopy per tensor: ~20× cheaper on a small model), by
        :func:`~vatra.resilience.snapshot.copy_state`, as the async checkpoint save copies.

        Plugins' per-rank state (``trainer.state.rank_states``, what checkpoints keep besides the
        model) is copied too: the comm plugin's error-feedback residuals are updated in backward,
        before any policy can skip the step, so a NaN gradient leaves NaN in them and, without
        them restored, the first step after a rollback is NaN again."""
        state = {
            "model": trainer.trainable.state_dict(),
            "optimizer": trainer.optimizer.state_dict(),
            "plugins": {name: obj.state_dict() for name, obj in trainer.state.rank_states.items()},
            "scheduler": trainer.scheduler.state_dict(),
            "scaler": trainer.scaler.state_dict(),
        }
        return cls(step=trainer.state.step, **copy_state(state, vars(reuse) if reuse else None))

    def restore(self, trainer: Trainer) -> None:
        trainer.trainable.load_state_dict(self.model)
        # load_state_dict keeps tensors it does not need to move: copy, or later steps would
        # update this snapshot in place.
        trainer.optimizer.load_state_dict(copy.deepcopy(self.optimizer))
        trainer.scheduler.load_state_dict(copy.deepcopy(self.scheduler))
        trainer.scaler.load_state_dict(copy.deepcopy(self.scaler))
        for name, obj in trainer.state.rank_states.items():
            obj.load_state_dict(copy.deepcopy(self.plugins.get(name, {})))
        trainer.state.step = self.step


class Rollback(Policy):
    """Roll back to the last good state and skip the data of the faulty window, as PaLM's authors
    did for loss spikes (Chowdhery et al. 2022, §5.1: restart ~100 steps before the spike and skip
    the 200–500 batches around it), on:

    - a non-finite gradient norm (decided at once, from the norm every rank has);
    - a non-finite mean loss in the monitor's verdict;
    - a divergence: the verdict blames alarms on the loss streams (the loss or its change), and the
      loss is not back on its baseline in the next ``divergence_windows`` − 1 windows either (each
      window alarms on the loss streams again or its mean loss stays above the baseline). The
      monitor's robust z follows a lasting change of level within tens of steps, so a diverged loss
      stops alarming while it stays up; a transient spike that comes back down rolls nothing back;
    - ``escalate_after_skips`` consecutive skipped updates (the weights, not a batch, are bad).

    The baseline is the last clean window's (no alarm) mean loss plus its standard deviation.

    A rollback

    1. restores ``last-good`` through ``trainer.state.checkpointer`` (the checkpoint plugin), or
       this policy's in-memory snapshot when no checkpoint plugin runs;
    2. skips the faulty window's data: the sampler keeps its position, so the batches since the
       restored step are not replayed, and when the rollback comes sooner than the divergence rule
       could have (non-finite values, repeated skips), the batches up to ``divergence_windows`` ×
       ``monitor.gather_every`` steps past the first abnormal one are skipped too: a bad stretch of
       data can outlast the steps that revealed it;
    3. keeps the LR on its schedule. Only a rollback that comes before the loss got back on its
       baseline after the previous one (skipping the data did not help) multiplies the LR by
       ``heal.lr_backoff`` (cumulative), and the LR returns to its schedule once a clean window's
       loss is back on the baseline from before the fault (an ``lr_restore`` action).

    Every input is identical on every rank (the all-reduced gradient norm, the broadcast verdict), so
    every rank rolls back at the same step to the same version, and each skips its own data alike.

    In-memory snapshots are taken on verdict steps at most every ``snapshot_every`` steps and only
    promoted to last-good after the next verdict is clean as well: a verdict covers the steps
    before it, so a snapshot is good once a later clean window has vouched for it.
    """

    name = "rollback"

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        self.nonfinite_at: int | None = None
        self.skips_in_a_row = 0
        self.diverging = 0  # windows since the loss streams alarmed without the loss coming back
        self.onset: int | None = None  # the first loss-stream alarm of those windows
        self.baseline: tuple[float, float] | None = None  # (mean, sd) of the last clean window's loss
        self.recovering = False  # rolled back, and the loss not back on the baseline yet
        self.lr_scale = 1.0
        self.base_lrs: list[float] = []
        self.good: Snapshot | None = None
        self.pending: Snapshot | None = None
        self.spare: Snapshot | None = None  # an outdated snapshot whose buffers the next one reuses
        self.rollbacks = 0

    def on_fit_start(self, trainer: Trainer) -> None:
        # The LRs the schedule was built with: a checkpoint saved while backed off holds scaled ones.
        self.base_lrs = [float(g["initial_lr"]) for g in trainer.optimizer.param_groups]
        self.good = Snapshot.take(trainer)  # the starting state is good by definition

    def after_backward(self, trainer: Trainer, grad_norm: float) -> Action | None:
        # Runs after skip_spike: a skip decided for this step is visible here.
        if not math.isfinite(grad_norm):
            self.nonfinite_at = trainer.state.step + 1
        self.skips_in_a_row = self.skips_in_a_row + 1 if trainer.state.skip_update else 0
        return None

    def on_step_end(self, trainer: Trainer, verdict: Verdict | None) -> Action | None:
        evidence: dict[str, Any]
        if self.nonfinite_at is not None:
            evidence = {"at_step": self.nonfinite_at, "onset": self.nonfinite_at}
            return Action(self.name, "rollback", "non-finite gradient norm", evidence)
        if self.skips_in_a_row >= self.cfg.escalate_after_skips:
            # The gradient stays abnormal after skipped updates: the weights, not a batch, are bad.
            step = trainer.state.step
            evidence = {
                "at_step": step,
                "skipped_in_a_row": self.skips_in_a_row,
                "onset": step - self.skips_in_a_row + 1,
            }
            return Action(self.name, "rollback", "updates skipped repeatedly", evidence)
        if verdict is None:
            return None
        for step, loss in zip(verdict.steps, verdict.loss, strict=True):
            if not math.isfinite(loss):
                return Action(
                    self.name, "rollback", "non-finite loss", {"at_step": step, "loss": loss, "onset": step}
                )
        action = self._judge_loss(verdict)
        if action is None and trainer.state.checkpointer is None:
            self._snapshot(trainer, verdict)
        return action

    def _judge_loss(self, verdict: Verdict) -> Action | None:
        """The divergence rule, and the end of a recovery, on one verdict."""
        mean = statistics.fmean(verdict.loss)
        alarmed = verdict.alarmed_on(LOSS_STREAMS)
        back = not alarmed and self.baseline is not None and mean <= sum(self.baseline)
        if alarmed and not self.diverging:
            self.onset = alarmed[0]
        if alarmed or (self.diverging and not back):
            self.diverging += 1
            if self.diverging >= self.cfg.divergence_windows:
                assert self.onset is not None
                evidence = {
                    "at_step": verdict.steps[-1],
                    "onset": self.onset,
                    "windows": self.diverging,
                    "loss": mean,
                    "baseline": self.baseline[0] if self.baseline else None,
                }
                return Action(self.name, "rollback", "loss diverged", evidence)
            return None
        self.diverging, self.onset = 0, None
        if verdict.alarms:
            return None
        if not self.recovering:
            sd = statistics.pstdev(verdict.loss) if len(verdict.loss) > 1 else 0.0
            self.baseline = (mean, sd)
            return None
        if not back:
            return None
        self.recovering = False
        if self.lr_scale == 1.0:
            return None
        assert self.baseline is not None
        reason = f"loss back on its baseline ({mean:.4g} ≤ {sum(self.baseline):.4g}): LR back on schedule"
        evidence = {"at_step": verdict.steps[-1], "loss": mean, "baseline": self.baseline[0]}
        return Action(self.name, "lr_restore", reason, evidence, capped=False)

    def _snapshot(self, trainer: Trainer, verdict: Verdict) -> None:
        clean = verdict.alarms == 0 and self.diverging == 0 and trainer.state.healthy
        if not clean:
            self.spare, self.pending = self.pending or self.spare, None
            return
        if self.pending is not None:
            self.spare, self.good, self.pending = self.good, self.pending, None
        since = trainer.state.step - (self.good.step if self.good else 0)
        if since >= self.cfg.snapshot_every:
            self.pending, self.spare = Snapshot.take(trainer, reuse=self.spare), None

    def apply(self, trainer: Trainer, action: Action) -> None:
        if action.kind == "lr_restore":
            self.lr_scale = 1.0
            self._scale_lr(trainer)
            action.evidence["lr_scale"] = self.lr_scale
            return
        from_step = trainer.state.step
        data_now = trainer.batches.state_dict()
        # The update of the step before the first abnormal one may be the culprit (its damage shows
        # one step later), so a good state is at most onset - 2.
        onset = int(action.evidence["onset"])
        newest_ok = onset - 2
        checkpointer = trainer.state.checkpointer
        if checkpointer is not None:
            source = self._restore_checkpoint(trainer, checkpointer, newest_ok)
        else:
            if self.good is None or self.good.step > newest_ok:
                raise HealingFailed(
                    f"rollback needed but no snapshot from step {newest_ok} or earlier exists"
                )
            self.good.restore(trainer)
            source = "memory"
        trainer.batches.load_state_dict(data_now)  # the batches since the restored step: skipped
        # ... and those of the faulty window that the detectors have not seen yet
        ahead = max(0, self.cfg.divergence_windows * self.monitor.gather_every - (from_step - onset + 1))
        for _ in range(ahead * trainer.cfg.train.grad_accum):
            trainer.next_batch()
        if self.recovering:  # the last rollback's skipped data was not the cause: the LR may be
            self.lr_scale *= self.cfg.lr_backoff
        self._scale_lr(trainer)  # also puts back the schedule's height a restored checkpoint held
        self.spare = self.pending or self.spare
        self.nonfinite_at, self.pending, self.skips_in_a_row = None, None, 0
        self.diverging, self.onset = 0, None
        self.recovering = True
        self.rollbacks += 1
        trainer.state.healthy = False
        action.evidence.update(
            from_step=from_step,
            to_step=trainer.state.step,
            skipped_steps_of_data=from_step - trainer.state.step + ahead,
            lr_scale=self.lr_scale,
            source=source,
        )

    @staticmethod
    def _restore_checkpoint(trainer: Trainer, checkpointer: Checkpointer, newest_ok: int) -> str:
        """Restore ``last-good``, then walk its parents until a version tagged last-good is old enough.

        ``last-good`` is tagged by the checkpoint plugin when the verdict at save time was clean,
        but a fault in the last steps before a save shows only after it: such a version is skipped.
        """
        ref: str | None = LAST_GOOD
        try:
            while ref is not None:
                manifest = checkpointer.restore(trainer, ref)
                if manifest["step"] <= newest_ok and LAST_GOOD in manifest.get("tags", ()):
                    return f"checkpoint {manifest['version']}"
                ref = manifest.get("parent")
        except Exception as exc:
            raise HealingFailed(f"rollback to last-good failed: {type(exc).__name__}: {exc}") from exc
        raise HealingFailed(
            f"rollback needed but no last-good checkpoint from step {newest_ok} or earlier exists"
        )

    def _scale_lr(self, trainer: Trainer) -> None:
        """Base LRs × the cumulative backoff; the schedule's shape stays, its height drops."""
        sched = trainer.scheduler
        sched.base_lrs = [b * self.lr_scale for b in self.base_lrs]
        lrs = [b * f(sched.last_epoch) for b, f in zip(sched.base_lrs, sched.lr_lambdas, strict=True)]
        for group, lr in zip(trainer.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        sched._last_lr = lrs
