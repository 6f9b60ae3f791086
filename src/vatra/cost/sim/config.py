"""The spot simulator's own TOML file: ``[job]``, ``[fleet]``, ``[world]``, ``[policy]``, ``[traces]``.

It is not a training config: it describes a job by its total work and its step, checkpoint and
restore times (given, or measured from a real run folder with ``job.measure_from``), the fleet it
may rent, how interruptions are drawn, and the knobs of the policies compared side by side.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from vatra.errors import ConfigError


class _Table(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class JobConfig(_Table):
    total_steps: int = Field(gt=0, description="Steps the job must complete.")
    step_s: float | None = Field(None, gt=0, description="Seconds per step on job.nodes nodes.")
    nodes: int = Field(
        1, ge=1, description="Node count step_s was measured on; throughput scales linearly with nodes."
    )
    checkpoint_s: float | None = Field(None, ge=0, description="Seconds a checkpoint pauses training.")
    restore_s: float | None = Field(
        None, ge=0, description="Seconds from a restart to training again (load + warm-up)."
    )
    measure_from: str | None = Field(
        None,
        description="A run folder (summary.json, events.jsonl) to read step, checkpoint, restore times from.",
    )


class FleetConfig(_Table):
    instance_type: str | None = Field(
        None, description="The trace's instance type to use (default: the only one)."
    )
    gpus_per_node: int = Field(8, ge=1, description="GPUs per node (shown in the output only).")
    on_demand_usd_per_h: float = Field(gt=0, description="On-demand price of one node per hour.")
    nodes: int | None = Field(
        None, ge=1, description="Nodes of the fixed-size policies (default: max_nodes)."
    )
    min_nodes: int = Field(1, ge=1, description="Fewest nodes the autoscaling policy runs on.")
    max_nodes: int = Field(ge=1, description="Most nodes the autoscaling policy runs on.")
    replace_s: float = Field(300.0, ge=0, description="Seconds until a reclaimed spot node is replaced.")
    zones: list[str] | None = Field(None, description="Zones (regions) of the trace to use (default: all).")

    @model_validator(mode="after")
    def _order(self) -> FleetConfig:
        if self.min_nodes > self.max_nodes:
            raise ValueError(f"min_nodes ({self.min_nodes}) > max_nodes ({self.max_nodes}): swap them")
        return self

    @property
    def fixed_nodes(self) -> int:
        return self.nodes or self.max_nodes


class WorldConfig(_Table):
    history_days: float = Field(
        7.0,
        ge=0,
        description="Days at the trace's start used to fit the hazard model; the job starts after them.",
    )
    interruptions_per_month: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="Per-node monthly interruption frequency (default: the Spot Advisor bucket).",
    )
    hazard_scale: float = Field(
        1.0, gt=0, description="Multiplies the drawn hazard (stress test of a bucket)."
    )
    price_elasticity: float = Field(
        2.0,
        ge=0,
        description="Hazard ∝ (price / the zone's median price) to this power: dear hours are riskier.",
    )
    seeds: int = Field(
        5, ge=1, le=1000, description="Independent draws of interruptions; figures are their means."
    )
    seed: int = Field(0, description="First seed.")


class PolicyConfig(_Table):
    fixed_interval_s: float = Field(
        3600.0, gt=0, description="Checkpoint interval of the fixed-interval policy."
    )
    risk_threshold: float = Field(
        0.02,
        gt=0,
        lt=1,
        description="Predicted per-node interruption probability in the next hour that triggers action.",
    )
    migrate_s: float = Field(600.0, ge=0, description="Seconds to move the job to nodes in another zone.")
    scale_up_below: float = Field(
        1.0,
        gt=0,
        description="Autoscaling runs max_nodes while price / zone median is at most this, else min_nodes.",
    )


class TracesConfig(_Table):
    prices: str | None = Field(None, description="Price trace, relative to this file (--trace overrides).")
    interruptions: str | None = Field(
        None, description="Spot Advisor buckets or an interruption event list (--interruptions overrides)."
    )


class SimConfig(_Table):
    job: JobConfig
    fleet: FleetConfig
    world: WorldConfig = WorldConfig()
    policy: PolicyConfig = PolicyConfig()
    traces: TracesConfig = TracesConfig()

    @property
    def step_s(self) -> float:
        assert self.job.step_s is not None  # filled in by load_sim_config
        return self.job.step_s


def _measured(run: Path) -> dict[str, float]:
    """Step, checkpoint and restore seconds of a finished run: wall_s / steps, the summed
    ``checkpoint_s`` over the saves logged, and the mean ``recovery_s`` of its resumes."""
    summary_path = run / "summary.json"
    try:
        summary = json.loads(summary_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"job.measure_from: cannot read {summary_path}: {err}; give a finished run folder"
        ) from None
    out: dict[str, float] = {}
    if summary.get("steps") and summary.get("wall_s"):
        out["step_s"] = float(summary["wall_s"]) / float(summary["steps"])
    saves, recoveries = 0, []
    events = run / "events.jsonl"
    if events.exists():
        for line in events.read_text(encoding="utf-8").splitlines():
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            saves += ev.get("event") == "checkpoint_saved"
            if ev.get("event") in ("resumed", "recovered") and isinstance(ev.get("recovery_s"), int | float):
                recoveries.append(float(ev["recovery_s"]))
    if saves and isinstance(summary.get("checkpoint_s"), int | float):
        out["checkpoint_s"] = float(summary["checkpoint_s"]) / saves
    if recoveries:
        out["restore_s"] = sum(recoveries) / len(recoveries)
    return out


def _run_folder(given: Path, sim_path: Path) -> Path:
    """``job.measure_from``: a run folder (relative to the simulator's file), or a training config
    whose newest finished run (``<run.out_dir>/<run.name>-*`` holding a summary.json) is read."""
    if given.suffix != ".toml":
        return given if given.is_absolute() else sim_path.parent / given
    from vatra.config import load_config

    train = load_config(given)
    runs = sorted(
        Path(train.run.out_dir).glob(f"{train.run.name}-*/summary.json"), key=lambda p: p.stat().st_mtime
    )
    if not runs:
        raise ConfigError(
            f"job.measure_from: no finished run of {given} in {train.run.out_dir}: run 'vatra train {given}' "
            "first, or give the step, checkpoint and restore times in [job]"
        )
    return runs[-1].parent


def load_sim_config(path: Path) -> SimConfig:
    """Read and validate the simulator's TOML; errors are one line naming the key."""
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise ConfigError(f"cannot read {path}: {err.strerror or err}") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from None
    try:
        cfg = SimConfig.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"{path}: {loc}: {first['msg']}") from None
    job = cfg.job
    if job.measure_from is not None:
        run = _run_folder(Path(job.measure_from), path)
        for key, value in _measured(run).items():
            if getattr(job, key) is None:  # a value given in [job] wins over the measured one
                setattr(job, key, value)
    missing = [k for k in ("step_s", "checkpoint_s", "restore_s") if getattr(job, k) is None]
    if missing:
        raise ConfigError(
            f"{path}: job.{missing[0]} is not set and not measured: give it in [job] or point "
            "job.measure_from at a run folder that logged it"
        )
    return cfg


def resolve(path: Path, name: str | None) -> Path | None:
    """A trace path from the config, relative to the config file."""
    if name is None:
        return None
    p = Path(name)
    return p if p.is_absolute() else path.parent / p
