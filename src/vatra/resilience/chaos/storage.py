"""Damage to saved checkpoints behind the store's back: ``chaos.corrupt_checkpoint_at`` (the version
saved at chosen steps, once per run folder), and the helpers tests and the fault campaign use."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from vatra.resilience.chaos._base import fired_steps

if TYPE_CHECKING:
    from vatra.resilience.store import CheckpointStore, Manifest
    from vatra.rundir import RunDir


def corrupt_version(store: CheckpointStore, manifest: Manifest) -> str:
    """Flip bytes in the middle of a version's largest object (behind the store's back); returns its name."""
    name, entry = max(manifest["files"].items(), key=lambda kv: kv[1]["size"])
    key = store.object_key(entry["sha256"])
    data = bytearray(store.backend.get(key))
    mid = len(data) // 2
    data[mid : mid + 16] = bytes(b ^ 0xFF for b in data[mid : mid + 16])
    store.backend.put(key, bytes(data))
    return str(name)


def truncate_manifest(store: CheckpointStore, version: str) -> str:
    """Cut a version's manifest to half its bytes (a write the disk or a crash cut short); returns its key."""
    key = f"versions/{version}.json"
    data = store.backend.get(key)
    store.backend.put(key, data[: len(data) // 2])
    return key


class CheckpointCorruptor:
    """Flips bytes in the largest object of the versions saved at ``steps`` (rank 0 only)."""

    def __init__(self, steps: Iterable[int], run_dir: RunDir) -> None:
        self.steps = set(steps)
        self.run_dir = run_dir

    def skip_fired(self) -> None:
        """Drop the steps whose fault a previous attempt in this run folder already injected."""
        self.steps -= fired_steps(self.run_dir, "chaos_corrupt")

    def after_publish(self, store: CheckpointStore, manifest: Manifest, step: int) -> None:
        if step in self.steps:
            self.steps.discard(step)
            self.run_dir.log_event(
                "chaos_corrupt",
                rank=0,
                step=step,
                version=manifest["version"],
                file=corrupt_version(store, manifest),
            )
