"""FSDP2 (``fully_shard``) over the data-parallel axes: each block, then the root."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from vatra.config import ParallelConfig

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks FSDP wraps one by one (one all-gather each, freed after its forward):
    ``model.blocks`` (gpt) or ``model.layers`` when it is a list of modules, else none (root only)."""
    for name in ("blocks", "layers"):
        found = getattr(model, name, None)
        if isinstance(found, nn.ModuleList | nn.Sequential | nn.ModuleDict):
            return list(found.values()) if isinstance(found, nn.ModuleDict) else list(found)
    return []


def fsdp_options(cfg: ParallelConfig) -> dict[str, Any]:
    """``fully_shard`` keyword arguments for the config's mixed precision and offload."""
    opts: dict[str, Any] = {}
    if cfg.fsdp_mixed_precision != "off":
        # Gradients reduce in fp32: a bf16 sum over many ranks loses the small ones (and gloo's bf16
        # all-reduce is unreliable, see docs/parallel.md).
        opts["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=DTYPES[cfg.fsdp_mixed_precision], reduce_dtype=torch.float32
        )
    if cfg.fsdp_cpu_offload:
        # pinned host memory speeds the copies to a GPU; without one there is nothing to pin
        opts["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    return opts


def apply_fsdp(
    model: nn.Module, mesh: DeviceMesh, cfg: ParallelConfig, blocks: list[nn.Module] | None = None
) -> nn.Module:
    """Shard ``model`` in place over ``mesh`` (1-D ``dp_shard``, or 2-D ``dp_replicate × dp_shard``
    for replicas of shards: HSDP); returns it.

    Each block is its own FSDP unit: its parameters are all-gathered just before its forward and
    freed after it (``reshard_after_forward``), so a rank holds one block's full parameters at a
    time plus its 1/fsdp share of the rest. The root unit takes what is left (embeddings, final norm,
    head; a tied weight stays one parameter there). ``blocks``: the units, when ``model`` wraps the
    module that holds them (default: :func:`blocks_of` ``model``).
    """
    opts = fsdp_options(cfg)
    for block in blocks_of(model) if blocks is None else blocks:
        fully_shard(block, mesh=mesh, **opts)
    fully_shard(model, mesh=mesh, **opts)
    return model
