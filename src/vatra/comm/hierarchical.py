"""Two-level all-reduce: reduce inside each host, ring among host leaders, broadcast inside the host,
pipelined over chunks so the host-local steps overlap the cross-host ring.

Across hosts only the leaders talk, each sending 2·(H−1)/H·n bytes for H hosts — instead of every
rank's ring edge crossing hosts. Intra-host traffic stays on the host (loopback in the test cluster).
Groups are built once with ``new_group`` (a collective: every rank builds every group, in order).
The leaders' ring is also a topology of its own (``leader_ring``), and the host-local steps are
methods (``reduce_to_leader_``, ``broadcast_from_leader_``): the DDP hook composes them with a lossy
compressor so that only compressed payloads cross hosts. The bytes of the leaders' ring are counted
in ``ByteCounter.cross_host`` as well.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from vatra.comm.ring import RingTopology, ring_all_gather_blocks
from vatra.comm.topology import ByteCounter, Topology, nbytes, wait_all
from vatra.errors import ConfigError

# Chunk size of the pipelined all-reduce: small enough that the exposed first gather and last
# broadcast are short, large enough that the ring's per-message cost stays small next to the link time.
CHUNK_BYTES = 2 << 20


def _chunks(t: torch.Tensor) -> list[torch.Tensor]:
    """Views of a contiguous 1-D tensor, ≤ ``CHUNK_BYTES`` each, in order."""
    return list(t.split(max(1, CHUNK_BYTES // t.element_size())))


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
        self.leader_ring = (
            _LeaderRing(self.counter, self.leaders, self.leader_group) if self.is_leader else None
        )

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    def reduce_to_leader_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Exact sum of a contiguous 1-D ``tensor`` over this host's ranks, in place on the leader
        (members' own tensors are left as they were); the leader adds its members in rank order."""
        if tensor.numel() == 0 or len(self.host) == 1:
            return tensor
        if not self.is_leader:
            self._gather_to_leader(tensor, None)
            return tensor
        scratch = torch.empty(len(self.host) - 1, tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        self._gather_to_leader(tensor, [tensor, *scratch.unbind(0)])
        for row in scratch:  # (n,) per member
            tensor.add_(row)
        return tensor

    def broadcast_from_leader_(self, tensor: torch.Tensor) -> torch.Tensor:
        """The leader's ``tensor`` into every member's, in place."""
        if tensor.numel() and len(self.host) > 1:
            self._broadcast_from_leader(tensor)
        return tensor

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
        """Pipelined over chunks of ≤ ``CHUNK_BYTES``: every chunk's host-local transfers are posted at
        once and run in gloo's background threads, while the leader reduces chunk c, rings it among
        the leaders (the slow cross-host step, one chunk after another) and posts its broadcast. Only
        the first chunk's gather and the last chunk's broadcast are not hidden behind the ring."""
        if tensor.numel() == 0 or self.world_size == 1:
            return tensor
        chunks = _chunks(tensor)
        if not self.is_leader:
            # Receives first: a gloo isend may block its caller until the peer has posted its receive.
            # Receiving into the chunk being sent is safe: the leader sends chunk i back only after it
            # has received all of it.
            reqs = [dist.irecv(c, src=self.leader, group=self.group, tag=i) for i, c in enumerate(chunks)]
            for i, c in enumerate(chunks):
                reqs.append(dist.isend(c, dst=self.leader, group=self.group, tag=i))
                self.counter.add(nbytes(c))
            wait_all(reqs)
            return tensor
        members = self.host[1:]
        scratch = torch.empty(len(members), tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        incoming = [_chunks(row) for row in scratch]  # [member][chunk], views of scratch
        gathers = [
            [dist.irecv(incoming[m][i], src=r, group=self.group, tag=i) for m, r in enumerate(members)]
            for i in range(len(chunks))
        ]
        sends: list[dist.Work | None] = []
        for i, chunk in enumerate(chunks):
            wait_all(gathers[i])
            for m in range(len(members)):
                chunk.add_(incoming[m][i])
            assert self.leader_ring is not None
            self.leader_ring.all_reduce_(chunk)
            for r in members:
                sends.append(dist.isend(chunk, dst=r, group=self.group, tag=i))
                self.counter.add(nbytes(chunk))
        wait_all(sends)
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
            with self.counter.crossing_hosts():
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


class _LeaderRing(RingTopology):
    """vatra's ring among the host leaders (only leaders build it): every byte it sends crosses hosts."""

    name = "leaders"

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        with self.counter.crossing_hosts():
            return super().all_reduce_(tensor)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        with self.counter.crossing_hosts():
            return super().all_gather(tensor)
