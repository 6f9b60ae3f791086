"""The ``local_sgd`` and ``diloco`` sections: training that synchronises every few steps (``dist.mode``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from vatra.config._sections import Section


class LocalSGDConfig(Section):
    every: int = Field(
        8,
        ge=1,
        description="dist.mode = 'local_sgd': average the ranks' parameters every H optimizer steps (each "
        "rank steps on its own gradient in between); 1 = synchronous DDP step for step.",
    )
    warmup_steps: int = Field(
        0,
        ge=0,
        description="Synchronous DDP steps before local SGD starts (post-local SGD, Lin et al. 2020).",
    )


class DiLoCoConfig(Section):
    inner_steps: int = Field(
        32,
        ge=1,
        description="dist.mode = 'diloco': H, the optimizer steps each rank takes on its own before the "
        "outer step (its parameters' change over them is the pseudo-gradient that is averaged).",
    )
    outer: Literal["nesterov", "sgd", "adam"] = Field(
        "nesterov", description="Outer optimizer on the averaged pseudo-gradient (DiLoCo: Nesterov)."
    )
    outer_lr: float = Field(
        1.0,
        gt=0.0,
        description="Outer learning rate. 1.0 with outer_momentum 0.3 kept the shipped examples within "
        "0.4 points of sync DDP at H = 32; the paper's 0.7 / 0.9 (tuned for thousands of rounds) lost "
        "5.7 points on synthetic in 12 rounds (docs/asyncdp.md).",
    )
    outer_momentum: float = Field(
        0.3, ge=0.0, lt=1.0, description="nesterov/sgd: momentum; adam: beta1 (beta2 = 0.999)."
    )
    fragments: int = Field(
        1,
        ge=1,
        description="Streaming DiLoCo: the parameters are split into this many fragments, synced in turn "
        "(fragment f at steps where step % H = round(f·H/F)), so each sync sends 1/F of the model.",
    )
    adaptive_steps: bool = Field(
        False,
        description="Per-rank inner-step counts proportional to each rank's measured speed: a slow rank "
        "takes fewer local steps in a round instead of holding the others (its pseudo-gradient is "
        "weighted by its share of the round's steps).",
    )


class HybridConfig(Section):
    group_size: int = Field(
        2,
        ge=1,
        description="dist.mode = 'hybrid': ranks per synchronous group (contiguous ranks: one host's in "
        "the cluster harness, with dist.nproc = group_size); each group runs DDP inside and the groups "
        "exchange DiLoCo-style ([diloco]) across.",
    )


class AsyncConfig(Section):
    """``[async]`` (a Python keyword: the field is ``Config.async_``)."""

    staleness: Literal["none", "inverse", "exp"] = Field(
        "exp",
        description="dist.mode = 'async': how a gradient's staleness τ (server updates since the worker "
        "pulled the parameters it was computed on) scales its step: none = lr; inverse = lr / (1 + τ) "
        "(Zhang et al. 2016); exp = lr · exp(−staleness_alpha · τ). With 4 workers on synthetic: none "
        "0.823, exp 0.812, inverse 0.764 (it divides the LR by about the worker count; sync DDP 0.807).",
    )
    staleness_alpha: float = Field(0.2, gt=0.0, description="exp: the decay α per update of staleness.")
    max_staleness: int = Field(
        16,
        ge=0,
        description="A gradient staler than this many updates is refused, and the worker gets fresh "
        "parameters instead (it must pull before it pushes again); 0 = no limit.",
    )
    restarts: int = Field(
        3,
        ge=0,
        description="Times a dead worker or server process is restarted in place (workers resume from "
        "their own last state, servers from their last saved shard) while the others go on.",
    )
