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
        return self

    def sizes(self, world_size: int, batch_size: int) -> list[int]:
        """The starting per-rank batches for ``world_size`` ranks (``batch_size``: train.batch_size)."""
        from vatra.data.sampler import even_split

        if self.batches:
            if len(self.batches) != world_size:
                raise ValueError(
                    f"balance.batches lists {len(self.batches)} batches but the run has {world_size} "
                    f"ranks; give one per rank, or [] for an even split"
                )
            return list(self.batches)
        total = batch_size * world_size if self.global_batch == "auto" else self.global_batch
        if total < self.min_batch * world_size:
            raise ValueError(
                f"balance.global_batch = {total} cannot give each of {world_size} ranks "
                f"balance.min_batch = {self.min_batch} samples; raise it"
            )
        return even_split(total, world_size)
