"""``[edge]``: quantization-aware training and pruning inside ``vatra train``, for edge deployment."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from vatra.config._sections import Section


class EdgeConfig(Section):
    """Fake-quantized training (QAT) and pruning of the model's layers during training.

    ``vatra edge export`` then converts the trained float weights: the QAT run's int8 variant sees
    the same quantization it trained with, and the pruned weights stay zero.
    """

    qat: Literal["none", "int8", "int4w"] = Field(
        "none",
        description="int8: every Linear layer trains with its weights (per output row) and inputs (per "
        "row) fake-quantized to int8 as torchao's Int8DynamicActivationInt8Weight computes them, "
        "straight-through gradients; int4w: torchao's QATConfig (prepare, then convert at the end) "
        "over Int8DynamicActivationIntxWeight with int4 weights in groups of 32 inputs (Linear "
        "layers whose inputs 32 does not divide stay float); none = float training.",
    )
    qat_start_step: int = Field(
        0,
        ge=0,
        description="Optimizer steps of float training (warm-up) before the fake quantization starts.",
    )
    prune: Literal["none", "magnitude", "structured"] = Field(
        "none",
        description="magnitude: the smallest Linear weights (by absolute value, over all layers) are "
        "held at zero from the schedule's steps on; structured: the hidden neurons (mlp) or channels "
        "(cnn) with the smallest incoming weight norm, with the next layer's weights that read them, "
        "are held at zero (shapes unchanged, as DDP needs) and vatra edge export --prune structured "
        "removes them.",
    )
    sparsity: float = Field(
        0.5,
        ge=0.0,
        lt=1.0,
        description="prune: the share of Linear weights (magnitude) or of each hidden layer's "
        "neurons / channels (structured) that end cut.",
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
