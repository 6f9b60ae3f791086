"""Collective topologies with exact byte accounting: the base and flat (the backend's own); ring and
hierarchical in their own modules, the factory in :mod:`vatra.comm.topology_factory`.

Every topology offers the two collectives the hooks need — an in-place sum all-reduce and an
all-gather — over one contiguous 1-D tensor, and adds what this rank puts on the wire to its
``ByteCounter``. For vatra's own ring and hierarchical collectives that figure is exact (the sum of
every ``isend``); for ``flat`` the backend's algorithm is internal, so it is counted as a
bandwidth-optimal ring would send it — 2·(W−1)/W·n bytes per all-reduce and (W−1)·n per all-gather,
the volume gloo's ring sends.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class ByteCounter:
    """Bytes this rank sent since the last :meth:`reset` (one training step); ``cross_host`` is the
    part of ``sent`` that left the host (known on the hierarchical topology: the leaders' ring)."""

    sent: int = 0
    messages: int = 0
    cross_host: int = 0

    def add(self, nbytes: int) -> None:
        self.sent += int(nbytes)
        self.messages += 1

    def reset(self) -> None:
        self.sent = self.messages = self.cross_host = 0

    @contextmanager
    def crossing_hosts(self) -> Iterator[None]:
        """What is added inside this block crosses hosts: it counts in ``cross_host`` too."""
        before = self.sent
        try:
            yield
        finally:
            self.cross_host += self.sent - before


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def wait_all(works: list[dist.Work | None]) -> None:
    """Wait for point-to-point requests (torch returns None for a peer outside the group)."""
    for work in works:
        if work is not None:
            work.wait()


class Topology:
    """Base: ``all_reduce_`` sums in place across all ranks; ``all_gather`` returns a (W·n,) tensor
    whose block r is rank r's input. Every rank calls the same collectives in the same order."""

    name = "base"

    def __init__(self, counter: ByteCounter | None = None) -> None:
        self.counter = counter or ByteCounter()
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class FlatTopology(Topology):
    """The backend's own collectives on the default group (gloo's ring on CPU)."""

    name = "flat"

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        w = self.world_size
        if w > 1:
            dist.all_reduce(tensor)
            self.counter.add(2 * (w - 1) * nbytes(tensor) // w)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self.world_size * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        if self.world_size == 1:
            return out.copy_(tensor)
        dist.all_gather_single(out, tensor)
        self.counter.add((self.world_size - 1) * nbytes(tensor))
        return out
