"""Two-level all-reduce: reduce inside each host, ring among host leaders, broadcast inside the host.

Across hosts only the leaders talk, each sending 2·(H−1)/H·n bytes for H hosts — instead of every
rank's ring edge crossing hosts. Intra-host traffic stays on the host (loopback in the test cluster).
Groups are built once with ``new_group`` (a collective: every rank builds every group, in order).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from vatra.comm.ring import ring_all_gather_blocks, ring_all_reduce_
from vatra.comm.topology import ByteCounter, Topology, nbytes, wait_all
from vatra.errors import ConfigError


class HierarchicalTopology(Topology):
    name = "hierarchical"

    def __init__(self, hosts: list[list[int]], counter: ByteCounter | None = None) -> None:
        super().__init__(counter)
        flat = sorted(r for h in hosts for r in h)
        if flat != list(range(self.world_size)) or any(not h for h in hosts):
            raise ConfigError(f"host layout {hosts} must split ranks 0..{self.world_size - 1} into hosts")
        self.hosts = [sorted(h) for h in hosts]
        self.leaders = [h[0] for h in self.hosts]
        self.host_groups = [dist.new_group(h) for h in self.hosts]
        self.leader_group = dist.new_group(self.leaders)
        self.host_index = next(i for i, h in enumerate(self.hosts) if self.rank in h)
        self.host = self.hosts[self.host_index]
        self.group = self.host_groups[self.host_index]
        self.leader = self.host[0]
        self.order = [r for h in self.hosts for r in h]  # rank at each position of the host-major layout

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    def _gather_to_leader(self, tensor: torch.Tensor, blocks: list[torch.Tensor] | None) -> None:
        """Members send ``tensor`` to the leader; the leader receives member i into ``blocks[i]``."""
        if not self.is_leader:
            dist.send(tensor, dst=self.leader, group=self.group)
            self.counter.add(nbytes(tensor))
            return
        assert blocks is not None
        wait_all([dist.irecv(blocks[i], src=r, group=self.group) for i, r in enumerate(self.host) if i > 0])

    def _broadcast_from_leader(self, tensor: torch.Tensor) -> None:
        if not self.is_leader:
            dist.recv(tensor, src=self.leader, group=self.group)
            return
        wait_all([dist.isend(tensor, dst=r, group=self.group) for r in self.host[1:]])
        for _ in self.host[1:]:
            self.counter.add(nbytes(tensor))

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.numel() == 0 or self.world_size == 1:
            return tensor
        members = len(self.host) - 1
        if self.is_leader and members:
            scratch = torch.empty(members, tensor.numel(), dtype=tensor.dtype, device=tensor.device)
            self._gather_to_leader(tensor, [tensor, *scratch.unbind(0)])
            tensor.add_(scratch.sum(dim=0))
        elif not self.is_leader:
            self._gather_to_leader(tensor, None)
        if self.is_leader:
            ring_all_reduce_(tensor, self.leaders, self.leader_group, self.counter)
        if members:
            self._broadcast_from_leader(tensor)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        n = tensor.numel()
        hostmajor = torch.empty(self.world_size * n, dtype=tensor.dtype, device=tensor.device)
        if n == 0:
            return hostmajor
        if self.is_leader:
            start = sum(len(h) for h in self.hosts[: self.host_index]) * n
            mine = hostmajor[start : start + len(self.host) * n].view(len(self.host), n)  # (L, n)
            mine[0] = tensor.reshape(-1)
            self._gather_to_leader(tensor, list(mine.unbind(0)))
            sizes = [len(h) * n for h in self.hosts]
            ring_all_gather_blocks(hostmajor, sizes, self.leaders, self.leader_group, self.counter)
        else:
            self._gather_to_leader(tensor.reshape(-1).contiguous(), None)
        if len(self.host) > 1:
            self._broadcast_from_leader(hostmajor)
        out = torch.empty_like(hostmajor)
        out.view(self.world_size, n)[self.order] = hostmajor.view(
            self.world_size, n
        )  # host-major → rank order
        return out
