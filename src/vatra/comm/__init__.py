"""Communication: gradient compressors with error feedback, DDP hooks, ring and hierarchical all-reduce.

The training plugin lives in ``vatra.comm.plugin`` (it imports the engine; the collectives do not).
"""

from vatra.comm._base import Compressor, Ctx, Payload, build_compressor
from vatra.comm.batching import all_gather_coalesced, all_reduce_coalesced_, fuse_groups
from vatra.comm.hierarchical import HierarchicalTopology
from vatra.comm.hooks import HookState, compression_hook
from vatra.comm.memory import Memory, MomentumMemory, NoMemory
from vatra.comm.powersgd import PowerSGDHookState, powersgd_hook
from vatra.comm.ring import RingTopology, ring_all_reduce_
from vatra.comm.topology import ByteCounter, FlatTopology, Topology
from vatra.comm.topology_factory import build_topology, host_layout_from_env

__all__ = [
    "ByteCounter",
    "Compressor",
    "Ctx",
    "FlatTopology",
    "HierarchicalTopology",
    "HookState",
    "Memory",
    "MomentumMemory",
    "NoMemory",
    "Payload",
    "PowerSGDHookState",
    "RingTopology",
    "Topology",
    "all_gather_coalesced",
    "all_reduce_coalesced_",
    "build_compressor",
    "build_topology",
    "compression_hook",
    "fuse_groups",
    "host_layout_from_env",
    "powersgd_hook",
    "ring_all_reduce_",
]
