"""The device mesh of a layout: ``pp × dp_replicate × dp_shard × tp`` ranks, and its groups."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from vatra.config import ParallelConfig
from vatra.config._parallel import check_world

# Outermost first: pipeline stages talk least (one activation per micro-batch), tensor-parallel ranks
# most (two all-reduces per block), so tp is innermost, where neighbouring ranks share a host.
AXES = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass
class Mesh:
    """The job's ``DeviceMesh`` with all four axes (size-1 axes included: one code path for every
    layout, and gloo builds them), and this rank's place in it."""

    mesh: DeviceMesh
    cfg: ParallelConfig

    @classmethod
    def build(cls, cfg: ParallelConfig, device: torch.device) -> Mesh:
        """Collective: every rank builds the same mesh (``init_device_mesh`` makes each axis's groups)."""
        check_world(cfg, dist.get_world_size() if dist.is_initialized() else 1)
        shape = (cfg.pp, cfg.dp, cfg.fsdp, cfg.tp)
        return cls(init_device_mesh(device.type, shape, mesh_dim_names=AXES), cfg)

    def __getitem__(self, axes: str | tuple[str, ...]) -> DeviceMesh:
        return self.mesh[axes]

    @property
    def data(self) -> DeviceMesh:
        """The data-parallel sub-mesh ``(dp_replicate, dp_shard)``: ranks that read different batches."""
        return self.mesh["dp_replicate", "dp_shard"]

    @property
    def data_rank(self) -> int:
        """This rank's index among the data-parallel ranks (which shard of the data it reads)."""
        replica, shard = self.mesh["dp_replicate"].get_local_rank(), self.mesh["dp_shard"].get_local_rank()
        index = replica * self.cfg.fsdp + shard
        assert index == self.cfg.data_rank(dist.get_rank()), "init_device_mesh's rank order changed"
        return index

    @property
    def data_world(self) -> int:
        return self.cfg.dp * self.cfg.fsdp

    def data_group(self) -> dist.ProcessGroup:
        """One group over the data-parallel ranks (flattened ``dp_replicate × dp_shard``)."""
        return self.data._flatten("dp").get_group()

    @property
    def pp_rank(self) -> int:
        return self.mesh["pp"].get_local_rank()
