"""The ``chaos`` section: faults injected on purpose, so tests and demos show recovery and healing."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from vatra.config._sections import Section


class DropClientsAt(Section):
    """Federated: ``count`` clients vanish at one secure-aggregation stage of one round."""

    round: int = Field(ge=1, description="Federated round (1-based).")
    stage: Literal["advertise", "share_keys", "masked_input", "unmask"] = Field(
        description="Protocol stage whose message the dropped clients never send."
    )
    count: int = Field(ge=1, description="How many of the round's clients drop (the highest ids).")


class ChaosConfig(Section):
    # worker death (resilience)
    kill_rank: int = Field(1, ge=0, description="Rank that kill_at_steps kills (SIGKILL).")
    kill_at_steps: list[int] = Field(
        [], description="Steps at which kill_rank dies; each fires once, not again after the resume."
    )
    corrupt_checkpoint_at: list[int] = Field([], description="Damage the checkpoint written at these steps.")
    # training faults (monitoring and healing)
    inject_nan_at: list[int] = Field(
        [],
        description="Steps whose data makes the loss NaN (the batches an undisturbed run trains on at "
        "these steps: a rollback skips them, a resume replays them).",
    )
    grad_spike_at: list[int] = Field(
        [],
        description="Steps whose data multiplies the gradients by grad_spike_factor (tied to the data, "
        "as inject_nan_at).",
    )
    grad_spike_factor: float = Field(1000.0, gt=0.0, description="Gradient multiplier at grad_spike_at.")
    lr_spike_at: list[int] = Field(
        [],
        description="Steps from whose data on the LR is multiplied by lr_spike_factor for lr_spike_steps "
        "steps (tied to the data, as inject_nan_at).",
    )
    lr_spike_factor: float = Field(100.0, gt=0.0, description="LR multiplier during an LR spike.")
    lr_spike_steps: int = Field(10, ge=1, description="How many steps each LR spike lasts.")
    slow_rank: int | None = Field(None, ge=0, description="Rank that sleeps slow_rank_s every step.")
    slow_rank_s: float = Field(0.05, ge=0.0, description="Seconds slow_rank sleeps per step.")
    speed_factors: list[float] = Field(
        [],
        description="Mixed hardware on one machine: rank r computes speed_factors[r] times slower (each "
        "forward pass is followed by a sleep of (factor - 1) × its forward-and-backward time); [] = off.",
    )
    oom_batch: list[int] = Field(
        [],
        description="Device memory on one machine: a training forward pass of more than oom_batch[r] "
        "samples on rank r raises an out-of-memory error (0 = no limit); [] = off.",
    )
    gpu_memory_gb: list[float] = Field(
        [],
        description="Real memory limits on GPUs: rank r's CUDA allocator holds at most gpu_memory_gb[r] GB "
        "(torch.cuda.set_per_process_memory_fraction; 0 = the whole GPU); [] = off. GPU only: on the CPU "
        "use oom_batch.",
    )

    def check_world_size(self, world_size: int) -> None:
        """Per-rank lists must name every rank (``ValueError`` otherwise)."""
        lists = (("speed_factors", self.speed_factors), ("oom_batch", self.oom_batch))
        for name, value in (*lists, ("gpu_memory_gb", self.gpu_memory_gb)):
            if value and len(value) != world_size:
                raise ValueError(
                    f"chaos.{name} lists {len(value)} entries but the run has {world_size} ranks; "
                    "give one per rank"
                )

    @field_validator("oom_batch", "gpu_memory_gb")
    @classmethod
    def _limits(cls, value: list[float]) -> list[float]:
        if any(b < 0 for b in value):
            raise ValueError(f"every entry must be ≥ 0 (0 = no limit); got {value}")
        return value

    @field_validator("speed_factors")
    @classmethod
    def _factors(cls, value: list[float]) -> list[float]:
        if any(f < 1.0 for f in value):
            raise ValueError(
                f"every speed factor must be ≥ 1 (1 = full speed, 4 = four times slower); got {value}"
            )
        return value

    # federated drop-outs (secure aggregation)
    drop_clients_at: DropClientsAt | None = Field(
        None, description="{round, stage, count}: clients that drop out mid-protocol in that round."
    )
