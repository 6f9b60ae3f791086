"""The ``balance`` section: uneven per-rank batches on mixed hardware, and who sizes them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from vatra.config._sections import Section


class BalanceConfig(Section):
    """Per-rank micro-batches that add up to one global batch, sized by a balancer.

    With ``method`` other than ``off`` the ranks draw their slices of one global batch from one
    seeded order over the whole training set (no per-rank shards), and each rank's loss is weighted
    by its share, so a step equals one step on the union batch whatever the split.
    """

    method: Literal["off", "static", "proportional", "ppo"] = Field(
        "off",
        description="off = every rank takes train.batch_size; static = the split in balance.batches (or "
        "even); proportional = batches follow each rank's measured speed; ppo = a learned policy "
        "(balance.policy) proposes them.",
    )
    policy: str = Field(
        "",
        description="ppo: the policy file 'vatra balance train-agent' saved (relative to the config file).",
    )
    global_batch: int | Literal["auto"] = Field(
        "auto",
        description="Samples per micro-step over all ranks; auto = train.batch_size × world size. Kept when "
        "the world size changes.",
    )
    batches: list[int] = Field(
        [],
        description="The starting split, one batch per rank (its sum is the global batch); [] = even.",
    )
    every: int = Field(10, ge=1, description="proportional: steps measured per decision.")
    smoothing: float = Field(
        0.3, ge=0.0, lt=1.0, description="proportional: weight of the previous split in the new one."
    )
    hysteresis: float = Field(
        0.1,
        ge=0.0,
        lt=1.0,
        description="proportional, ppo: change the split only when it saves at least this share of the "
        "measured step.",
    )
    max_change: float = Field(
        0.5,
        gt=0.0,
        le=4.0,
        description="proportional: largest relative change of one rank's batch per decision.",
    )
    min_batch: int = Field(1, ge=1, description="Smallest batch a rank is given.")
    adaptive: bool = Field(
        False,
        description="The global batch follows the gradient noise scale (from balance.global_batch up to "
        "max_global_batch) with the LR scaled by lr_scaling; each rank's batch stays within its memory "
        "(memory_budget_gb), and an out-of-memory error shrinks that rank's batch and redoes the step on "
        "every rank.",
    )
    memory_budget_gb: float | None = Field(
        None,
        gt=0.0,
        description="adaptive: peak memory one rank may use, GB (10^9 bytes): process RSS on the CPU, "
        "allocated memory on a GPU. None = the GPU's memory on a GPU, no limit but out-of-memory errors "
        "on the CPU.",
    )
    max_global_batch: int | Literal["auto"] = Field(
        "auto",
        description="adaptive: the largest global batch; auto = 8 × the starting one.",
    )
    batch_rule: Literal["goodput", "noise"] = Field(
        "goodput",
        description="adaptive: noise = the global batch follows the noise scale B_noise; goodput = the batch "
        "that trains fastest in wall time, sqrt(B_noise · a / c) for a measured step time a + c·B.",
    )
    lr_scaling: Literal["auto", "linear", "sqrt", "none"] = Field(
        "auto",
        description="adaptive: the LR × (B / B0) (linear) or × sqrt(B / B0) (sqrt) at global batch B "
        "(B0: the starting one); auto = linear for sgd, sqrt for adam and adamw.",
    )
    noise_smoothing: float = Field(
        0.95,
        ge=0.0,
        lt=1.0,
        description="adaptive: weight of the past in the running averages of |G|² and tr(Σ) that give the "
        "noise scale (per step).",
    )

    @model_validator(mode="after")
    def _check(self) -> BalanceConfig:
        if self.method == "ppo" and not self.policy:
            raise ValueError(
                "balance.method = 'ppo' needs balance.policy: the file that "
                "'vatra balance train-agent --out FILE' saves"
            )
        if any(b < self.min_batch for b in self.batches):
            raise ValueError(
                f"balance.batches = {self.batches}: every rank needs at least balance.min_batch = "
                f"{self.min_batch} samples; raise the small ones or lower min_batch"
            )
        if self.batches and self.global_batch != "auto" and sum(self.batches) != self.global_batch:
            raise ValueError(
                f"balance.batches sums to {sum(self.batches)} but balance.global_batch = "
                f"{self.global_batch}; make them agree, or leave global_batch = 'auto' (the sum of batches)"
            )
        if (
            self.adaptive
            and self.max_global_batch != "auto"
            and self.global_batch != "auto"
            and self.max_global_batch < self.global_batch
        ):
            raise ValueError(
                f"balance.max_global_batch = {self.max_global_batch} is below balance.global_batch = "
                f"{self.global_batch} (where the adaptive batch starts); raise it"
            )
        return self

    def max_total(self, start: int) -> int:
        """adaptive: the largest global batch for a run that starts at ``start``."""
        return 8 * start if self.max_global_batch == "auto" else max(self.max_global_batch, start)
