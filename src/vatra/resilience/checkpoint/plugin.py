"""The checkpoint plugin: periodic, final and preemption checkpoints, resume, and the recovery record.

It implements the engine's ``Checkpointer`` protocol and registers itself as
``trainer.state.checkpointer`` so other plugins (healing) can ``save``/``restore`` without importing
this package. Both calls are collective: every rank must make them at the same point.

The parts, one module each: :mod:`.schedule` (when to save), :mod:`.writer` (a version to the store,
inline or on a thread), :mod:`.loader` (the newest intact version, with fallback), :mod:`.preemption`
(the agreement on a preemption notice), :mod:`.notice` (the metadata endpoint and file watcher);
``chaos.corrupt_checkpoint_at`` is :mod:`vatra.resilience.chaos.storage`'s.
"""

from __future__ import annotations

import shutil
import time
from typing import TYPE_CHECKING, Any

from vatra.engine import Plugin
from vatra.engine.phases import phase
from vatra.resilience import recovery, snapshot
from vatra.resilience.chaos import CheckpointCorruptor
from vatra.resilience.checkpoint.loader import VersionLoader
from vatra.resilience.checkpoint.notice import Notice, NoticeWatcher
from vatra.resilience.checkpoint.preemption import PeerPreempted, Preempted, StopAgreement, mark_node_leaving
from vatra.resilience.checkpoint.ranks import RankGroups
from vatra.resilience.checkpoint.schedule import (
    StepClock,
    first_save_step,
    fixed_next_step,
    interval_report,
    mean_cost,
    observed_mtbf,
    young_daly_steps,
)
from vatra.resilience.checkpoint.writer import VersionWriter
from vatra.resilience.store import LAST_GOOD, LATEST, CheckpointStore, Manifest, StoreError, open_store

if TYPE_CHECKING:
    from vatra.config import Config
    from vatra.engine import Trainer
    from vatra.rundir import RunDir


class CheckpointPlugin(Plugin):
    """Saves full training state to the versioned store and resumes from it.

    Saves: every ``checkpoint.every_steps`` steps (or the Young/Daly interval), at the end of the
    run, and at the first step boundary after a preemption notice (SIGTERM, ``spot.notice_url``,
    ``spot.notice_file``), then exits. Resumes in ``on_fit_start``
    from the newest intact version (``latest``, else its parents), so the Trainer's loop simply
    continues from ``trainer.state.step``.
    """

    def __init__(self, cfg: Config, run_dir: RunDir) -> None:
        self.cfg = cfg.checkpoint
        self.spot = cfg.spot
        self.run_dir = run_dir
        self.store: CheckpointStore = open_store(cfg.store, run_dir.checkpoints)
        # DCP writes and reads local files: each rank stages its own under .work/rank<r>, in the run
        # folder of the host it runs on (one run folder per host needs no shared filesystem)
        self.work_dir = run_dir.checkpoints / ".work"
        self.stage = self.work_dir / "rank00000"
        self.parent: str | None = None
        self.damaged: set[str] = set()  # versions a resume fell back past (rank 0): gc keeps them aside
        self.attempt = 0
        self.saved_step = -1  # step of the newest save (avoids a second save at the same step)
        self.next_save = 0
        self.costs: list[float] = []  # seconds the training loop was blocked per save
        self.ranks = RankGroups()  # the plugin's own gloo groups and the agreements on them
        self.corruptor = CheckpointCorruptor(cfg.chaos.corrupt_checkpoint_at, run_dir)
        self.writer = VersionWriter(
            self.store, self.ranks, run_dir, self.cfg.keep_last, self.damaged, self.corruptor
        )
        self.loader = VersionLoader(self.store, self.ranks, self.damaged)
        self.stop = StopAgreement(cfg.spot.window_s())
        self.watcher: NoticeWatcher | None = None
        self.preempted: str | None = None  # why the run stops: the notice and the version saved
        self.clock = StepClock()  # recent time per step, for the auto interval
        self.interval: dict[str, float] | None = None  # the auto interval's latest figures (rank 0)
        self.start_train_s = 0.0  # trainer.state.train_time_s when this attempt started
        self.progress: recovery.ProgressFile | None = None
        self.recovery: dict[str, Any] | None = None  # pending `recovered` event, logged after one step
        self.used_ids: set[str] = set()
        self.host_buffers: snapshot.StateDict | None = None  # async: host copies reused across saves

    # ------------------------------------------------------------ lifecycle
    def on_fit_start(self, trainer: Trainer) -> None:
        trainer.state.checkpointer = self
        ctx = trainer.dist
        if ctx.distributed:
            self.ranks.create()
        self.stage = self.work_dir / f"rank{ctx.rank:05d}"
        self._remove_leftovers(ctx.rank, ctx.world_size)
        events = recovery.read_events(self.run_dir) if ctx.is_main else []
        self.attempt = int(self.ranks.bcast(recovery.previous_attempts(events)))
        if ctx.is_main:
            trainer.log_event("attempt_start", attempt=self.attempt, world_size=ctx.world_size)
        self.progress = recovery.ProgressFile(self.run_dir.path, ctx.rank, self.attempt)
        if self.cfg.resume:
            self._resume(trainer, events)
        if self.cfg.on_sigterm:
            self.stop.install()
        if self.spot.watches() and ctx.local_rank == 0:  # one watcher per node
            self.watcher = NoticeWatcher(
                self.spot,
                self.stop.request,
                lambda reason: self.run_dir.log_event(
                    "preemption_notice_ignored", rank=ctx.rank, source=self.spot.notice_url, reason=reason
                ),
            )
            self.watcher.start()
        self.start_train_s = trainer.state.train_time_s
        if ctx.is_main:
            self.corruptor.skip_fired()
        self.saved_step = trainer.state.step if self.parent else -1
        self.next_save = first_save_step(self.cfg.every_steps, trainer.state.step)

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        step = trainer.state.step
        metrics["attempt"] = self.attempt
        assert self.progress is not None
        self.progress.update(step)
        if self.recovery is not None:
            self._log_recovery(trainer)
        self.clock.observe(float(metrics.get("step_time_s", 0.0)))
        notice = self.stop.agree(self.ranks.ctl)
        if notice is not None:
            # Save now; the loop ends after this step (so its metrics line is still written) and
            # on_fit_end raises Preempted instead of finishing the run.
            self._save_before_preemption(trainer, notice, metrics)
            metrics["checkpoint_s"] = self.costs[-1]  # the loop's stall (the run's ETTR counts it)
            trainer.state.should_stop = True
            return
        if self.next_save and step >= self.next_save:
            with phase("checkpoint"):
                self.save(trainer, reason="periodic", metrics=metrics)
            metrics["checkpoint_s"] = self.costs[-1]
            self.next_save = self._next_save_step(trainer)

    def on_fit_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        try:
            if self.preempted is not None:
                self.stop.drain()
                if not self.stop.node_noticed(self.ranks.ctl):  # another node's notice: this one stays
                    raise PeerPreempted(f"{self.preempted}; the group re-forms on the nodes left")
                raise Preempted(f"{self.preempted}; run the same command with --run-dir to resume")
            if trainer.state.step != self.saved_step:
                self.save(trainer, reason="final", metrics=trainer.state.last_metrics)
            self.wait()
            self.stop.drain()
            if trainer.dist.is_main:
                restarts, lost = recovery.totals(recovery.read_events(self.run_dir))
                summary.update(restarts=restarts, steps_lost=lost, checkpoint_s=sum(self.costs))
                summary.update(self._interval_summary(trainer))
        finally:
            self._close()

    def on_failure(self, trainer: Trainer, exc: BaseException) -> None:
        # No waiting on an upload in flight: its collectives may need a rank that is gone. A version
        # becomes visible only once its manifest is written, so a half save is never resumed from.
        if not self.writer.busy():
            shutil.rmtree(self.stage, ignore_errors=True)  # else the next start removes it
        self._close()

    def _remove_leftovers(self, rank: int, world_size: int) -> None:
        """A killed or failed save's staging files: this rank's own, and (rank 0) those of ranks
        this run does not have and of older layouts; nothing another live rank may be using."""
        shutil.rmtree(self.stage, ignore_errors=True)
        if rank != 0 or not self.work_dir.is_dir():
            return
        ours = {f"rank{r:05d}" for r in range(world_size)}
        for path in self.work_dir.iterdir():
            if path.name in ours:
                continue
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)

    def _close(self) -> None:
        self.stop.uninstall()
        if self.watcher is not None:
            self.watcher.stop()
            self.watcher = None
        if self.progress is not None:
            self.progress.close()
            self.progress = None

    # ------------------------------------------------------- Checkpointer API
    def save(
        self,
        trainer: Trainer,
        *,
        tags: tuple[str, ...] = (),
        reason: str = "manual",
        metrics: dict[str, Any] | None = None,
    ) -> str:
        """Collective: write a full checkpoint of the current step; returns its version id.

        Sync: returns when the version is in the store. Async: returns after the host copy; the
        DCP write and the upload finish on a background thread (``wait()`` joins it).
        """
        t0 = time.perf_counter()
        self.wait()  # one save in flight at a time; time spent here counts as blocked
        st, ctx = trainer.state, trainer.dist
        version = self._version_id(st.step)
        own = snapshot.rank_files(trainer)  # RNG and data position of this step: taken now
        state = snapshot.model_optim_state(trainer)
        if self.cfg.async_:
            # NOTE: the only part of an async save the loop waits for; buffers reused from the last one
            state = self.host_buffers = snapshot.copy_state(state, self.host_buffers, device="cpu")
        tags = (*tags, LAST_GOOD) if st.healthy else tags
        record = {
            k: v for k, v in (metrics or {}).items() if isinstance(v, int | float) and not isinstance(v, bool)
        }
        record.update(st.last_eval)
        info = {
            "step": st.step,
            "tags": tags,
            "reason": reason,
            "metrics": record,
            "world_size": ctx.world_size,
            "attempt": self.attempt,
        }
        parent, self.parent, self.saved_step = self.parent, version, st.step
        job = (state, own, self.stage / version, version, parent, info, ctx.is_main)
        self.writer.write(job, background=self.cfg.async_)
        self.costs.append(time.perf_counter() - t0)
        return version

    def restore(self, trainer: Trainer, version: str = LAST_GOOD) -> dict[str, Any]:
        """Collective: load ``version`` (id or tag), or its newest intact ancestor, into the trainer.

        Everything is restored, the step counters included, so the loop continues from the
        restored step. Returns the manifest; raises :class:`StoreError` when nothing is intact.
        """
        self.wait()  # the upload thread's collectives are done before the load's begin
        manifest = self._load(trainer, version)
        if manifest is None:
            raise StoreError(
                f"no intact checkpoint to restore ({version!r} and its ancestors are damaged or absent)"
            )
        return manifest

    def wait(self) -> None:
        """Block until the background save (if any) is done; re-raise its error on this thread.

        Every rank's save ends with the same outcome (rank 0 broadcasts it), so an error is raised
        on every rank alike: no rank goes on to a collective its peers have left.
        """
        self.writer.wait()

    def _version_id(self, step: int) -> str:
        """Deterministic on every rank (no collective needed): step, attempt, and a counter if repeated."""
        base = f"s{step:07d}-a{self.attempt}"
        version, n = base, 1
        while version in self.used_ids:
            version, n = f"{base}.{n}", n + 1
        self.used_ids.add(version)
        return version

    def _load(self, trainer: Trainer, start: str) -> Manifest | None:
        """The newest intact version from ``start`` on, into the trainer (it becomes the next save's
        parent); None when none is intact."""
        manifest = self.loader.load(trainer, start, self.stage / "restore")
        if manifest is not None:
            self.parent = manifest["version"]
        return manifest

    def _resume(self, trainer: Trainer, events: list[dict[str, Any]]) -> None:
        """Continue from the newest intact version, if any, and prepare the recovery record."""
        if not self.ranks.on_main(lambda: bool(self.store.backend.keys("versions/"))):
            return
        failed_step = recovery.last_progress(self.run_dir.path)
        manifest = self._load(trainer, LATEST)
        if manifest is None or not trainer.dist.is_main:
            return
        failures = recovery.failures_since_last_attempt(events)
        lost = max(0, (failed_step or manifest["step"]) - manifest["step"])
        self.recovery = {
            "version": manifest["version"],
            "resumed_step": manifest["step"],
            "failed_step": failed_step,
            "steps_lost": lost,
            "failures": [{k: f.get(k) for k in ("rank", "exit_code", "signal", "step")} for f in failures],
            # the dead rank's last completed step (else the agent's report, up to a few seconds later)
            "death_time": (failures[0].get("last_step_time") or failures[0]["time"]) if failures else None,
        }
        trainer.log_event(  # the console's line: from where, after what, on how many ranks
            "resume",
            version=manifest["version"],
            resumed_step=manifest["step"],
            steps_lost=lost,
            world_size=trainer.dist.world_size,
            saved_world_size=manifest.get("world_size"),
            failures=self.recovery["failures"],
        )

    def _log_recovery(self, trainer: Trainer) -> None:
        """After the first step completed since the resume: how long the whole recovery took."""
        rec, self.recovery = self.recovery, None
        assert rec is not None
        death = rec.pop("death_time")
        kind = "recovered" if rec["failures"] else "resumed"
        seconds = time.time() - death if death is not None else None
        trainer.log_event(kind, **rec, recovery_s=seconds)

    # ----------------------------------------------------------- preemption
    def _save_before_preemption(self, trainer: Trainer, notice: Notice, metrics: dict[str, Any]) -> None:
        """The notice's checkpoint, timed against its window; logged as two events (rank 0)."""
        is_main, step = trainer.dist.is_main, trainer.state.step
        window = notice.deadline - notice.seen_at
        if self.stop.notice is not None:  # this rank saw it: its node goes away after the save
            mark_node_leaving()
        if is_main:
            trainer.log_event(
                "preemption_notice", source=notice.source, detail=notice.detail, window_s=window,
                seen_s_ago=time.time() - notice.seen_at,
            )  # fmt: skip
        t0 = time.perf_counter()
        version = self.save(
            trainer, reason="sigterm" if notice.source == "sigterm" else "notice", metrics=metrics
        )
        self.wait()  # async or not, the version must be in the store before the machine goes
        done, save_s = time.time(), time.perf_counter() - t0
        took, fit = done - notice.seen_at, done <= notice.deadline
        if is_main:
            trainer.log_event(
                "preemption_checkpoint", version=version, source=notice.source, save_s=save_s,
                seconds=took, window_s=window, fit=fit,
            )  # fmt: skip
        what = "SIGTERM" if notice.source == "sigterm" else f"preemption notice ({notice.detail})"
        self.preempted = (
            f"{what} at step {step}: saved checkpoint {version} {took:.1f} s after the notice "
            f"({'within' if fit else 'PAST'} its {window:.0f} s window)"
        )

    # ------------------------------------------------------------- schedule
    def _next_save_step(self, trainer: Trainer) -> int:
        every = self.cfg.every_steps
        step = trainer.state.step
        if every != "auto":
            return fixed_next_step(every, step)
        interval = 0
        if trainer.dist.is_main:  # ranks measure slightly different figures: rank 0 decides for all
            step_s = self.clock.step_s or trainer.state.train_time_s / max(1, step)
            prior = self.spot.mtbf_s if self.spot.mtbf_s is not None else self.cfg.mtbf_s
            mtbf = observed_mtbf(self.run_dir, prior)
            interval = young_daly_steps(self.costs, step_s, mtbf)
            figures = interval_report(interval, step_s, mean_cost(self.costs), mtbf)
            trainer.log_event("checkpoint_interval", **figures)  # once per save: as often as C is measured
            self.interval = figures
        return step + int(self.ranks.bcast(interval))

    def _interval_summary(self, trainer: Trainer) -> dict[str, float | None]:
        """``checkpoint_interval_s`` (the auto interval's latest, else every_steps in seconds) and
        ``checkpoint_overhead`` (this attempt's blocking save time over its training time)."""
        every = self.cfg.every_steps
        step_s = self.clock.step_s or 0.0
        if self.interval is not None:
            interval_s: float | None = self.interval["interval_s"]
        else:
            interval_s = every * step_s if isinstance(every, int) and every else None
        trained = trainer.state.train_time_s - self.start_train_s
        return {
            "checkpoint_interval_s": interval_s,
            "checkpoint_overhead": sum(self.costs) / trained if trained else 0.0,
        }
