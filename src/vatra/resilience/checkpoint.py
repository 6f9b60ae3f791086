"""The checkpoint plugin: periodic, final and preemption checkpoints, resume, and the recovery record.

It implements the engine's ``Checkpointer`` protocol and registers itself as
``trainer.state.checkpointer`` so other plugins (healing) can ``save``/``restore`` without importing
this package. Both calls are collective: every rank must make them at the same point.
"""

from __future__ import annotations

import math
import shutil
import signal
import threading
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from vatra.engine import Plugin
from vatra.errors import ConfigError, VatraError
from vatra.resilience import recovery, snapshot
from vatra.resilience.faults import corrupt_version, fired_steps
from vatra.resilience.store import LAST_GOOD, LATEST, CheckpointStore, Manifest, StoreError, open_store

if TYPE_CHECKING:
    from vatra.config import Config
    from vatra.engine import Trainer
    from vatra.rundir import RunDir

AUTO_FIRST_STEP = 10  # every_steps = "auto": the first save, which measures the checkpoint cost C


class Preempted(VatraError):
    """SIGTERM arrived; a checkpoint was written and the worker exits (128 + SIGTERM, like a shell)."""

    exit_code = 143


class CheckpointPlugin(Plugin):
    """Saves full training state to the versioned store and resumes from it.

    Saves: every ``checkpoint.every_steps`` steps (or the Young/Daly interval), at the end of the
    run, and at the first step boundary after SIGTERM (then exits). Resumes in ``on_fit_start``
    from the newest intact version (``latest``, else its parents), so the Trainer's loop simply
    continues from ``trainer.state.step``.
    """

    def __init__(self, cfg: Config, run_dir: RunDir) -> None:
        self.cfg = cfg.checkpoint
        self.corrupt_at = set(cfg.chaos.corrupt_checkpoint_at)
        self.run_dir = run_dir
        self.store: CheckpointStore = open_store(cfg.store, run_dir.checkpoints)
        self.work_dir = run_dir.checkpoints / ".work"  # DCP writes and reads a local folder
        self.parent: str | None = None
        self.attempt = 0
        self.saved_step = -1  # step of the newest save (avoids a second save at the same step)
        self.next_save = 0
        self.costs: list[float] = []  # seconds the training loop was blocked per save
        self.group: dist.ProcessGroup | None = None  # DCP's collectives (also from the upload thread)
        self.ctl_group: dist.ProcessGroup | None = None  # the SIGTERM agreement all-reduce
        self.thread: threading.Thread | None = None
        self.thread_error: BaseException | None = None
        self.sigterm_at: float | None = None
        self.preempted: str | None = None  # version saved on SIGTERM
        self.stop_flag: torch.Tensor | None = None
        self.stop_work: Any = None
        self.old_handler: Any = None
        self.progress: recovery.ProgressFile | None = None
        self.recovery: dict[str, Any] | None = None  # pending `recovered` event, logged after one step
        self.used_ids: set[str] = set()
        self.host_buffers: snapshot.StateDict | None = None  # async: host copies reused across saves

    # ------------------------------------------------------------ lifecycle
    def on_fit_start(self, trainer: Trainer) -> None:
        trainer.state.checkpointer = self
        ctx = trainer.dist
        if ctx.distributed:
            # Separate gloo groups: the upload thread's DCP collectives must not interleave with
            # DDP's all-reduce on the default group, nor with the per-step SIGTERM agreement.
            self.group = dist.new_group(backend="gloo")
            self.ctl_group = dist.new_group(backend="gloo")
        events = recovery.read_events(self.run_dir) if ctx.is_main else []
        self.attempt = int(self._bcast(recovery.previous_attempts(events)))
        if ctx.is_main:
            trainer.log_event("attempt_start", attempt=self.attempt, world_size=ctx.world_size)
        self.progress = recovery.ProgressFile(self.run_dir.path, ctx.rank, self.attempt)
        if self.cfg.resume:
            self._resume(trainer, events)
        if self.cfg.on_sigterm and threading.current_thread() is threading.main_thread():
            self.old_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
        self.corrupt_at -= fired_steps(self.run_dir, "chaos_corrupt") if ctx.is_main else set()
        self.saved_step = trainer.state.step if self.parent else -1
        self.next_save = self._first_save_step(trainer.state.step)

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        step = trainer.state.step
        metrics["attempt"] = self.attempt
        assert self.progress is not None
        self.progress.update(step)
        if self.recovery is not None:
            self._log_recovery(trainer)
        if self._agree_stop(trainer):
            # Save now; the loop ends after this step (so its metrics line is still written) and
            # on_fit_end raises Preempted instead of finishing the run.
            self.preempted = self.save(trainer, reason="sigterm", metrics=metrics)
            self.wait()
            trainer.state.should_stop = True
            return
        if self.next_save and step >= self.next_save:
            self.save(trainer, reason="periodic", metrics=metrics)
            self.next_save = self._next_save_step(trainer)

    def on_fit_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        try:
            if self.preempted is not None:
                self._drain_stop_flag()
                raise Preempted(
                    f"SIGTERM at step {trainer.state.step}: saved checkpoint {self.preempted}; "
                    "run the same command with --run-dir to resume"
                )
            if trainer.state.step != self.saved_step:
                self.save(trainer, reason="final", metrics=trainer.state.last_metrics)
            self.wait()
            self._drain_stop_flag()
            if trainer.dist.is_main:
                restarts, lost = recovery.totals(recovery.read_events(self.run_dir))
                summary.update(restarts=restarts, steps_lost=lost, checkpoint_s=sum(self.costs))
        finally:
            self._close()

    def on_failure(self, trainer: Trainer, exc: BaseException) -> None:
        # No waiting on an upload in flight: its collectives may need a rank that is gone. A version
        # becomes visible only once its manifest is written, so a half save is never resumed from.
        self._close()

    def _close(self) -> None:
        if self.old_handler is not None:
            signal.signal(signal.SIGTERM, self.old_handler)
            self.old_handler = None
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
        folder = self.work_dir / version
        folder.mkdir(parents=True, exist_ok=True)
        (folder / snapshot.rank_file(ctx.rank)).write_bytes(snapshot.rank_state(trainer))
        state = snapshot.model_optim_state(trainer)
        if self.cfg.async_:
            # NOTE: the only part of an async save the loop waits for; buffers reused from the last one
            state = self.host_buffers = snapshot.host_copy(state, self.host_buffers)
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
        }
        parent, self.parent, self.saved_step = self.parent, version, st.step
        job = (state, folder, version, parent, info, ctx.is_main)
        if self.cfg.async_:
            self.thread = threading.Thread(
                target=self._finish_guarded, args=job, name="vatra-ckpt", daemon=True
            )
            self.thread.start()
        else:
            self._finish(*job)
        self.costs.append(time.perf_counter() - t0)
        return version

    def restore(self, trainer: Trainer, version: str = LAST_GOOD) -> dict[str, Any]:
        """Collective: load ``version`` (id or tag), or its newest intact ancestor, into the trainer.

        Everything is restored, the step counters included, so the loop continues from the
        restored step. Returns the manifest; raises :class:`StoreError` when nothing is intact.
        """
        self.wait()
        manifest = self._load(trainer, version)
        if manifest is None:
            raise StoreError(
                f"no intact checkpoint to restore ({version!r} and its ancestors are damaged or absent)"
            )
        return manifest

    def wait(self) -> None:
        """Block until the background save (if any) is done; re-raise its error on this thread."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.thread_error is not None:
            err, self.thread_error = self.thread_error, None
            raise err

    # ----------------------------------------------------------- save helpers
    def _finish_guarded(self, *job: Any) -> None:
        try:
            self._finish(*job)
        except BaseException as err:  # surfaced by wait() on the training thread
            self.thread_error = err

    def _finish(
        self,
        state: snapshot.StateDict,
        folder: Path,
        version: str,
        parent: str | None,
        info: dict[str, Any],
        main: bool,
    ) -> None:
        """DCP write (collective), then rank 0 stores the files as a version and prunes old ones."""
        snapshot.dcp_save(state, folder, self.group)
        if not main:
            return
        files: dict[str, bytes | Path] = {
            p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*")) if p.is_file()
        }
        manifest = self.store.write_version(
            files,
            step=info["step"],
            parent=parent,
            world_size=info["world_size"],
            metrics=info["metrics"],
            tags=info["tags"],
            version=version,
            extra={"reason": info["reason"], "attempt": self.attempt},
        )
        shutil.rmtree(folder, ignore_errors=True)
        size = sum(e["size"] for e in manifest["files"].values())
        self.run_dir.log_event(
            "checkpoint_saved", rank=0, step=info["step"], version=version, bytes=size,
            reason=info["reason"], tags=manifest["tags"],
        )  # fmt: skip
        if info["step"] in self.corrupt_at:
            self.corrupt_at.discard(info["step"])
            self.run_dir.log_event(
                "chaos_corrupt",
                rank=0,
                step=info["step"],
                version=version,
                file=corrupt_version(self.store, manifest),
            )
        if self.cfg.keep_last:
            self.store.gc(self.cfg.keep_last)

    def _version_id(self, step: int) -> str:
        """Deterministic on every rank (no collective needed): step, attempt, and a counter if repeated."""
        base = f"s{step:07d}-a{self.attempt}"
        version, n = base, 1
        while version in self.used_ids:
            version, n = f"{base}.{n}", n + 1
        self.used_ids.add(version)
        return version

    # ----------------------------------------------------------- load helpers
    def _load(self, trainer: Trainer, start: str) -> Manifest | None:
        """Rank 0 fetches and verifies; every rank reads the verified local copy."""
        ctx = trainer.dist
        manifest: Manifest | None = None
        if ctx.is_main:
            shutil.rmtree(self.work_dir / "restore", ignore_errors=True)

            def bad(version: str, problem: str) -> None:
                trainer.log_event(
                    "checkpoint_corrupt", version=version, problem=problem, action="fall back to parent"
                )

            manifest = self.store.load_verified(self.work_dir / "restore", start, on_bad=bad)
        manifest = self._bcast(manifest)
        if manifest is None:
            return None
        if manifest["world_size"] != ctx.world_size:
            raise ConfigError(
                f"checkpoint {manifest['version']} was written by {manifest['world_size']} rank(s) but "
                f"this run has {ctx.world_size}: each rank's sampler position and RNG state belong to its "
                f"own data shard, so resume with --nproc {manifest['world_size']} "
                "(or set checkpoint.resume=false)"
            )
        folder = self.work_dir / "restore" / manifest["version"]
        snapshot.dcp_load(trainer, folder, self.group)
        snapshot.load_rank_state(trainer, (folder / snapshot.rank_file(ctx.rank)).read_bytes())
        self._barrier()
        if ctx.is_main:
            shutil.rmtree(folder, ignore_errors=True)
        self.parent = manifest["version"]
        return manifest

    def _resume(self, trainer: Trainer, events: list[dict[str, Any]]) -> None:
        """Continue from the newest intact version, if any, and prepare the recovery record."""
        has_versions = bool(
            self._bcast(bool(self.store.tags().get(LATEST)) if trainer.dist.is_main else None)
        )
        if not has_versions:
            return
        failed_step = recovery.last_progress(self.run_dir.path, trainer.dist.world_size)
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
        trainer.log_event(
            "resume", version=manifest["version"], resumed_step=manifest["step"], steps_lost=lost
        )

    def _log_recovery(self, trainer: Trainer) -> None:
        """After the first step completed since the resume: how long the whole recovery took."""
        rec, self.recovery = self.recovery, None
        assert rec is not None
        death = rec.pop("death_time")
        kind = "recovered" if rec["failures"] else "resumed"
        seconds = time.time() - death if death is not None else None
        trainer.log_event(kind, **rec, recovery_s=seconds)

    # ------------------------------------------------------------- schedule
    def _first_save_step(self, step: int) -> int:
        every = self.cfg.every_steps
        if every == "auto":
            return step + AUTO_FIRST_STEP
        return (step // every + 1) * every if every else 0

    def _next_save_step(self, trainer: Trainer) -> int:
        every = self.cfg.every_steps
        step = trainer.state.step
        if every != "auto":
            return (step // every + 1) * every if every else 0
        # Young/Daly: the interval that minimises expected lost + checkpoint time is sqrt(2·MTBF·C).
        cost = sum(self.costs[-3:]) / len(self.costs[-3:])
        step_s = trainer.state.train_time_s / max(1, step)
        interval = max(1, round(math.sqrt(2.0 * self._mtbf() * cost) / max(step_s, 1e-9)))
        # Ranks measure slightly different costs: rank 0 decides so that every rank saves together.
        return step + int(self._bcast(interval))

    def _mtbf(self) -> float:
        """Observed mean time between failures in this run folder, else ``checkpoint.mtbf_s``."""
        events = recovery.read_events(self.run_dir)
        restarts, _ = recovery.totals(events)
        if restarts == 0 or not events:
            return self.cfg.mtbf_s
        return (time.time() - float(events[0]["time"])) / restarts

    # ------------------------------------------------------------- SIGTERM
    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self.sigterm_at = time.time()  # acted on at the next step boundary; a handler must stay tiny

    def _agree_stop(self, trainer: Trainer) -> bool:
        """True on every rank at the same step once any rank got SIGTERM.

        Distributed: an async MAX all-reduce of the flag, started each step and read one step later,
        so the loop never waits for it; all ranks read the same reduction at the same boundary.
        """
        local = self.sigterm_at is not None
        if self.ctl_group is None:
            return local
        stop = False
        if self.stop_work is not None:
            self.stop_work.wait()
            stop = bool(self.stop_flag is not None and self.stop_flag.item())
        self.stop_flag = torch.tensor([int(local)], dtype=torch.int32)
        self.stop_work = dist.all_reduce(
            self.stop_flag, op=dist.ReduceOp.MAX, group=self.ctl_group, async_op=True
        )
        return stop

    def _drain_stop_flag(self) -> None:
        if self.stop_work is not None:
            self.stop_work.wait()
            self.stop_work = None

    # ------------------------------------------------------ small collectives
    def _bcast(self, obj: Any) -> Any:
        if self.ctl_group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.ctl_group)
        return box[0]

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)
