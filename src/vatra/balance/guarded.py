"""``balance.adaptive``'s micro-steps: the gradients synchronised after backward, so that a rank that
runs out of memory can tell the others and every rank redoes the step with a smaller batch there.

DDP's all-reduce inside backward would leave the other ranks waiting for a rank that failed; here
the micro-steps run on the plain module and one header all-reduce says which ranks finished before
the gradients are averaged (buckets of ``dist.bucket_cap_mb``: the sum DDP's would give, after
backward instead of overlapped with it). The header also carries each rank's squared gradient norm,
from which the balancer estimates the gradient noise scale (:mod:`vatra.balance.adaptive`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
from torch import nn

from vatra.comm.batching import coalesced_
from vatra.data import GlobalBatchSampler
from vatra.engine.steps import StepWork, micro_steps

if TYPE_CHECKING:
    from vatra.engine import Trainer

MAX_OOM_REDO = 8  # tries of one step with balance.adaptive before an out-of-memory error stops the run


def is_out_of_memory(exc: BaseException) -> bool:
    """A GPU's out-of-memory error, or the CPU allocator's."""
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)
    )


def _sq_norm(tensors: list[torch.Tensor]) -> float:
    if not tensors:
        return 0.0
    return float(torch.stack(torch._foreach_norm(tensors, 2.0)).double().square().sum())


class GuardedSteps:
    """The micro-steps on the plain module, then :meth:`sync_gradients`.

    A rank that runs out of memory frees what it can and tells the others at the synchronisation;
    every rank then drops the step's gradients, rewinds the data to the step's start, lets the
    plugins shrink the failing ranks' batches (``on_oom``, an ``oom`` event on rank 0) and redoes
    the step, at most ``MAX_OOM_REDO`` times.
    """

    def __init__(self, sampler: GlobalBatchSampler) -> None:
        self.sampler = sampler

    def forward_module(self, trainer: Trainer) -> nn.Module:
        return trainer.trainable

    def run(self, trainer: Trainer, accum: int) -> StepWork:
        sampler = self.sampler
        trainer.optimizer.zero_grad(set_to_none=True)
        for attempt in range(1, MAX_OOM_REDO + 1):
            start = (sampler.epoch, sampler.position)
            done: StepWork | None = None
            try:
                done = micro_steps(trainer, accum, trainer.trainable)
            except Exception as exc:
                if not is_out_of_memory(exc):
                    raise
                trainer.optimizer.zero_grad(set_to_none=True)
                if trainer.dist.device.type == "cuda":
                    torch.cuda.empty_cache()
            ts = time.perf_counter()
            failed = self.sync_gradients(trainer, done is not None, accum)
            if not failed:
                assert done is not None
                done.fwd_bwd_time += time.perf_counter() - ts  # as DDP's all-reduce
                return done
            trainer.optimizer.zero_grad(set_to_none=True)
            sampler.seek(*start)
            if trainer.dist.is_main:
                trainer.log_event("oom", ranks=failed, sizes=list(sampler.sizes), attempt=attempt)
            trainer.plugins.on_oom(trainer, failed)
        raise RuntimeError(
            f"step {trainer.state.step + 1} ran out of memory {MAX_OOM_REDO} times in a row; lower "
            "train.batch_size (or balance.global_batch), or balance.memory_budget_gb"
        )

    def sync_gradients(self, trainer: Trainer, ok: bool, accum: int) -> list[int]:
        """The ranks that could not finish their micro-steps (out of memory), or none, in which case
        the gradients are averaged (one header all-reduce, then buckets of ``dist.bucket_cap_mb``).

        The header also carries each rank's squared gradient norm of its own mean loss, from which
        with the averaged gradient's (the step's ``grad_norm``) the gradient noise scale is estimated:
        ``state.extras["grad_sq"]`` = {ranks: [|g_r|²], sizes: [b_r], accum}.
        """
        ctx = trainer.dist
        params = [p for p in trainer.trainable.parameters() if p.requires_grad]
        w = ctx.world_size
        header = torch.zeros(2 * w, dtype=torch.float64)
        unscale = trainer.scaler.get_scale() if trainer.scaler.is_enabled() else 1.0
        grads: list[torch.Tensor] = []
        if ok:
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
            header[ctx.rank] = 1.0
            header[w + ctx.rank] = _sq_norm(grads) / (unscale * trainer.loss_weight) ** 2
        ctx.all_reduce_sum(header)
        failed = [r for r in range(w) if header[r] < 0.5]
        if failed:
            return failed
        if ctx.distributed:
            coalesced_(grads, ctx.all_reduce_sum, int(trainer.cfg.dist.bucket_cap_mb * 2**20))
            torch._foreach_div_(grads, w)
        trainer.state.extras["grad_sq"] = {
            "ranks": header[w:].tolist(),
            "sizes": list(self.sampler.sizes),
            "accum": accum,
        }
        return []
