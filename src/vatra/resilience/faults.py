"""Fault injection for tests and demos: kill a worker at chosen steps, damage chosen checkpoints or manifests.

Each injected fault is logged in ``events.jsonl`` *before* it happens; that line is also the
record that it fired, so a resumed run that passes the same step again does not repeat it.
"""

from __future__ import annotations

import os
import signal
from typing import TYPE_CHECKING, Any

from vatra.engine import Plugin
from vatra.errors import ConfigError
from vatra.resilience.recovery import read_events
from vatra.resilience.store import CheckpointStore, Manifest

if TYPE_CHECKING:
    from vatra.config import ChaosConfig
    from vatra.engine import Trainer
    from vatra.rundir import RunDir


def fired_steps(run_dir: RunDir, kind: str) -> set[int]:
    return {int(e["step"]) for e in read_events(run_dir) if e.get("event") == kind}


class KillInjector(Plugin):
    """``chaos.kill_at_steps``: rank ``chaos.kill_rank`` SIGKILLs itself after completing those steps."""

    def __init__(self, chaos: ChaosConfig, run_dir: RunDir) -> None:
        self.chaos = chaos
        self.run_dir = run_dir
        self.pending: set[int] = set()

    def on_fit_start(self, trainer: Trainer) -> None:
        if not self.chaos.kill_at_steps:
            return
        if self.chaos.kill_rank >= trainer.dist.world_size:
            raise ConfigError(
                f"chaos.kill_rank {self.chaos.kill_rank} does not exist in a run of "
                f"{trainer.dist.world_size} rank(s); use --nproc 2 or more, or chaos.kill_rank=0"
            )
        if trainer.dist.rank == self.chaos.kill_rank:
            self.pending = set(self.chaos.kill_at_steps) - fired_steps(self.run_dir, "chaos_kill")

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        step = trainer.state.step
        if step in self.pending:
            trainer.log_event("chaos_kill", signal="SIGKILL", pid=os.getpid())
            os.kill(os.getpid(), signal.SIGKILL)


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
