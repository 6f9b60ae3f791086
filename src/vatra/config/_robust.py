"""``federated.robust``: Byzantine-robust aggregation and the screening of updates before it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from vatra.config._sections import Section


class RobustConfig(Section):
    """Settings of the robust strategies (median, trimmed_mean, krum) and of ``robust.screen``."""

    trim_ratio: float = Field(
        0.2,
        ge=0.0,
        lt=0.5,
        description="trimmed_mean: share β of the values dropped from each end of every coordinate "
        "(⌊β·n⌋ per end); it tolerates up to that share of poisoned clients per round.",
    )
    byzantine: int = Field(
        0,
        ge=0,
        description="krum: clients f assumed Byzantine per round; each update is scored on its n−f−2 "
        "nearest; 0 = the most Krum tolerates, ⌊(n−3)/2⌋ of the round's n results.",
    )
    krum_m: int = Field(
        1, ge=1, description="krum: average the m best-scored updates (multi-Krum); 1 = plain Krum."
    )
    max_update_norm: float = Field(
        0.0,
        ge=0.0,
        description="screen: L2 norm above which an update is clipped or rejected (norm_action); 0 = off.",
    )
    norm_action: Literal["clip", "reject"] = Field(
        "clip",
        description="screen: an update over max_update_norm is scaled down to it (clip) or dropped as a "
        "failure of the round (reject).",
    )
    max_num_samples: int = Field(
        0,
        ge=0,
        description="screen: a client's sample count (its aggregation weight) is capped at this; 0 = off. "
        "A count that differs from the one the server knows for that client is rejected.",
    )

    @model_validator(mode="after")
    def _check(self) -> RobustConfig:
        if self.norm_action == "reject" and self.max_update_norm == 0:
            raise ValueError("norm_action = 'reject' needs max_update_norm > 0 (0 turns the norm check off)")
        return self
