"""The topology a job gets: its ranks grouped by host, and ``comm.topology`` (``auto``, ``flat``,
``ring``, ``hierarchical``) built over them."""

from __future__ import annotations

import os
import socket

import torch.distributed as dist

from vatra.comm.hierarchical import HierarchicalTopology
from vatra.comm.ring import RingTopology
from vatra.comm.topology import ByteCounter, FlatTopology, Topology
from vatra.errors import ConfigError


def host_layout_from_env(world_size: int) -> list[list[int]]:
    """Ranks grouped by host: each rank reports its elastic agent (GROUP_RANK) and host name.

    A collective (all_gather_object) — every rank must call it. Without an elastic agent all
    ranks report the same host.
    """
    me = f"{socket.gethostname()}/{os.environ.get('GROUP_RANK', '0')}"
    ids: list[object] = [None] * world_size
    dist.all_gather_object(ids, me)
    hosts: dict[object, list[int]] = {}
    for rank, host in enumerate(ids):
        hosts.setdefault(host, []).append(rank)
    return sorted(hosts.values())


def build_topology(name: str, counter: ByteCounter, hosts: list[list[int]] | None = None) -> Topology:
    """``auto`` → hierarchical when there are several hosts and some host runs several ranks."""
    if name in ("auto", "hierarchical") and hosts is None:
        hosts = host_layout_from_env(dist.get_world_size())
    if name == "auto":
        assert hosts is not None
        multi = len(hosts) > 1 and any(len(h) > 1 for h in hosts)
        name = "hierarchical" if multi else "flat"
    if name == "flat":
        return FlatTopology(counter)
    if name == "ring":
        return RingTopology(counter)
    if name == "hierarchical":
        assert hosts is not None
        return HierarchicalTopology(hosts, counter)
    raise ConfigError(f"comm.topology: unknown {name!r}; choose auto, flat, ring or hierarchical")
