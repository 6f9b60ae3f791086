"""Run every policy on the same traces over several seeds and average what they cost."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from vatra.cost.sim.config import SimConfig
from vatra.cost.sim.engine import POLICIES, Job, Outcome
from vatra.cost.sim.hazard import HOUR, HazardModel, History, World, base_rate, monthly_frequency, observe
from vatra.cost.sim.traces import Interruptions, PriceTrace
from vatra.errors import ConfigError


@dataclass
class Setup:
    """What every policy shares: the traces, where the job starts, the cheapest zone."""

    trace: PriceTrace
    interruptions: Interruptions
    start: float
    zone: str  # the fixed-zone policies' zone: the cheapest median price

    @classmethod
    def of(cls, cfg: SimConfig, trace: PriceTrace, interruptions: Interruptions) -> Setup:
        start = trace.start + cfg.world.history_days * 86400.0
        if start >= trace.end:
            raise ConfigError(
                f"the price trace covers {(trace.end - trace.start) / 86400:.1f} days, not more than "
                f"world.history_days = {cfg.world.history_days}: give a longer trace or fewer history days"
            )
        return cls(trace, interruptions, start, min(trace.zones, key=lambda z: trace.medians[z]))


def world_of(cfg: SimConfig, s: Setup) -> World | None:
    """The world that draws interruptions, or None where observed events are replayed."""
    if s.interruptions.events:
        return None  # observed events are replayed
    w = cfg.world
    monthly = w.interruptions_per_month or monthly_frequency(
        s.interruptions, s.trace.instance_type, s.trace.zones
    )
    return World(s.trace, base_rate(monthly), w.price_elasticity, w.hazard_scale)


def history(cfg: SimConfig, s: Setup, rng: np.random.Generator) -> History:
    """The hazard model's training data: the trace's first world.history_days, fleet.max_nodes per zone."""
    events = s.interruptions.events or None
    return observe(s.trace, s.trace.start, s.start, cfg.fleet.max_nodes, world_of(cfg, s), events, rng)


def run_seed(cfg: SimConfig, s: Setup, seed: int, policies: tuple[str, ...] = POLICIES) -> list[Outcome]:
    """Every policy once, interruptions drawn with ``seed`` (the same seed for each policy)."""
    world = world_of(cfg, s)
    model, constant = None, 0.0
    if any(p.startswith("spot ") and p != "spot fixed" for p in policies):
        hist = history(cfg, s, np.random.default_rng([seed, 0]))
        model = HazardModel().fit(hist)
        constant = model.constant
    events: dict[str, np.ndarray] | None = None
    if world is None:
        events = {z: np.array([t for t, e in s.interruptions.events if e == z]) for z in s.trace.zones}
    out = []
    for i, policy in enumerate(policies):
        job = Job(cfg, policy, s.trace, s.start, s.zone, np.random.default_rng([seed, i + 1]), world, events,
                  model, constant)  # fmt: skip
        out.append(job.run())
    return out


def mean(outcomes: list[Outcome]) -> Outcome:
    """The mean of one policy's outcomes over seeds (finished only if every seed finished)."""
    avg = Outcome(outcomes[0].policy, finished=all(o.finished for o in outcomes))
    for f in fields(Outcome):
        if f.name not in ("policy", "finished"):
            values = [getattr(o, f.name) for o in outcomes]
            setattr(avg, f.name, sum(values) / len(values))
    return avg


def simulate(cfg: SimConfig, s: Setup, policies: tuple[str, ...] = POLICIES) -> list[Outcome]:
    """Each policy's mean outcome over ``world.seeds`` seeds (one seed with replayed events)."""
    seeds = 1 if s.interruptions.events else cfg.world.seeds
    runs = [run_seed(cfg, s, cfg.world.seed + k, policies) for k in range(seeds)]
    return [mean([r[i] for r in runs]) for i in range(len(policies))]


def as_json(cfg: SimConfig, s: Setup, results: list[Outcome], traces: dict[str, str]) -> dict[str, object]:
    base = results[0] if results and results[0].policy == "on-demand" else None

    def versus(o: Outcome) -> float | None:
        return o.cost_usd / base.cost_usd - 1.0 if base and base.cost_usd else None

    return {
        "traces": traces,
        "instance_type": s.trace.instance_type,
        "zone": s.zone,
        "start": s.start,
        "seeds": 1 if s.interruptions.events else cfg.world.seeds,
        "gpus": [
            cfg.fleet.min_nodes * cfg.fleet.gpus_per_node,
            cfg.fleet.max_nodes * cfg.fleet.gpus_per_node,
        ],
        "job_hours_on_fixed_fleet": cfg.job.total_steps
        * cfg.step_s
        * cfg.job.nodes
        / cfg.fleet.fixed_nodes
        / HOUR,
        "policies": [
            {**asdict(o), "cost_vs_on_demand": versus(o)}
            | {"completion_h": None if math.isnan(o.completion_h) else o.completion_h}
            for o in results
        ],
    }


def trace_names(prices: Path, interruptions: Path | None) -> dict[str, str]:
    return {"prices": str(prices), "interruptions": str(interruptions) if interruptions else ""}
