"""Writing a version: each rank's DCP shard and own files to the store, the manifest by rank 0, one
outcome agreed on by every rank; inline, or on a background thread (``checkpoint.async``).

No folder is shared between ranks: each stages its own files under ``<run>/checkpoints/.work/rank<r>``
and uploads them itself; rank 0 writes the manifest once every rank's files are in the store.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.distributed.checkpoint.api import CheckpointException

from vatra.resilience import snapshot
from vatra.resilience.checkpoint.ranks import CheckpointWriteError, RankGroups, disk_full, save_failure
from vatra.resilience.store import CheckpointStore, StoreError

if TYPE_CHECKING:
    from vatra.resilience.chaos import CheckpointCorruptor
    from vatra.rundir import RunDir

# (state, own files, staging folder, version, parent, info, is rank 0)
Job = tuple[snapshot.StateDict, dict[str, bytes], Path, str, str | None, dict[str, Any], bool]


class VersionWriter:
    """One save in flight at a time. ``write`` runs a job inline or starts its thread; ``wait``
    joins the thread and re-raises its error on the caller's thread.

    ``damaged`` is the set of versions a resume fell back past, shared with the loader: gc keeps
    them aside.
    """

    def __init__(
        self,
        store: CheckpointStore,
        ranks: RankGroups,
        run_dir: RunDir,
        keep_last: int,
        damaged: set[str],
        corruptor: CheckpointCorruptor,
    ) -> None:
        self.store = store
        self.ranks = ranks
        self.run_dir = run_dir
        self.keep_last = keep_last
        self.damaged = damaged
        self.corruptor = corruptor
        self.thread: threading.Thread | None = None
        self.thread_error: BaseException | None = None

    def write(self, job: Job, background: bool) -> None:
        if background:
            self.thread = threading.Thread(
                target=self._finish_guarded, args=job, name="vatra-ckpt", daemon=True
            )
            self.thread.start()
        else:
            self._finish(*job)

    def busy(self) -> bool:
        """Whether an upload is still running on the background thread."""
        return self.thread is not None and self.thread.is_alive()

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

    def _finish_guarded(self, *job: Any) -> None:
        try:
            self._finish(*job)
        except BaseException as err:  # surfaced by wait() on the training thread
            self.thread_error = err

    def _finish(
        self,
        state: snapshot.StateDict,
        own: dict[str, bytes],
        folder: Path,
        version: str,
        parent: str | None,
        info: dict[str, Any],
        main: bool,
    ) -> None:
        """Every rank writes its DCP shard to its own staging folder and uploads it with its own
        files; rank 0 gathers the entries and writes the manifest; every rank learns the outcome."""
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
            extra={"reason": info["reason"], "attempt": info["attempt"]},
        )
        size = sum(e["size"] for e in manifest["files"].values())
        self.run_dir.log_event(
            "checkpoint_saved", rank=0, step=info["step"], version=version, bytes=size,
            reason=info["reason"], tags=manifest["tags"],
        )  # fmt: skip
        self.corruptor.after_publish(self.store, manifest, info["step"])
        if self.keep_last:
            try:
                self.store.gc(self.keep_last, damaged=self.damaged)
            except StoreError as err:  # nothing was deleted that is still needed; the run goes on
                self.run_dir.log_event(
                    "gc_aborted", rank=0, step=info["step"], version=version, reason=str(err)
                )
