"""The global gradient norm and clipping over sharded (DTensor) and replicated gradients."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.placement_types import Placement, _StridedShard


def local_tensor(t: Tensor) -> Tensor:
    """This rank's shard of a DTensor (the tensor itself otherwise), without autograd."""
    return t.to_local() if isinstance(t, DTensor) else t


def _sharded(placement: Placement) -> bool:
    """Whether a mesh axis splits the tensor. FSDP over tensor-parallel parameters shards them with
    ``_StridedShard``, whose ``is_shard()`` is False in torch 2.13: missing it under-counts the norm."""
    return placement.is_shard() or isinstance(placement, _StridedShard)


def total_norm(grads: Iterable[Tensor], pp_group: dist.ProcessGroup | None = None) -> Tensor:
    """The 2-norm of all gradients of the whole model, the same on every rank (an fp64 scalar).

    A DTensor's local squares are summed over the mesh axes it is sharded on (FSDP's ``dp_shard``,
    tp's ``tp``) and not over those it is replicated on; plain tensors are replicated. A partial
    gradient (sequence parallelism's LayerNorm weights: each rank's share of the sequence) is summed
    over its axis first, one all-reduce each. Gradients with
    the same sharding share one all-reduce per axis. ``pp_group``: stages hold disjoint parameters, so
    their sums of squares add up over the pipeline axis.
    """
    sums: dict[tuple[dist.ProcessGroup, ...], Tensor] = {}
    device = torch.device("cpu")
    for g in grads:
        device = g.device
        groups: tuple[dist.ProcessGroup, ...] = ()
        if isinstance(g, DTensor):
            if any(p.is_partial() for p in g.placements):  # sequence parallel's norms: sum the parts first
                whole = [Replicate() if p.is_partial() else p for p in g.placements]
                g = g.redistribute(g.device_mesh, whole)
            mesh = g.device_mesh
            groups = tuple(mesh.get_group(i) for i, p in enumerate(g.placements) if _sharded(p))
        square = local_tensor(g).detach().double().square().sum()
        sums[groups] = sums[groups] + square if groups in sums else square
    total = torch.zeros((), dtype=torch.float64, device=device)  # where the collectives run (NCCL: GPU)
    for groups, square in sums.items():  # the same keys in the same order on every rank (SPMD)
        for group in groups:
            dist.all_reduce(square, group=group)
        total += square
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    return total.sqrt()


def clip_(grads: Iterable[Tensor], max_norm: float, norm: float) -> None:
    """Scale the gradients so that their global ``norm`` becomes at most ``max_norm``."""
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
