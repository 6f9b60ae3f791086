"""The training engine: ``Trainer``, ``TrainState``, the plugin protocol and process groups."""

from vatra.engine._plugin import Plugin, PluginList, overrides
from vatra.engine.dist import DistContext, pick_backend
from vatra.engine.optim import build_optimizer, build_scheduler, lr_factor
from vatra.engine.state import Checkpointer, TrainState
from vatra.engine.trainer import Trainer, rank_seed, seed_everything

__all__ = [
    "Checkpointer",
    "DistContext",
    "Plugin",
    "PluginList",
    "TrainState",
    "Trainer",
    "build_optimizer",
    "build_scheduler",
    "lr_factor",
    "overrides",
    "pick_backend",
    "rank_seed",
    "seed_everything",
]
