"""A trace-driven simulator of a job on spot and on-demand nodes under several policies."""

from vatra.cost.sim.config import SimConfig, load_sim_config
from vatra.cost.sim.engine import POLICIES, Job, Outcome
from vatra.cost.sim.hazard import HazardModel, World, log_loss, young_daly
from vatra.cost.sim.simulate import Setup, simulate
from vatra.cost.sim.traces import Interruptions, PriceTrace, TraceError, read_interruptions, read_prices

__all__ = [
    "POLICIES",
    "HazardModel",
    "Interruptions",
    "Job",
    "Outcome",
    "PriceTrace",
    "Setup",
    "SimConfig",
    "TraceError",
    "World",
    "load_sim_config",
    "log_loss",
    "read_interruptions",
    "read_prices",
    "simulate",
    "young_daly",
]
