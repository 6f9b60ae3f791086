"""Training that does not synchronise every step: ``dist.mode = "local_sgd" | "diloco" | "hybrid"``.

``local_sgd`` (:class:`LocalSGD`): DDP's gradient all-reduce for ``local_sgd.warmup_steps``, then
each rank steps on its own gradients and torch's ``PeriodicModelAverager`` averages the parameters
every ``local_sgd.every`` steps. ``diloco`` (:class:`DiLoCo`): each rank takes ``diloco.inner_steps``
steps of its own optimizer, the change of its parameters over them (the pseudo-gradient) is averaged
through ``vatra.comm`` (any compressor, with error feedback) and an outer optimizer steps the shared
parameters on it; optional streaming fragments and per-rank step counts for mixed hardware.
``hybrid``: the trainer runs DDP inside groups of ``hybrid.group_size`` ranks and DiLoCo runs across
them (the members of a group hold the same parameters, so averaging over all ranks averages the groups).
"""

from __future__ import annotations

from vatra.asyncdp.diloco import DiLoCo, computes_at, split_fragments, steps_for_speed
from vatra.asyncdp.local_sgd import LocalSGD
from vatra.config import Config
from vatra.engine import Plugin

__all__ = ["DiLoCo", "LocalSGD", "computes_at", "mode_plugin", "split_fragments", "steps_for_speed"]


def mode_plugin(cfg: Config) -> Plugin:
    """The plugin that synchronises the ranks for ``dist.mode`` (``sync`` is comm's DDP hook)."""
    if cfg.dist.mode == "local_sgd":
        return LocalSGD(cfg.local_sgd)
    if cfg.dist.mode == "diloco":
        return DiLoCo(cfg.diloco, cfg.comm)
    if cfg.dist.mode == "hybrid":  # DDP inside each group (the trainer's), DiLoCo across the groups
        return DiLoCo(cfg.diloco, cfg.comm, group_size=cfg.hybrid.group_size)
    raise ValueError(f"dist.mode = {cfg.dist.mode!r} has no mode plugin (async: vatra.asyncrun)")
