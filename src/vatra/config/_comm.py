"""The ``comm`` section: gradient compression, error feedback, all-reduce topology and batching."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from vatra.config._sections import Section
from vatra.registry import COMPRESSORS


class CommConfig(Section):
    method: str = Field(
        "none",
        description="Gradient compressor: none, fp16, bf16, topk, randomk, onebit, qsgd, powersgd, or an "
        "import string 'package.module:Class' naming a vatra.comm.Compressor subclass (built with its "
        "from_config(comm section)); 'none' on the flat topology keeps DDP's built-in all-reduce.",
    )
    ratio: float = Field(0.01, gt=0.0, le=1.0, description="topk/randomk: share of elements sent per tensor.")
    onebit_scale: Literal["tensor", "row"] = Field(
        "tensor",
        description="onebit: one mean |x| scale per tensor, or per row of each matrix (per output unit).",
    )
    levels: int = Field(16, ge=1, le=127, description="qsgd: quantisation levels s (sent as int8).")
    rank: int = Field(4, ge=1, description="powersgd: rank of the low-rank approximation.")
    error_feedback: bool = Field(True, description="Carry what compression dropped into the next step.")
    momentum_correction: bool = Field(
        False,
        description=(
            "DGC momentum correction: with optim.name = 'sgd' and momentum m, each rank compresses its "
            "own velocity (u ← m·u + g, error feedback on u) and the optimizer's momentum is turned off; "
            "sparsifiers also clear u where they sent (momentum-factor masking)."
        ),
    )
    start_step: int = Field(
        0,
        ge=0,
        description="Warm-up steps sent uncompressed (powersgd uses at least 2: DDP rebuilds buckets).",
    )
    min_numel: int = Field(
        1024, ge=0, description="Tensors with fewer elements go uncompressed (biases, norms)."
    )
    topology: Literal["auto", "flat", "ring", "hierarchical"] = Field(
        "auto",
        description=(
            "flat = gloo/NCCL's own collectives; ring = vatra's ring (reduce-scatter + all-gather); "
            "hierarchical = reduce inside each host, ring among host leaders, broadcast inside the host; "
            "auto = hierarchical when there are several hosts with several processes each, else flat."
        ),
    )
    overlap: bool = Field(
        True,
        description=(
            "Run each DDP bucket's compression and collectives on a background thread (one per hook, "
            "buckets in order), so communication overlaps the rest of backward; false runs them on the "
            "autograd thread. Same results either way."
        ),
    )
    bucket_mb: float = Field(
        4.0, gt=0.0, description="Small messages of vatra's own collectives are fused up to this size (MB)."
    )

    _method = field_validator("method")(lambda v: COMPRESSORS.check(v))

    @model_validator(mode="after")
    def _check(self) -> CommConfig:
        if self.method == "powersgd" and self.topology in ("ring", "hierarchical"):
            raise ValueError(
                "powersgd runs torch's PowerSGD hook, which all-reduces on the default group; "
                "set comm.topology = 'auto' or 'flat'"
            )
        no_feedback = self.method in ("none", "qsgd", "powersgd")
        if self.momentum_correction and (no_feedback or not self.error_feedback):
            why = f"method '{self.method}'" if no_feedback else "comm.error_feedback = false"
            raise ValueError(
                "momentum correction compresses each rank's velocity with error feedback, which "
                f"{why} does not have; use topk, randomk, onebit, fp16 or bf16 with "
                "comm.error_feedback = true, or set comm.momentum_correction = false"
            )
        return self
