"""Typed config sections: one pydantic model per TOML section, documented per field."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Section(BaseModel):
    """Base of every section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunConfig(Section):
    name: str = Field("run", description="Run name; the run folder is runs/<name>-<timestamp>.")
    seed: int = Field(0, description="Global seed; rank r seeds its own RNGs with seed + r.")
    out_dir: str = Field("runs", description="Parent folder of run folders.")
    log_every: int = Field(10, ge=1, description="Plain log line (non-terminal) every N steps.")
    progress: Literal["auto", "rich", "plain", "off"] = Field(
        "auto", description="Rank 0's progress display: rich bar on a terminal, plain lines otherwise."
    )
    tensorboard: bool = Field(True, description="Write TensorBoard scalars to <run>/tb.")
    tb_every: int = Field(
        10, ge=1, description="Per-step scalars go to TensorBoard every N steps (metrics.jsonl has all)."
    )


class DataConfig(Section):
    name: Literal["digits", "synthetic", "text"] = Field("digits", description="Dataset.")
    val_fraction: float = Field(0.2, gt=0.0, lt=1.0, description="Held-out share (digits, synthetic).")
    sharding: Literal["random", "contiguous", "stratified", "dirichlet", "label_skew"] = Field(
        "random", description="How training samples are split across ranks."
    )
    alpha: float = Field(0.5, gt=0.0, description="Dirichlet concentration (sharding = dirichlet).")
    classes_per_shard: int = Field(2, ge=1, description="Classes per shard (sharding = label_skew).")
    # synthetic
    samples: int = Field(20000, ge=10, description="synthetic: number of samples.")
    features: int = Field(64, ge=2, description="synthetic: input features.")
    classes: int = Field(10, ge=2, description="synthetic: number of classes.")
    informative: int = Field(32, ge=1, description="synthetic: informative features (≤ features).")
    noise: float = Field(0.05, ge=0.0, le=1.0, description="synthetic: share of flipped labels.")
    # text
    block_size: int = Field(64, ge=2, description="text: context length in characters.")
    max_chars: int = Field(2_000_000, ge=10_000, description="text: corpus size cap in characters.")
    val_windows: int = Field(512, ge=1, description="text: number of fixed validation windows.")

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        if self.informative > self.features:
            raise ValueError(f"informative ({self.informative}) must be ≤ features ({self.features})")
        return self


class ModelConfig(Section):
    name: Literal["mlp", "cnn", "gpt"] = Field("mlp", description="Built-in model.")
    hidden: list[int] = Field([128, 128], description="mlp: hidden layer widths.")
    channels: list[int] = Field([16, 32], description="cnn: conv channel widths.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout probability.")
    n_layer: int = Field(2, ge=1, description="gpt: transformer blocks.")
    n_head: int = Field(4, ge=1, description="gpt: attention heads.")
    n_embd: int = Field(128, ge=8, description="gpt: embedding width (divisible by n_head).")

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if any(h < 1 for h in self.hidden + self.channels):
            raise ValueError("layer widths must be ≥ 1")
        return self


class TrainConfig(Section):
    steps: int = Field(200, ge=1, description="Optimizer steps.")
    batch_size: int = Field(32, ge=1, description="Samples per rank per micro-step.")
    grad_accum: int = Field(1, ge=1, description="Micro-steps accumulated per optimizer step.")
    clip_grad_norm: float = Field(0.0, ge=0.0, description="Clip global grad norm to this; 0 = off.")
    eval_every: int = Field(50, ge=0, description="Evaluate every N steps (and at the end); 0 = end only.")
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="Autocast precision; fp16 uses a gradient scaler."
    )


class OptimConfig(Section):
    name: Literal["sgd", "adam", "adamw"] = Field("adamw", description="Optimizer.")
    lr: float = Field(1e-3, gt=0.0, description="Peak learning rate.")
    momentum: float = Field(0.9, ge=0.0, lt=1.0, description="sgd: momentum.")
    weight_decay: float = Field(0.0, ge=0.0, description="Weight decay.")
    schedule: Literal["constant", "cosine"] = Field("constant", description="LR schedule after warm-up.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps from 0 to lr.")
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="cosine: final lr as a share of lr.")


class DistConfig(Section):
    nproc: int = Field(1, ge=1, description="Worker processes per node (CLI --nproc overrides).")
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="auto = nccl when CUDA is present, else gloo."
    )
    timeout_s: float = Field(300.0, gt=0.0, description="Collective timeout in seconds.")
    bucket_cap_mb: float = Field(25.0, gt=0.0, description="DDP gradient bucket size in MB.")
