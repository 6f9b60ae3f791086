"""``Monitor``: per-rank step rows, one gather every k steps, the straggler view and the detectors."""

from __future__ import annotations

import functools
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from vatra._extras import MissingExtra, require
from vatra.config import Config
from vatra.engine import Plugin
from vatra.monitor.aftercare import report_after_training
from vatra.monitor.collect import SystemSampler, module_grad_norms
from vatra.monitor.ensemble import Alarm, Ensemble
from vatra.monitor.rca import event_cause
from vatra.monitor.signals import Verdict, stream_mask
from vatra.monitor.straggler import CollectiveStraggler
from vatra.rundir import RunDir

if TYPE_CHECKING:
    from vatra.engine import Trainer

# One row per rank per step; the gather ships (steps, len(COLUMNS)) float64 per rank.
COLUMNS = ("step", "loss", "grad_norm", "step_time_s", "data_time_s", "compute_time_s", "pp_bubble")
_, LOSS, GRAD, TIME, DATA, COMPUTE, BUBBLE = range(len(COLUMNS))  # their indices in a row
# The verdict's broadcast vector: these 4 values, then the window's k mean losses, then k alarm masks.
HEAD = ("alarms", "slowest_rank", "straggler_ratio", "data_share")
ALARMS, SLOWEST, RATIO, SHARE = range(len(HEAD))


Stage = Callable[["Trainer", "_Window", dict[str, Any]], "Verdict | None"]


@dataclass
class _Window:
    """A window on its way to its verdict: groups of stages, one group per step (see :class:`Monitor`)."""

    steps: list[int]
    stages: deque[list[Stage]]
    mine: list[list[float]]  # this rank's rows (k × C)
    rows: list[list[list[float]]] | None = None  # rank 0: every rank's rows (W × k × C)
    sent: torch.Tensor | None = None  # this rank's rows while its gather is in flight
    parts: list[torch.Tensor] | None = None  # rank 0: the gather's buffers
    box: torch.Tensor | None = None  # the verdict vector's broadcast buffer
    work: Any = None  # the collective in flight
    vector: list[float] | None = None  # [*HEAD, k mean losses, k alarm masks]
    stale: bool = False  # its steps were undone by a rollback: judged and logged, not acted on


def _verdict(step: int, steps: list[int], v: list[float]) -> Verdict:
    """A verdict from its vector: [*HEAD, k mean losses, k alarm masks]."""
    k = len(steps)
    return Verdict.from_masks(
        step,
        steps,
        v[len(HEAD) : len(HEAD) + k],
        [int(m) for m in v[len(HEAD) + k :]],
        straggler_ratio=v[RATIO],
        slowest_rank=int(v[SLOWEST]),
        data_share=v[SHARE],
    )


class Monitor(Plugin):
    """Collects metrics on every rank and runs the anomaly ensemble on rank 0.

    Per step each rank appends one row (loss, gradient norm, step time, data wait, compute time)
    to a buffer; every ``gather_every`` steps one ``gather`` brings the buffers to rank 0 and one
    ``broadcast`` sends back a small verdict, so the detectors see every step of every rank
    without a collective per metric or per step.

    A window moves on one stage per step, at the same steps on every rank, so no rank waits for a
    collective or for the judgement and all ranks act on a verdict alike:

    - with peers, its ``gather`` starts at its last step, asynchronously on the monitor's own
      process group (blocking, the two collectives cost ~4 ms a window on 4 gloo ranks sharing 2
      cores, 4 % of the flagship's step time); one step later rank 0 has the rows and hands the
      window to the ensemble; the verdict's ``broadcast`` starts when the ensemble has answered, and
      every rank reads the verdict one step after that;
    - alone, the ensemble judges the window at its last step.

    Verdicts thus act at the window's last step alone, 2 steps after it with peers. The run's last
    step takes every window in flight to its verdict. The ensemble runs in rank 0's training
    process: a forked judge process bought nothing measurable on the flagship and was removed.

    Compute time is measured from the step's start to the moment the first parameter's gradient
    is produced (the end of local backward, before DDP waits for the last bucket), so a slow rank
    shows as slow while the others show as waiting; in a single process it is the data wait plus
    forward-backward.
    """

    def __init__(self, cfg: Config, run_dir: RunDir | None = None) -> None:
        self.cfg = cfg.monitor
        self.run_dir = run_dir
        self.rows: list[list[float]] = []
        self.sampler: SystemSampler | None = None
        self.t0 = 0.0
        self.t_grad: float | None = None
        self.hook: Any = None
        self.anomalies = 0
        self.group: Any = None  # with peers: the monitor's own process group
        self.in_flight: deque[_Window] = deque()  # oldest first
        self.ensemble: Ensemble | None = None  # rank 0
        self.last_step = 0  # a step at or below it means a rollback
        self.schedule: list[list[Stage]] = []  # a window's stage groups (set at fit start)
        self.stragglers: CollectiveStraggler | None = None  # rank 0: the rank the others wait on

    def on_fit_start(self, trainer: Trainer) -> None:
        self.sampler = SystemSampler(trainer.dist.device)
        if trainer.dist.is_main:
            self.ensemble = Ensemble(self.cfg, seed=trainer.cfg.run.seed)
            self.stragglers = CollectiveStraggler(trainer.cfg.heal.straggler_ratio)
        if trainer.dist.distributed:  # collective: every rank builds its plugins alike
            # Its own group: the window's collectives run beside DDP's, not queued among them.
            self.group = dist.new_group()
        self.schedule = self._schedule()
        # With peers, compute ends when local backward does, before DDP waits for the last bucket:
        # a tensor hook marks it. Alone, compute is the data wait plus forward-backward, which the
        # trainer times anyway: no call from inside backward into Python is needed.
        first = next((p for p in trainer.model.parameters() if p.requires_grad), None)
        if first is not None and trainer.dist.distributed:
            self.hook = first.register_hook(self._grad_ready)

    def _grad_ready(self, grad: torch.Tensor) -> None:
        self.t_grad = time.perf_counter()

    def on_step_start(self, trainer: Trainer) -> None:
        self.t0 = time.perf_counter()
        self.t_grad = None

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        step = metrics["step"]
        done: list[Verdict] = []
        started = list(self.in_flight)  # windows of earlier steps: one stage group on (all at the end)
        if step <= self.last_step:  # a rollback: the windows so far describe steps since undone
            for w in started:
                w.stale = True
            if self.rows:  # their own window, so that no later verdict mixes them with new steps
                done = self._open(trainer, metrics, stale=True)
        self.last_step = step
        if "pp_busy_s" in metrics:  # a pipeline stage: its own compute, without the schedule's waits
            compute = metrics["pp_busy_s"]
        elif self.t_grad is not None:
            compute = self.t_grad - self.t0
        elif self.hook is None:
            compute = metrics["data_time_s"] + metrics["fwd_bwd_time_s"]
        else:  # no gradient this step
            compute = time.perf_counter() - self.t0
        metrics["compute_time_s"] = compute
        if self.sampler is not None and step % self.cfg.system_every == 0:
            metrics.update(self.sampler.sample())
        if self.cfg.module_grad_norms and trainer.dist.is_main:
            metrics.update(module_grad_norms(trainer.model))
        # fp16's scaler skipped this update (an inf gradient norm, the same on every rank): not an
        # anomaly, and no sample for the detectors' baselines.
        if not metrics.get("amp_overflow"):
            self.rows.append(
                [
                    step,
                    metrics["loss"],
                    metrics["grad_norm"],
                    metrics["step_time_s"],
                    metrics["data_time_s"],
                    compute,
                    metrics.get("pp_bubble", 0.0),
                ]
            )
        last = step >= trainer.cfg.train.steps or trainer.state.should_stop
        if started and not last:
            done += self._advance(trainer, metrics, started)
        if step % self.cfg.gather_every == 0 or last:
            done += self._open(trainer, metrics)
        if last:
            done += self._advance(trainer, metrics, list(self.in_flight), finish=True)
        # The verdict of this step, or None: a verdict is acted on at the step it is delivered only.
        trainer.state.extras["monitor"] = verdict = functools.reduce(Verdict.then, done) if done else None
        if verdict is not None:
            trainer.state.healthy = verdict.alarms == 0

    # ------------------------------------------------------------- the window pipeline
    def _schedule(self) -> list[list[Stage]]:
        """A window's stage groups; by config only, so every rank runs the same collectives."""
        if self.group is None:
            return [[self._judge, self._deliver]]
        return [[self._gather], [self._gathered, self._judge, self._broadcast], [self._deliver]]

    def _open(self, trainer: Trainer, metrics: dict[str, Any], stale: bool = False) -> list[Verdict]:
        """A window of the rows since the last one; its first stage group runs now."""
        rows, self.rows = self.rows, []
        if not rows:  # every step since the last window was an fp16 overflow (so on every rank)
            return []
        w = _Window([int(r[0]) for r in rows], deque(self.schedule), rows, stale=stale)
        if self.group is None:
            w.rows = [rows]  # alone: rank 0's rows are all the rows
        self.in_flight.append(w)
        return self._advance(trainer, metrics, [w])

    def _advance(
        self, trainer: Trainer, metrics: dict[str, Any], windows: list[_Window], finish: bool = False
    ) -> list[Verdict]:
        """Run the next stage group of each window (``finish``: all of them), oldest window first;
        returns the verdicts delivered."""
        done: list[Verdict] = []
        for w in windows:
            while w.stages:
                for stage in w.stages.popleft():
                    verdict = stage(trainer, w, metrics)
                    if verdict is not None:
                        done.append(verdict)
                if not finish:
                    break
            if not w.stages:
                self.in_flight.remove(w)
        return done

    def _gather(self, trainer: Trainer, w: _Window, metrics: dict[str, Any]) -> None:
        ctx = trainer.dist
        # On the process group's device: NCCL moves CUDA tensors only (gloo takes either).
        w.sent = torch.tensor(w.mine, dtype=torch.float64, device=ctx.device)  # (k, C)
        w.parts = [torch.empty_like(w.sent) for _ in range(ctx.world_size)] if ctx.is_main else None
        w.work = dist.gather(w.sent, w.parts, dst=0, group=self.group, async_op=True)

    def _gathered(self, trainer: Trainer, w: _Window, metrics: dict[str, Any]) -> None:
        w.work.wait()
        if w.parts is not None:
            w.rows = torch.stack(w.parts).tolist()

    def _judge(self, trainer: Trainer, w: _Window, metrics: dict[str, Any]) -> None:
        """Rank 0: the window's view, the ensemble's alarms (logged), the verdict vector."""
        if w.rows is None:  # another rank: its verdict comes in the broadcast
            return
        assert self.ensemble is not None
        head = self._view(w.rows, metrics)
        compute, total = metrics["rank_compute_time_s"], metrics["rank_step_time_s"]
        if self.stragglers is not None and trainer.parallel is None:
            found = self.stragglers.observe(compute, [t - c for t, c in zip(total, compute, strict=True)])
            if found is not None:
                trainer.log_event("straggler", **found)
        if trainer.parallel is not None and trainer.parallel.pipeline is not None:
            self._stage_view(w.rows, trainer.parallel.mesh.cfg.pp, metrics)
        losses = head[len(HEAD) :]
        grad_norms = [r[GRAD] for r in w.rows[0]]  # the global norm: identical on every rank
        masks = [0.0] * len(w.steps)
        for j, alarm in enumerate(self.ensemble.observe_window(w.steps, losses, grad_norms)):
            if alarm is not None:
                masks[j] = float(stream_mask(alarm.streams))
                self._log_alarm(trainer, alarm, [r[j][LOSS] for r in w.rows])
        head[ALARMS] = float(sum(m > 0 for m in masks))
        w.vector = head + masks
        metrics["anomalies"] = self.anomalies

    def _broadcast(self, trainer: Trainer, w: _Window, metrics: dict[str, Any]) -> None:
        device = trainer.dist.device
        if w.vector is not None:  # rank 0
            w.box = torch.tensor(w.vector, dtype=torch.float64, device=device)
        else:
            w.box = torch.zeros(len(HEAD) + 2 * len(w.steps), dtype=torch.float64, device=device)
        w.work = dist.broadcast(w.box, src=0, group=self.group, async_op=True)

    def _deliver(self, trainer: Trainer, w: _Window, metrics: dict[str, Any]) -> Verdict | None:
        if w.box is not None:
            w.work.wait()
            w.vector = w.box.tolist()
        if w.stale:
            return None
        assert w.vector is not None
        return _verdict(trainer.state.step, w.steps, w.vector)

    def _view(self, window: list[list[list[float]]], metrics: dict[str, Any]) -> list[float]:
        """Rank 0: the verdict vector of a window (W ranks × k steps × C columns, as lists) but for
        what the ensemble adds: the straggler and data-wait view, mean loss per step. Plain Python, not
        numpy: inside a run each small numpy call costs several times what it costs on its own
        (the training step has taken the caches), and these are tiny."""
        ranks, k = len(window), len(window[0])
        loss_mean = [sum(w[j][LOSS] for w in window) / ranks for j in range(k)]
        compute = [sum(r[COMPUTE] for r in w) / k for w in window]
        step_total = [sum(r[TIME] for r in w) for w in window]
        waits = (sum(r[DATA] for r in w) for w in window)
        data_share = max(wait / max(t, 1e-12) for wait, t in zip(waits, step_total, strict=True))
        # Against the median of the *other* ranks: with two ranks the plain median is the mean of
        # both, which caps the ratio at 2 however slow one of them is.
        slowest = max(range(len(compute)), key=compute.__getitem__)
        others = compute[:slowest] + compute[slowest + 1 :]
        median = statistics.median(others) if others else compute[slowest]
        ratio = compute[slowest] / median if median > 0 else 1.0
        metrics["rank_step_time_s"] = [t / k for t in step_total]
        metrics["rank_compute_time_s"] = compute
        metrics["straggler_ratio"] = ratio
        metrics["slowest_rank"] = slowest
        return [0.0, float(slowest), ratio, data_share, *loss_mean]

    @staticmethod
    def _stage_view(window: list[list[list[float]]], pp: int, metrics: dict[str, Any]) -> None:
        """Rank 0, pipelines: per stage (pp rank; the mesh puts pp outermost, so global rank r is on
        pp rank ``r // (W / pp)``), the window's mean compute seconds and bubble over its ranks."""
        per = len(window) // pp
        stages = [[r for rank in window[s * per : (s + 1) * per] for r in rank] for s in range(pp)]
        for key, column in (("pp_stage_busy_s", COMPUTE), ("pp_stage_bubble", BUBBLE)):
            metrics[key] = [sum(r[column] for r in rows) / len(rows) for rows in stages]

    def _log_alarm(self, trainer: Trainer, alarm: Alarm, rank_losses: list[float]) -> None:
        self.anomalies += 1
        if trainer.run_dir is not None:
            fields = {"step": alarm.step, "rank_losses": rank_losses, **alarm.as_event()}
            trainer.run_dir.log_event("anomaly", rank=0, **fields, cause=event_cause("anomaly", fields))

    def _close(self) -> None:
        self.in_flight.clear()  # after a failure peers may be gone: no waiting
        if self.hook is not None:
            self.hook.remove()
            self.hook = None
        if self.ensemble is not None:
            self.ensemble.close(wait=False)  # a fit still running is of no use now
            self.ensemble = None
        if self.sampler is not None:
            self.sampler.close()

    def on_fit_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        if self.in_flight:  # the loop stopped early (SIGTERM): finish the windows on their way
            self._advance(trainer, {}, list(self.in_flight), finish=True)
        self._close()
        summary["anomalies"] = self.anomalies
        if trainer.dist.is_main and self.cfg.report and self.run_dir is not None:
            try:
                require("matplotlib", "report", "report.html")
            except MissingExtra as err:  # the run succeeded; the page can be written later
                print(f"vatra: report.html not written: {err}", flush=True)
                return
            report_after_training(self.run_dir.path, summary, self.run_dir.log_event)  # never fails the run

    def on_failure(self, trainer: Trainer, exc: BaseException) -> None:
        # No report here: rendering takes seconds, and while rank 0 plots, its peers wait and the
        # elastic agent cannot restart the group. `vatra train` writes it once the workers are gone.
        self._close()
