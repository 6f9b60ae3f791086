"""How a step's micro-batches run: the ``MicroSteps`` seam and the plain strategy (DDP's).

A feature that must change how one optimizer step produces its gradients (synchronise them itself,
redo the step, sit it out) offers a strategy through its plugin's ``micro_steps`` instead of adding
a path to the :class:`~vatra.engine.Trainer`: ``balance.adaptive``'s (:mod:`vatra.balance.guarded`)
and ``diloco.adaptive_steps``' (:mod:`vatra.asyncdp.diloco`).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from vatra.engine.phases import phase

if TYPE_CHECKING:
    from vatra.engine.trainer import Trainer


@dataclass
class StepWork:
    """What one step's micro-steps did: the summed loss of its micro-batches (detached), and the
    seconds spent reading data and computing (with the gradient synchronisation)."""

    loss_sum: torch.Tensor
    data_time: float
    fwd_bwd_time: float


class MicroSteps(Protocol):
    """One optimizer step's gradients, from zero, over ``train.grad_accum`` micro-batches.

    Call order: the trainer picks one strategy at construction (the one a plugin's ``micro_steps``
    offers, else :class:`PlainSteps`) and calls :meth:`forward_module` once (what ``train.compile``
    wraps); per step, after the plugins' ``on_step_start``, it calls :meth:`run` once. After ``run``
    the gradients are synchronised across the ranks.
    """

    def forward_module(self, trainer: Trainer) -> nn.Module:
        """What runs forward: the DDP wrapper, or the plain module when the strategy syncs itself."""
        ...

    def run(self, trainer: Trainer, accum: int) -> StepWork | None:
        """Zero the gradients and run the step's micro-batches; None: this rank sits the step out
        (no data read, nothing computed, no update; the step still counts)."""
        ...


def micro_steps(trainer: Trainer, accum: int, module: nn.Module) -> StepWork:
    """Forward and backward of the step's ``accum`` micro-batches through ``module``, accumulating
    into the parameters' gradients (not zeroed here)."""
    loss_sum = torch.zeros((), device=trainer.dist.device)
    data_time = fwd_bwd_time = 0.0
    for micro in range(accum):
        td = time.perf_counter()
        with phase("data_wait"):
            inputs, target = trainer.next_batch()
        tf = time.perf_counter()
        data_time += tf - td
        # DDP all-reduces gradients on the last micro-batch only (no_sync before it).
        sync: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        if micro < accum - 1 and isinstance(module, DDP):
            sync = module.no_sync()
        with sync:
            scale = trainer.loss_weight / accum
            loss_sum += trainer.forward_backward(inputs, target, scale=scale, module=module)
        fwd_bwd_time += time.perf_counter() - tf  # includes DDP's all-reduce, overlapped with backward
    return StepWork(loss_sum, data_time, fwd_bwd_time)


class PlainSteps:
    """The default: the micro-steps through ``trainer.module`` (DDP's all-reduce inside backward of
    the last micro-batch, a parallel layout's collectives, or nothing on one process)."""

    def forward_module(self, trainer: Trainer) -> nn.Module:
        return trainer.module

    def run(self, trainer: Trainer, accum: int) -> StepWork:
        trainer.optimizer.zero_grad(set_to_none=True)
        return micro_steps(trainer, accum, trainer.module)
