"""``[edge]``: quantization-aware training and pruning inside ``vatra train``, for edge deployment."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from vatra.config._sections import Section


class EdgeConfig(Section):
    """Fake-quantized training (QAT) and magnitude pruning of the model's Linear layers during training.

    ``vatra edge export`` then converts the trained float weights: the QAT run's int8 variant sees
    the same quantization it trained with, and the pruned weights stay zero.
    """

    qat: Literal["none", "int8"] = Field(
        "none",
        description="int8: every Linear layer trains with its weights (per output row) and inputs (per "
        "row) fake-quantized to int8 as torchao's Int8DynamicActivationInt8Weight computes them, "
        "straight-through gradients; none = float training.",
    )
    qat_start_step: int = Field(
        0,
        ge=0,
        description="Optimizer steps of float training (warm-up) before the fake quantization starts.",
    )
    prune: Literal["none", "magnitude"] = Field(
        "none",
        description="magnitude: the smallest Linear weights (by absolute value, over all layers) are "
        "held at zero from the schedule's steps on; structured pruning is vatra edge export --prune "
        "structured (it changes the layers' shapes, which training under DDP cannot).",
    )
    sparsity: float = Field(
        0.5, ge=0.0, lt=1.0, description="prune: the share of Linear weights that end at zero."
    )
    prune_schedule: Literal["oneshot", "gradual"] = Field(
        "gradual",
        description="oneshot: all of sparsity at prune_start_step, then fine-tuning with the zeros "
        "held; gradual: sparsity rises along s·(1 − (1 − t)³) from prune_start_step to prune_end_step "
        "(Zhu & Gupta 2017), re-pruned every prune_every steps.",
    )
    prune_start_step: int = Field(0, ge=0, description="prune: the step the first weights are cut at.")
    prune_end_step: int = Field(
        0, ge=0, description="prune (gradual): the step the full sparsity is reached; 0 = 3/4 of train.steps."
    )
    prune_every: int = Field(10, ge=1, description="prune (gradual): steps between two re-prunings.")

    @model_validator(mode="after")
    def _check(self) -> EdgeConfig:
        if self.prune_end_step and self.prune_end_step <= self.prune_start_step:
            raise ValueError(
                f"edge.prune_end_step = {self.prune_end_step} is not after edge.prune_start_step = "
                f"{self.prune_start_step}; set it later (or 0: three quarters of train.steps)"
            )
        return self

    @property
    def enabled(self) -> bool:
        return self.qat != "none" or self.prune != "none"
