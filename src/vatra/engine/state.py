"""``TrainState``: the mutable facts of a run that plugins read and write."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from vatra.engine.trainer import Trainer


class Checkpointer(Protocol):
    """What a checkpoint plugin offers other plugins (healing rolls back through it).

    The checkpoint plugin sets ``trainer.state.checkpointer`` in ``on_fit_start``; plugins that
    need a rollback call it without importing the checkpoint package.
    """

    def save(self, trainer: Trainer, *, tags: tuple[str, ...] = ()) -> str:
        """Write a full checkpoint now; returns its version id."""
        ...

    def restore(self, trainer: Trainer, version: str = "last-good") -> dict[str, Any]:
        """Load a version (id or tag) into the trainer; returns its manifest."""
        ...


@dataclass
class TrainState:
    step: int = 0  # optimizer steps completed
    samples_seen: int = 0  # global samples consumed by completed steps
    train_time_s: float = 0.0  # summed step time (excludes evaluation and start-up)
    skip_update: bool = False  # set in after_backward to drop the current update
    should_stop: bool = False  # set by a plugin to end fit() after the current step
    healthy: bool = True  # False while a detector reports an anomaly: no checkpoint is tagged last-good
    checkpointer: Checkpointer | None = None  # set by the checkpoint plugin, if any
    last_metrics: dict[str, Any] = field(default_factory=dict)
    last_eval: dict[str, Any] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)  # per-plugin scratch space, keyed by plugin name
    # Per-rank state other plugins keep (objects with state_dict/load_state_dict), keyed by plugin name:
    # the checkpoint plugin saves it with each rank's RNG and sampler and restores it on resume, and
    # healing's in-memory snapshots copy it. state_dict() returns {part: {key: tensor or plain value}}.
    rank_states: dict[str, Any] = field(default_factory=dict)
