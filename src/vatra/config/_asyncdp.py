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
    outer_lr: float = Field(0.7, gt=0.0, description="Outer learning rate (DiLoCo: 0.7).")
    outer_momentum: float = Field(
        0.9, ge=0.0, lt=1.0, description="nesterov/sgd: momentum; adam: beta1 (beta2 = 0.999)."
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
