"""``dist.mode = "local_sgd"``: post-local SGD on torch's own hook and model averager."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
    PostLocalSGDState,
    post_localSGD_hook,
)
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.nn.parallel import DistributedDataParallel as DDP

from vatra.asyncdp._state import copy_into, flat_optimizer_state, load_flat_optimizer_state, named
from vatra.config import LocalSGDConfig
from vatra.engine import Plugin

if TYPE_CHECKING:
    from vatra.engine import Trainer


class LocalSGD(Plugin):
    """For ``warmup_steps`` steps DDP all-reduces gradients (torch's ``post_localSGD_hook``); after
    that each rank steps on its own gradient, and after every step ``k`` with
    ``(k - warmup_steps) % every == 0`` (and after the last step) torch's ``PeriodicModelAverager``
    averages the parameters in one fused all-reduce. Buffers (BatchNorm statistics) stay each rank's.

    Metrics: ``comm_bytes`` (this rank's ring share of what was all-reduced this step: gradients
    during the warm-up, parameters at an averaging step, else 0) and ``averaged``.
    """

    def __init__(self, cfg: LocalSGDConfig) -> None:
        self.cfg = cfg
        self.hook_state: PostLocalSGDState | None = None
        self.averager: PeriodicModelAverager | None = None
        self.trainer: Trainer | None = None
        self.param_bytes = 0
        self.total_bytes = 0
        self.sent = 0
        self.averaged = False

    def on_fit_start(self, trainer: Trainer) -> None:
        if not isinstance(trainer.module, DDP):
            return  # one rank: nothing to average
        warm = self.cfg.warmup_steps
        # no gradient all-reduce after the warm-up (torch's default all-reduces inside subgroups)
        self.hook_state = PostLocalSGDState(
            process_group=None, subgroup=None, start_localSGD_iter=warm, post_local_gradient_allreduce=False
        )
        trainer.module.register_comm_hook(self.hook_state, post_localSGD_hook)
        # after_update decides when to average (from the step, so a resume agrees) and sets the
        # averager's own counter so that it does
        with warnings.catch_warnings():  # every = 1 is local SGD's equivalence with DDP, on purpose
            warnings.simplefilter("ignore", UserWarning)
            self.averager = PeriodicModelAverager(period=self.cfg.every, warmup_steps=warm)
        w = trainer.dist.world_size
        n = sum(p.numel() * p.element_size() for p in trainer.trainable.parameters() if p.requires_grad)
        self.param_bytes = 2 * (w - 1) * n // w  # the ring formula comm counts DDP's all-reduce with
        self.trainer = trainer
        trainer.state.rank_states["local_sgd"] = self  # each rank's own parameters and optimizer state
        trainer.log_event("local_sgd", every=self.cfg.every, warmup_steps=warm)

    def on_step_start(self, trainer: Trainer) -> None:
        if self.hook_state is not None:
            self.hook_state.iter = trainer.state.step  # counted from the step, so a resume agrees

    def after_update(self, trainer: Trainer) -> None:
        if self.averager is None:
            return
        k, warm, every = trainer.state.step, self.cfg.warmup_steps, self.cfg.every
        self.sent = self.param_bytes if k <= warm else 0  # DDP's gradient all-reduce during warm-up
        self.averaged = k > warm and ((k - warm) % every == 0 or k == trainer.cfg.train.steps)
        if self.averaged:
            self.averager.step = warm  # (s - warm) % every == 0: average now
            self.averager.average_parameters(trainer.trainable.parameters())
            self.sent += self.param_bytes

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        if self.averager is None:
            return
        self.total_bytes += self.sent
        metrics["comm_bytes"] = self.sent
        metrics["averaged"] = self.averaged

    def on_fit_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        summary["comm_bytes"] = self.total_bytes
        summary["dist_mode"] = "local_sgd"

    def state_dict(self) -> dict[str, dict[str, Any]]:
        assert self.trainer is not None
        t = self.trainer
        return {"local": named(t.trainable), "inner": flat_optimizer_state(t.optimizer)}

    def load_state_dict(self, state: dict[str, dict[str, Any]]) -> None:
        assert self.trainer is not None
        if not state:
            return
        t = self.trainer
        copy_into(named(t.trainable), state["local"], "local parameters")
        load_flat_optimizer_state(t.optimizer, state["inner"])
