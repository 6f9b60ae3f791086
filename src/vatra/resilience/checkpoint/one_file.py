"""One process's whole state as versions of a checkpoint store, one file per version.

The federated server (a version per round) and each parameter server (a version per saved shard)
save this way: ``step`` = their own counter, ``parent`` = the previous save's version,
``world_size`` = 1, tagged ``latest``, then pruned to ``keep_last``; so ``[store]`` (S3 via
fsspec, erasure coding, signing) and ``vatra ckpt`` cover them as they cover a training run. A
resume reads ``latest``, falling back down its parents past a version whose manifest or object is
missing, corrupt or wrongly signed (logged as ``checkpoint_corrupt``), in the training loader's
order. ``write_version`` always moves ``latest`` and ``gc`` deletes what kept versions do not
reference: so two processes must never share one store (give each its own, ``open_store(..., sub=)``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from vatra.errors import VatraError
from vatra.resilience.checkpoint.loader import fallback_candidates
from vatra.resilience.store import LATEST, CheckpointStore, Manifest, StoreError


class OneFileVersions:
    """Writes ``name`` as a new version after the previous save and finds the newest intact one.

    ``log_event(kind, **fields)`` records ``checkpoint_saved``, ``checkpoint_corrupt`` and
    ``gc_aborted``; ``legacy``: where the process wrote its one file before the store, read once
    (when the store has no version) to resume such a run; ``what`` names the state in errors.
    """

    def __init__(
        self,
        store: CheckpointStore,
        name: str,
        log_event: Callable[..., None],
        *,
        keep_last: int,
        legacy: Path | None = None,
        what: str = "checkpoint",
        verify_hint: str = "vatra ckpt verify RUN",
    ) -> None:
        self.store, self.name, self.log_event = store, name, log_event
        self.keep_last, self.legacy, self.what, self.verify_hint = keep_last, legacy, what, verify_hint
        self.parent: str | None = None  # the version the next save follows
        self.damaged: set[str] = set()  # versions a resume passed over: gc keeps them as evidence

    def describe(self) -> str:
        return self.store.backend.describe()

    def save(
        self, step: int, blob: bytes, *, reason: str, metrics: dict[str, float] | None = None
    ) -> Manifest:
        """``blob`` as a new version at ``step`` after the previous one; then prune to ``keep_last``."""
        manifest = self.store.write_version(
            {self.name: blob},
            step=step,
            parent=self.parent,
            world_size=1,
            metrics=metrics or {},
            extra={"reason": reason},
        )
        self.parent = manifest["version"]
        self.log_event("checkpoint_saved", step=step, version=self.parent, bytes=len(blob), reason=reason)
        if self.keep_last:
            try:
                self.store.gc(self.keep_last, damaged=self.damaged)
            except StoreError as err:  # nothing still needed was deleted; the process goes on
                self.log_event("gc_aborted", step=step, version=self.parent, reason=str(err))
        return manifest

    def newest(self) -> tuple[str, bytes] | None:
        """(where it was read, bytes) of the newest intact version from ``latest`` down its parents,
        then the others newest first; the legacy file when the store has no version; None when
        there is nothing to resume. Raises :class:`VatraError` when versions exist and none is
        intact (a fresh start would write over the saved state)."""
        if not self.store.backend.keys("versions/"):
            if self.legacy is not None and self.legacy.is_file():
                return str(self.legacy), self.legacy.read_bytes()
            return None
        problem = "no readable version"
        for manifest in fallback_candidates(self.store, LATEST, self.log_event):
            version = manifest["version"]
            try:
                entry = manifest["files"].get(self.name)
                if entry is None:
                    raise StoreError(f"version {version} has no file {self.name!r}")
                blob = self.store.get_object(entry["sha256"])
            except StoreError as err:
                problem = str(err)
                self.damaged.add(version)
                self.log_event(
                    "checkpoint_corrupt", version=version, problem=problem, action="fall back to parent"
                )
                continue
            self.parent = version
            return f"version {version} of {self.describe()}", blob
        raise VatraError(
            f"{self.what} in {self.describe()} is unreadable (no intact version: {problem}); "
            f"restore it ('{self.verify_hint}' names what is damaged), or move the run's checkpoints "
            "away to start this run folder over"
        )
