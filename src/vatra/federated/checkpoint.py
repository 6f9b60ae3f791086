"""The federated server's state as versions of the run's checkpoint store (``[store]``).

Each round is one version holding one file, ``server.safetensors`` (the wire format of
:mod:`vatra.federated.wire`), with ``step`` = the round, ``parent`` = the previous round's version
and ``world_size`` = 1, tagged ``latest``: so ``[store]`` (S3 via fsspec, erasure coding, signing)
and ``vatra ckpt`` cover a federated run as they do a training run. A resume reads ``latest``,
falling back down its parents past a version whose object is missing or corrupt (logged as
``checkpoint_corrupt``), as the training loader does.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vatra.config import Config, load_config
from vatra.errors import VatraError
from vatra.resilience.checkpoint.loader import fallback_candidates
from vatra.resilience.store import LATEST, CheckpointStore, Manifest, StoreError, open_store
from vatra.rundir import RunDir

CHECKPOINT = "server.safetensors"
# the figures a version's manifest carries for ``vatra ckpt list`` (the whole row is in metrics.jsonl)
_LISTED = {"train_loss": "loss", "global_accuracy": "global_accuracy"}


class ServerCheckpoints:
    """Writes a version per round and finds the newest intact one on resume."""

    def __init__(self, cfg: Config, run_dir: RunDir) -> None:
        self.run_dir = run_dir
        self.store: CheckpointStore = open_store(cfg.store, run_dir.checkpoints)
        self.keep_last = cfg.checkpoint.keep_last
        self.parent: str | None = None  # the version the next save follows
        self.damaged: set[str] = set()  # versions a resume passed over: gc keeps them as evidence

    @property
    def legacy_path(self) -> Path:
        """Where servers before the store wrote their one file (read once, to resume such a run)."""
        return self.run_dir.checkpoints / CHECKPOINT

    def describe(self) -> str:
        return self.store.backend.describe()

    def save(self, rnd: int, blob: bytes, metrics: dict[str, Any]) -> Manifest:
        """Round ``rnd``'s state as a new version after the previous one; then prune to ``keep_last``."""
        listed = {
            name: float(metrics[key]) for key, name in _LISTED.items() if isinstance(metrics.get(key), float)
        }
        manifest = self.store.write_version(
            {CHECKPOINT: blob},
            step=rnd,
            parent=self.parent,
            world_size=1,
            metrics=listed,
            extra={"reason": "round"},
        )
        self.parent = manifest["version"]
        self.run_dir.log_event(
            "checkpoint_saved", step=rnd, version=manifest["version"], bytes=len(blob), reason="round"
        )
        if self.keep_last:
            try:
                self.store.gc(self.keep_last, damaged=self.damaged)
            except StoreError as err:  # nothing still needed was deleted; the run goes on
                self.run_dir.log_event("gc_aborted", step=rnd, version=manifest["version"], reason=str(err))
        return manifest

    def newest(self) -> tuple[str, bytes] | None:
        """(where it was read, bytes) of the newest intact version from ``latest`` down its parents,
        then the others newest first; a pre-store run's ``server.safetensors`` when the store has no
        version; None when there is nothing to resume. Raises :class:`VatraError` when versions exist
        and none is intact (a fresh start would write over the run's rounds)."""
        if not self.store.backend.keys("versions/"):
            if self.legacy_path.is_file():
                return str(self.legacy_path), self.legacy_path.read_bytes()
            return None
        problem = "no readable version"
        for manifest in self._candidates():
            version = manifest["version"]
            try:
                entry = manifest["files"].get(CHECKPOINT)
                if entry is None:
                    raise StoreError(f"version {version} has no file {CHECKPOINT!r}")
                blob = self.store.get_object(entry["sha256"])
            except StoreError as err:
                problem = str(err)
                self.damaged.add(version)
                self.run_dir.log_event(
                    "checkpoint_corrupt", version=version, problem=problem, action="fall back to parent"
                )
                continue
            self.parent = version
            return f"version {version} of {self.describe()}", blob
        raise VatraError(
            f"server checkpoint in {self.describe()} is unreadable (no intact version: {problem}); "
            "restore it ('vatra ckpt verify RUN' names what is damaged), or move the run's checkpoints "
            "away to start this run folder over"
        )

    def _candidates(self) -> Iterator[Manifest]:
        """The versions a resume tries, in the training loader's order (``latest`` down its parents,
        then the rest newest first; unreadable manifests logged and passed over)."""
        return fallback_candidates(self.store, LATEST, self.run_dir.log_event)


def server_state(run_dir: RunDir) -> bytes:
    """The newest intact round's ``server.safetensors`` of a finished or stopped federated run, read
    through the store its ``config.toml`` names (decode it with :func:`vatra.federated.wire.decode`)."""
    found = ServerCheckpoints(load_config(run_dir.config), run_dir).newest()
    if found is None:
        raise VatraError(f"{run_dir.path}: no server checkpoint (the run saved no round)")
    return found[1]
