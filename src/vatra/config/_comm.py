"""The ``comm`` section: gradient compression, error feedback, all-reduce topology and batching."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from vatra.config._sections import Section
from vatra.registry import COMPRESSORS


class CommConfig(Section):
    method: str = Field(
        "none",
        description="Gradient compressor: none, fp16, bf16, int8, topk, randomk, onebit, qsgd, powersgd, "
        "or an import string 'package.module:Class' naming a vatra.comm.Compressor subclass (built with its "
        "from_config(comm section)); 'none' on the flat topology keeps DDP's built-in all-reduce.",
    )
    ratio: float | Literal["auto"] = Field(
        "auto",
        description="topk/randomk: share of elements sent per tensor. auto = topk 1 %, randomk 3 % for "
        "gradients (after the signal-driven warm-up and DGC's sparsity ramp), 1 % for federated uploads.",
    )
    onebit_scale: Literal["tensor", "row"] = Field(
        "row",
        description="onebit: one mean |x| scale per row of each matrix (per output unit), or one per tensor.",
    )
    levels: int = Field(127, ge=1, le=127, description="qsgd: quantisation levels s (sent as int8).")
    qsgd_bucket: int = Field(
        512, ge=0, description="qsgd: elements per norm (QSGD's bucketing); 0 = one norm per tensor."
    )
    rank: int = Field(
        16,
        ge=1,
        description="powersgd: rank of the low-rank approximation (rank 4 lost 2–4 points on the synthetic "
        "and gpt_text examples, 16 keeps them within 1).",
    )
    powersgd_impl: Literal["torch", "vatra"] = Field(
        "vatra",
        description="powersgd: vatra's (every bucket's matrices in two fused all-reduces per step, factors "
        "in comm.factor_dtype, on the hook's worker thread, any comm.topology, compressed from step 0) "
        "or torch's DDP hook (three all-reduces per bucket, flat topology, from step 2).",
    )
    factor_dtype: Literal["fp32", "fp16", "int8"] = Field(
        "fp16",
        description="powersgd_impl = 'vatra': precision of the P and Q factors on the wire, and of the "
        "uncompressed tensors beside them (with error feedback unless fp32). fp16: a step whose sum "
        "overflows sends them again in fp32. int8: one scale per rank-r component, shared by every rank "
        "(one small all-reduce more per phase), half fp16's bytes, up to 8 ranks (fp16 above).",
    )
    error_feedback: bool = Field(True, description="Carry what compression dropped into the next step.")
    adam1bit: bool = Field(
        True,
        description="optim.name adam or adamw with onebit, topk or randomk: 1-bit Adam (plain Adam on "
        "gradients averaged in comm.warmup_precision until its second moment settles, then that moment "
        "frozen and each rank's momentum "
        "compressed, with error feedback on both sides of the all-reduce; docs/compression-adam.md). "
        "There comm.start_step = 'auto' freezes the variance when it has settled, a number after that "
        "many steps. false: the gradients are compressed, as under SGD.",
    )
    warmup_precision: Literal["fp4", "fp8", "fp16"] = Field(
        "fp4",
        description="1-bit Adam's warm-up (comm.adam1bit): the gradients' average sent in fp4 (e2m1, "
        "stochastically rounded, a bf16 scale per 32 values: ~0.56 bytes a value) or fp8 (e4m3, a scale "
        "per row), each rank's chunk to the rank that serves it and that rank's average back, so every "
        "rank gets the same average; or in fp16 (half of fp32's bytes, exact but for rounding; a sum "
        "that overflows goes again in fp32).",
    )
    momentum_correction: bool | Literal["auto"] = Field(
        "auto",
        description=(
            "DGC momentum correction: with optim.name = 'sgd' and momentum m, each rank compresses its "
            "own velocity (u ← m·u + g, error feedback on u) and the optimizer's momentum is turned off; "
            "sparsifiers also clear u where they sent (momentum-factor masking). auto = on where it "
            "applies and helps: onebit and randomk under sgd with momentum (not topk: see "
            "docs/communication.md)."
        ),
    )
    start_step: int | Literal["auto"] = Field(
        "auto",
        description="Warm-up steps sent uncompressed. auto = for topk, onebit and randomk until the loss "
        "curve settles (its average's fall over 20 steps under a quarter of its steepest: "
        "vatra.comm.warmup), never before optim.warmup_steps and at the latest at 25 % of train.steps "
        "(randomk 40 %); for other lossy methods the LR warm-up (optim.warmup_steps); torch's powersgd "
        "hook needs at least 2 (it keys its state by DDP bucket, and DDP rebuilds its buckets after "
        "the first step; vatra's keys it by parameter). The run records the step and the reason: "
        "event compression_started, summary compression_started_step.",
    )
    sparsity_warmup: int | Literal["auto"] = Field(
        "auto",
        description="topk/randomk: for this many steps after start_step the share sent falls "
        "exponentially from 25% to comm.ratio (DGC's warm-up). auto = as many steps as the uncompressed "
        "warm-up took when comm.ratio is below 25 %, else 0.",
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
    overlap: bool | Literal["auto"] = Field(
        "auto",
        description=(
            "Run each DDP bucket's compression and collectives on a background thread (one per hook, "
            "buckets in order), so communication overlaps the rest of backward; false runs them on the "
            "autograd thread. Same results either way. auto = true, except vatra's powersgd on CPU "
            "(its projections on the thread competed with backward for the cores: about 7 % slower steps "
            "on the 4-host cluster)."
        ),
    )
    bucket_mb: float = Field(
        4.0, gt=0.0, description="Small messages of vatra's own collectives are fused up to this size (MB)."
    )

    _method = field_validator("method")(lambda v: COMPRESSORS.check(v))

    @model_validator(mode="after")
    def _check(self) -> CommConfig:
        if (
            self.method == "powersgd"
            and self.powersgd_impl == "torch"
            and self.topology in ("ring", "hierarchical")
        ):
            raise ValueError(
                "comm.powersgd_impl = 'torch' runs torch's PowerSGD hook, which all-reduces on the default "
                "group; set comm.topology = 'auto' or 'flat', or comm.powersgd_impl = 'vatra'"
            )
        if self.method == "powersgd" and self.powersgd_impl == "vatra" and not self.error_feedback:
            raise ValueError(
                "comm.powersgd_impl = 'vatra' always uses error feedback; set comm.error_feedback = true"
            )
        if self.ratio != "auto" and not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"comm.ratio must be 'auto' or a share in (0, 1], got {self.ratio}")
        for key in ("start_step", "sparsity_warmup"):
            value = getattr(self, key)
            if value != "auto" and value < 0:
                raise ValueError(f"comm.{key} must be 'auto' or a step count ≥ 0, got {value}")
        no_feedback = self.method in ("none", "qsgd", "powersgd")
        if self.momentum_correction is True and (no_feedback or not self.error_feedback):
            why = f"method '{self.method}'" if no_feedback else "comm.error_feedback = false"
            raise ValueError(
                "momentum correction compresses each rank's velocity with error feedback, which "
                f"{why} does not have; use topk, randomk, onebit, fp16 or bf16 with "
                "comm.error_feedback = true, or set comm.momentum_correction = false"
            )
        return self
