"""The ``parallel`` section: the device mesh (dp × fsdp × tp × pp), pipeline schedule, FSDP options."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from vatra.config._sections import Section
from vatra.errors import ConfigError

Schedule = Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"]
TPStyle = Literal["colwise", "rowwise", "sequence"]

# Schedules that hold more than one stage per rank (looped / V-shaped): parallel.virtual_stages each.
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "zero_bubble")


class ParallelConfig(Section):
    """How one model is split over the ranks: a mesh of ``dp × fsdp × tp × pp`` ranks (their product is
    the world size). All 1 (the default) is plain data parallelism with DDP over every rank.

    The mesh's axes, outermost first: ``pp`` (pipeline stages), ``dp_replicate`` (``dp``: replicas),
    ``dp_shard`` (``fsdp``: parameters, gradients and optimizer state sharded), ``tp`` (tensor
    parallel: innermost, so a tensor-parallel group's ranks are neighbours, on one host).
    """

    dp: int = Field(1, ge=1, description="Data-parallel replicas (the mesh's dp_replicate axis).")
    fsdp: int = Field(
        1, ge=1, description="FSDP2 shards (dp_shard axis): every block and the root are fully_shard-ed."
    )
    tp: int = Field(
        1,
        ge=1,
        description="Tensor-parallel ranks; gpt: heads and MLP split column/row-wise (must divide n_head).",
    )
    pp: int = Field(1, ge=1, description="Pipeline stages (at most model.n_layer for gpt).")
    schedule: Schedule = Field(
        "1f1b",
        description="Pipeline schedule: gpipe, 1f1b, interleaved_1f1b (virtual_stages per rank, looped), "
        "zero_bubble (two stages per rank in a V, backward split into input and weight parts).",
    )
    microbatches: int | None = Field(
        None,
        ge=1,
        description="Micro-batches per pipeline step (each train.batch_size / microbatches samples); "
        "unset = 2 × pp. At least pp, or stages sit idle.",
    )
    virtual_stages: int = Field(
        2, ge=2, description="interleaved_1f1b: model chunks per rank (zero_bubble always uses 2)."
    )
    fsdp_mixed_precision: Literal["off", "bf16", "fp16"] = Field(
        "off",
        description="FSDP2 MixedPrecisionPolicy: parameters all-gathered and computed in this dtype, "
        "gradients reduced in fp32; off = fp32 throughout.",
    )
    fsdp_cpu_offload: bool = Field(
        False,
        description="FSDP2 CPUOffloadPolicy: sharded parameters, gradients and optimizer step on the CPU.",
    )
    tp_plan: dict[str, TPStyle] = Field(
        {},
        description="A user model's tensor-parallel plan: module path (fnmatch glob, e.g. 'layers.*.fc1') "
        "→ colwise | rowwise | sequence; {} = the built-in plan (gpt).",
    )
    sequence_parallel: bool = Field(
        False,
        description="tp, gpt: LayerNorms and dropout on sequence shards (B, T / tp, C) between the "
        "matmuls (activation memory / tp; the same bytes as without). Not with pp.",
    )
    auto: bool = Field(
        False,
        description="Pick dp, fsdp, tp and pp at start with the planner (rank 0 measures the blocks; the "
        "fastest feasible layout the Trainer runs), replacing what dp, fsdp, tp and pp say; the choice "
        "is written to the run's config.toml and a resume keeps it.",
    )
    auto_memory_gb: float | None = Field(
        None, gt=0.0, description="auto: memory per rank the chosen layout must fit; unset = no limit."
    )
    auto_bandwidth_gbs: float = Field(
        1.0, gt=0.0, description="auto: link bandwidth between ranks the estimate assumes, GB/s."
    )
    auto_latency_us: float = Field(
        50.0, ge=0.0, description="auto: seconds one collective or send costs however small, in µs."
    )

    @property
    def enabled(self) -> bool:
        """Whether anything beyond plain data parallelism is asked for (dp alone runs DDP)."""
        return max(self.fsdp, self.tp, self.pp) > 1

    @property
    def size(self) -> int:
        """Ranks the layout needs: dp × fsdp × tp × pp."""
        return self.dp * self.fsdp * self.tp * self.pp

    @property
    def n_microbatches(self) -> int:
        return self.microbatches if self.microbatches is not None else 2 * self.pp

    @property
    def stages_per_rank(self) -> int:
        if self.schedule == "zero_bubble":
            return 2
        return self.virtual_stages if self.schedule == "interleaved_1f1b" else 1

    def data_rank(self, rank: int) -> int:
        """Global ``rank``'s index among the data-parallel ranks: the mesh is row-major over
        ``(pp, dp, fsdp, tp)``, so tp peers are neighbours and share a data index."""
        if not self.enabled:  # data parallelism alone (DDP): every rank reads its own share
            return rank
        return (rank // self.tp) % (self.dp * self.fsdp)

    def is_default(self) -> bool:
        return self == ParallelConfig()


def check_world(cfg: ParallelConfig, world_size: int) -> None:
    """The layout's product must be the world size (known only once the job has started)."""
    if cfg.auto:
        raise ConfigError(
            "parallel.auto: the layout is chosen when vatra.fit or vatra train starts the run; a "
            "Trainer built directly needs parallel.dp, fsdp, tp and pp set (see vatra plan)"
        )
    if cfg.size != world_size:
        raise ConfigError(
            f"parallel: dp × fsdp × tp × pp = {cfg.dp} × {cfg.fsdp} × {cfg.tp} × {cfg.pp} = {cfg.size}, "
            f"but the job has {world_size} rank(s); make the product equal the world size "
            f"(e.g. --nproc {cfg.size}, or change one of the four)"
        )
