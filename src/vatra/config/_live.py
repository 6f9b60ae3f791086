"""The ``resilience`` section: live recovery, where a dead replica group heals from a live peer
while the others keep training (torchft), instead of a restart of every rank."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field, model_validator

from vatra.config._sections import Section
from vatra.errors import ConfigError

if TYPE_CHECKING:
    from vatra.config._load import Config


class ResilienceConfig(Section):
    """How a data-parallel run survives a dead process (docs/live-recovery.md).

    The ``live_*`` keys are torchft's lighthouse options under vatra's names:
    ``live_heartbeat_ms`` → ``heartbeat_timeout_ms``, ``live_quorum_tick_ms`` → ``quorum_tick_ms``,
    ``live_min_replicas`` → ``min_replicas``, ``live_join_timeout_ms`` → ``join_timeout_ms``.
    """

    live: bool = Field(
        False,
        description="Run one torchft replica group per process: a dead group leaves the quorum while "
        "the others keep training in the same processes, and its restarted process heals from a live "
        "peer's state (needs vatra[ft]; plain data parallelism only).",
    )
    live_heartbeat_ms: int = Field(
        2000,
        ge=100,
        description="A group whose heartbeat the lighthouse has not heard for this long is dropped from "
        "the quorum: the survivors' stall after a death (torchft's default is 5000; 1000 dropped live "
        "groups whose heartbeat thread starved on a loaded machine).",
    )
    live_quorum_tick_ms: int = Field(
        100, ge=1, description="How often the lighthouse re-checks whether a quorum can form."
    )
    live_min_replicas: int = Field(
        1, ge=1, description="Fewest replica groups that may commit a step; fewer wait for more to join."
    )
    live_join_timeout_ms: int = Field(
        10000,
        ge=0,
        description="How long a new quorum waits for groups that heartbeat but have not asked to join "
        "(at start, the slower groups' imports); a death is settled by live_heartbeat_ms first.",
    )
    live_max_restarts: int = Field(
        20, ge=0, description="Restarts of dead groups, all groups together; one more failure ends the run."
    )
    live_timeout_s: float = Field(
        30.0,
        gt=0.0,
        description="Longest wait for one collective, quorum or state transfer: a hung (not dead) peer "
        "is given up after this.",
    )

    @model_validator(mode="after")
    def _check(self) -> ResilienceConfig:
        if self.live_join_timeout_ms and self.live_join_timeout_ms < self.live_quorum_tick_ms:
            raise ValueError(
                f"live_join_timeout_ms = {self.live_join_timeout_ms} is shorter than live_quorum_tick_ms "
                f"= {self.live_quorum_tick_ms}; raise live_join_timeout_ms"
            )
        return self


def check_live(cfg: Config) -> None:
    """``resilience.live`` runs plain data parallelism, one replica group per process: refuse the
    modes that shard, split or desynchronise the model, or sync gradients through DDP's hooks."""
    if not cfg.resilience.live:
        return
    clash = ""
    if cfg.dist.mode != "sync":
        clash = f"dist.mode = {cfg.dist.mode!r} (ranks step apart); set dist.mode = 'sync'"
    elif not cfg.parallel.is_default():
        clash = "a [parallel] layout (fsdp, tp, pp shard the model over the ranks); remove [parallel]"
    elif cfg.balance.method != "off":
        clash = (
            f"balance.method = {cfg.balance.method!r} (uneven per-rank batches); set balance.method = 'off'"
        )
    elif cfg.meta.enabled:
        clash = "meta-learning (its meta-step gathers across ranks itself); use vatra train"
    elif cfg.comm.method != "none" or cfg.comm.topology in ("ring", "hierarchical"):
        clash = (
            "[comm] compression or topologies (DDP hooks); set comm.method = 'none', comm.topology = 'auto'"
        )
    elif cfg.heal.enabled and any(p != "skip_spike" for p in cfg.heal.policies):
        if "policies" in cfg.heal.model_fields_set:  # the user asked for them: say why they cannot run
            clash = (
                "heal.policies other than skip_spike (rollback, straggler, prefetch act on one group's "
                "monitor and would make the groups' models differ); set heal.policies = ['skip_spike']"
            )
        else:  # the defaults: keep the one policy every group decides alike (the averaged gradient's norm)
            cfg.heal.policies = ["skip_spike"]
    if clash:
        raise ValueError(
            f"resilience.live = true averages whole gradients over torchft replica groups and cannot run "
            f"with {clash}, or set resilience.live = false"
        )


def check_live_run(cfg: Config, run: str) -> None:
    """Only ``vatra train`` runs replica groups: another kind of run with ``live`` is refused."""
    if cfg.resilience.live and run != "train":
        raise ConfigError(
            f"resilience.live = true: a {run} run has no replica groups to keep alive (live recovery "
            "is for vatra train's data parallelism); set resilience.live = false"
        )
