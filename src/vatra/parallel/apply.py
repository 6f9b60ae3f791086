"""The Trainer's side of a parallel layout: build the mesh, shard the model, and what changes after."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn

from vatra.config import ParallelConfig
from vatra.errors import ConfigError
from vatra.parallel.fsdp import apply_fsdp, blocks_of
from vatra.parallel.grads import total_norm
from vatra.parallel.mesh import Mesh
from vatra.parallel.pipeline import Pipeline, build_pipeline
from vatra.parallel.tp import apply_tp

T = TypeVar("T")


@dataclass
class Parallel:
    """A model split over the mesh: which data this rank reads and how its gradient norm is summed."""

    mesh: Mesh
    data_group: dist.ProcessGroup
    pipeline: Pipeline | None = None

    @property
    def data_rank(self) -> int:
        return self.mesh.data_rank

    @property
    def data_world(self) -> int:
        return self.mesh.data_world

    def lockstep(self, batches: Iterable[tuple[T, bool]]) -> Iterator[tuple[T, bool]]:
        """``batches`` (this rank's evaluation share), padded so every data-parallel rank runs as many
        forwards: an FSDP forward is collective (it all-gathers each block), and the ranks' shares can
        differ by a batch. A rank that has run out repeats its last batch, marked not counted.

        One tiny all-reduce per batch over the data-parallel ranks; a rank with no batch at all cannot
        pad (it raises, after the others agree).
        """
        last: tuple[T, bool] | None = None
        it = iter(batches)
        while True:
            item = next(it, None)
            flags = torch.tensor([item is not None, item is None and last is None], dtype=torch.int64)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.data_group)
            if not flags[0]:
                return
            if flags[1]:
                raise RuntimeError(
                    "a data-parallel rank has no validation batch to run FSDP's collective forward "
                    "with; give the validation set at least one batch per data-parallel rank"
                )
            if item is None:
                assert last is not None
                yield last[0], False
            else:
                last = item
                yield item

    def after_backward(self) -> None:
        """Once per optimizer step, after the micro-steps' backward: a pipeline sums its tied weights'
        gradients (the token embedding on the first stage, the head's copy on the last)."""
        if self.pipeline is not None:
            self.pipeline.sync_tied()

    def step_metrics(self) -> dict[str, float]:
        """pp (collective over the pipeline's ranks): this rank's stage compute in the step
        (``pp_busy_s``) and the share of the pipeline's time it waited (``pp_bubble``, the bubble as
        this stage saw it); nothing without a pipeline."""
        if self.pipeline is None:
            return {}
        busy, bubble = self.pipeline.busy_and_bubble()
        return {"pp_busy_s": busy, "pp_bubble": bubble}

    def grad_norm(self, grads: list[torch.Tensor]) -> float:
        """The global gradient norm (collective over the mesh). NOTE: a host sync, as the trainer's own.
        A pipeline's stages add theirs up over pp, the tied head's copy counted once."""
        if self.pipeline is None:
            return float(total_norm(grads))
        counted = [p.grad for p in self.pipeline.norm_parameters() if p.grad is not None]
        return float(total_norm(counted, self.mesh["pp"].get_group()))


def parallelize(
    cfg: ParallelConfig,
    trainable: nn.Module,
    model: nn.Module,
    device: torch.device,
    *,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    example: torch.Tensor | None = None,
) -> Parallel:
    """Collective: build the mesh, then split ``model`` in place, tensor parallelism first (it changes
    the parameters into DTensors on ``tp``), FSDP over the data axes second (it shards those further,
    and ``trainable``: the model, or the model with a loss's parameters, is its root unit).

    With ``pp > 1`` the model is split into this rank's pipeline stage instead
    (:func:`build_pipeline`, which applies tp and fsdp to it): ``loss_fn`` and ``example`` (one
    micro-batch of inputs) are what it needs; ``trainable`` must be the model itself.
    """
    mesh = Mesh.build(cfg, device)
    if cfg.pp > 1:
        if trainable is not model or loss_fn is None or example is None:
            raise ConfigError(
                "parallel.pp: a loss with parameters of its own (multitask uncertainty weights) cannot "
                "be pipelined yet; use a loss without parameters, or parallel.pp = 1"
            )
        pipeline = build_pipeline(model, mesh, cfg, loss_fn, example)
        return Parallel(mesh, mesh.data_group(), pipeline)
    if cfg.tp > 1:
        apply_tp(model, mesh["tp"], cfg.tp_plan, sequence_parallel=cfg.sequence_parallel)
    if mesh.data_world > 1:
        apply_fsdp(trainable, mesh.data, cfg, blocks=blocks_of(model))
    return Parallel(mesh, mesh.data_group())
