"""The checkpoint plugin: periodic, final and preemption checkpoints, resume, and the recovery record.

It implements the engine's ``Checkpointer`` protocol and registers itself as
``trainer.state.checkpointer`` so other plugins (healing) can ``save``/``restore`` without importing
this package. Both calls are collective: every rank must make them at the same point.

No folder is shared between ranks: each stages its own files under ``<run>/checkpoints/.work/rank<r>``
and uploads them itself; rank 0 writes the manifest once every rank's files are in the store. On
resume each rank fetches only what its own load reads, on any world size (:mod:`.snapshot`).
"""

from __future__ import annotations

import math
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from vatra.engine import Plugin
from vatra.errors import ConfigError, VatraError
from vatra.resilience import recovery, snapshot
from vatra.resilience.faults import corrupt_version, fired_steps
from vatra.resilience.ranks import CheckpointWriteError, RankGroups, disk_full, first_failure, save_failure
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
        if self.thread is None or not self.thread.is_alive():
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
        }
        parent, self.parent, self.saved_step = self.parent, version, st.step
        job = (state, own, version, parent, info, ctx.is_main)
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
        own: dict[str, bytes],
        version: str,
        parent: str | None,
        info: dict[str, Any],
        main: bool,
    ) -> None:
        """Every rank writes its DCP shard to its own staging folder and uploads it with its own
        files; rank 0 gathers the entries and writes the manifest; every rank learns the outcome."""
        folder = self.stage / version
        entries: dict[str, dict[str, Any]] = {}
        failure: BaseException | None = None
        full = False
        try:
            snapshot.dcp_save(state, folder, self.ranks.data)  # collective: fails on every rank alike
            for path in sorted(folder.rglob("*")):
                if path.is_file():
                    digest, size = self.store.put_file(path)
                    entries[path.relative_to(folder).as_posix()] = {"sha256": digest, "size": size}
            for name, data in own.items():
                entries[name] = {"sha256": self.store.put_object(data), "size": len(data)}
        except (Exception, CheckpointException) as err:  # agreed on below, then raised on every rank
            failure, full = err, disk_full(folder)
        finally:
            shutil.rmtree(folder, ignore_errors=True)  # uploaded, or a failed write's leftovers
        mine = save_failure(failure, folder, full) if failure is not None else entries
        gathered = self.ranks.gather(mine)
        outcome: str | None = None
        if main:
            outcome = next((g for g in gathered if isinstance(g, str)), None)
            if outcome is None:
                stored = {name: entry for g in gathered for name, entry in g.items()}
                try:
                    self._publish(stored, version, parent, info)
                except Exception as err:
                    outcome = save_failure(err, folder, False)
        outcome = self.ranks.bcast(outcome, self.ranks.data)
        if outcome is not None:
            where = parent or "the start"
            raise CheckpointWriteError(
                f"saving checkpoint {version} (step {info['step']}) failed: {outcome}; the versions "
                f"already stored are intact: run the same command again to resume from {where}"
            ) from failure

    def _publish(self, stored: dict[str, dict[str, Any]], version: str, parent: str | None,
                 info: dict[str, Any]) -> None:  # fmt: skip
        """Rank 0, once every rank's files are in the store: the manifest, then pruning."""
        manifest = self.store.write_version(
            {},
            stored=stored,
            step=info["step"],
            parent=parent,
            world_size=info["world_size"],
            metrics=info["metrics"],
            tags=info["tags"],
            version=version,
            extra={"reason": info["reason"], "attempt": self.attempt},
        )
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
            try:
                self.store.gc(self.cfg.keep_last, damaged=self.damaged)
            except StoreError as err:  # nothing was deleted that is still needed; the run goes on
                self.run_dir.log_event(
                    "gc_aborted", rank=0, step=info["step"], version=version, reason=str(err)
                )

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
        """The newest intact version from ``start`` on, into the trainer; None when none is intact.

        Rank 0 proposes versions in order (``start``, its parents, then the others newest first);
        each rank fetches and verifies what its own load needs; all agree before anything is
        loaded, so a version damaged for one rank is skipped by all.
        """
        proposals = self._candidates(trainer, start) if trainer.dist.is_main else None
        manifest: Manifest | None = None
        problem: str | None = None
        # Planning a load (snapshot.dcp_files) makes DCP initialise an empty optimizer state with a
        # zero-gradient step (Adam's step count becomes 1): undone when nothing gets loaded, so a
        # run that finds no intact version starts exactly as a fresh one.
        fresh = not trainer.optimizer.state

        def propose() -> Manifest | None:  # rank 0, inside an agreement: its errors reach every rank
            assert proposals is not None
            if manifest is not None and problem is not None:
                self.damaged.add(manifest["version"])
                trainer.log_event("checkpoint_corrupt", version=manifest["version"], problem=problem,
                                  action="fall back to parent")  # fmt: skip
            return next(proposals, None)

        dest = self.stage / "restore"
        while True:
            manifest = self.ranks.on_main(propose)
            if manifest is None:
                if fresh:
                    trainer.optimizer.state.clear()
                return None
            shutil.rmtree(dest, ignore_errors=True)
            found = self.ranks.agree(self._fetch(trainer, manifest, dest))
            if found is None:
                break
            damaged, problem = found
            if not damaged:
                raise ConfigError(f"checkpoint {manifest['version']} does not fit this run: {problem}")
        try:
            self._apply(trainer, manifest, dest)
        finally:
            shutil.rmtree(dest, ignore_errors=True)
        self.parent = manifest["version"]
        return manifest

    def _candidates(self, trainer: Trainer, start: str) -> Iterator[Manifest]:
        """Rank 0: readable manifests from ``start`` down its parents, then the rest newest first;
        an unreadable one is logged as ``checkpoint_corrupt`` and passed over."""
        by_id = {m["version"]: m for m in self.store.versions()}
        try:
            ref: str | None = self.store.resolve(start)
        except StoreError as err:  # with versions present: a damaged or deleted tag
            if by_id:
                trainer.log_event(
                    "checkpoint_corrupt", version=start, problem=str(err), action="try older versions"
                )
            ref = None
        chain: list[str] = []
        while ref is not None and ref not in chain:
            chain.append(ref)
            ref = by_id.get(ref, {}).get("parent")
        chain += [v for v in reversed(list(by_id)) if v not in chain]
        for version in chain:
            if version in by_id:
                yield by_id[version]
                continue
            try:
                yield self.store.manifest(version)
            except StoreError as err:
                trainer.log_event("checkpoint_corrupt", version=version, problem=str(err),
                                  action="fall back to parent")  # fmt: skip

    def _fetch(self, trainer: Trainer, manifest: Manifest, dest: Path) -> tuple[bool, str] | None:
        """This rank's files of ``manifest`` under ``dest``, checksums verified; else (damaged, why):
        a missing or corrupt file (fall back to an older version) or a version this model cannot
        load (stop).

        The DCP metadata first, then the data files this rank's load plan reads, then its own
        rank file — or, after a world-size change, every old rank's rank and shard files.
        """
        try:
            self.store.fetch(manifest, [snapshot.DCP_METADATA], dest)
            names = snapshot.dcp_files(trainer, dest) + snapshot.rank_names(
                manifest, trainer.dist, trainer.parallel is not None
            )
            self.store.fetch(manifest, names, dest)
        except StoreError as err:
            return True, str(err)
        except Exception as err:  # DCP's planner: keys or shapes this model does not have
            return False, f"{type(err).__name__}: {err}"
        return None

    def _apply(self, trainer: Trainer, manifest: Manifest, folder: Path) -> None:
        """Collective: load the fetched version; a load that does not fit stops every rank alike."""
        ctx, version = trainer.dist, manifest["version"]
        saved = int(manifest["world_size"])
        try:
            snapshot.dcp_load(trainer, folder, self.ranks.data)
        except CheckpointException as err:  # raised on every rank: DCP gathers the failures
            raise ConfigError(f"checkpoint {version} does not fit this model: {first_failure(err)}") from None
        problem: str | None = None
        dropped: list[str] = []
        try:
            dropped = snapshot.load_rank_files(trainer, manifest, folder)
        except ConfigError as err:
            problem = str(err)
        problem = self.ranks.agree(problem)
        if problem is not None:
            raise ConfigError(problem)
        if saved != ctx.world_size:
            self.ranks.on_main(lambda: trainer.log_event(
                "resharded", version=version, from_world_size=saved, to_world_size=ctx.world_size,
                dropped=dropped,
            ))  # fmt: skip

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
        return step + int(self.ranks.bcast(interval))

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
        if self.ranks.ctl is None:
            return local
        stop = False
        if self.stop_work is not None:
            self.stop_work.wait()
            stop = bool(self.stop_flag is not None and self.stop_flag.item())
        self.stop_flag = torch.tensor([int(local)], dtype=torch.int32)
        self.stop_work = dist.all_reduce(
            self.stop_flag, op=dist.ReduceOp.MAX, group=self.ranks.ctl, async_op=True
        )
        return stop

    def _drain_stop_flag(self) -> None:
        if self.stop_work is not None:
            self.stop_work.wait()
            self.stop_work = None
