"""Message batching: many small tensors travel as a few fused buffers of at most ``bucket_mb``.

On a slow link every message pays a fixed cost (a round trip, gloo's framing, Python dispatch in
vatra's ring); fusing the per-tensor payloads of a DDP bucket into one buffer pays it once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vatra.comm.topology import Topology, nbytes


def fuse_groups(tensors: list[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Greedy, order-preserving groups of indices whose bytes sum to ≤ ``bucket_bytes`` (a tensor
    larger than a bucket travels alone)."""
    groups: list[list[int]] = []
    size = 0
    for i, t in enumerate(tensors):
        b = nbytes(t)
        if groups and size + b <= bucket_bytes:
            groups[-1].append(i)
            size += b
        else:
            groups.append([i])
            size = b
    return groups


def coalesced_(tensors: list[torch.Tensor], op: Callable[[torch.Tensor], object], bucket_bytes: int) -> None:
    """Run an in-place collective ``op`` on a contiguous 1-D tensor (a sum, a reduce to the host's
    leader, a broadcast from it) over ``tensors``: once per fused bucket (per dtype), results copied back.

    Ranks that pass tensors of the same shapes and dtypes fuse them alike, so their calls pair up."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        for group in fuse_groups(same, bucket_bytes):
            members = [same[i] for i in group]
            flat = torch.cat([m.reshape(-1) for m in members])  # (Σ numel,)
            op(flat)
            for m, part in zip(members, flat.split([m.numel() for m in members]), strict=True):
                m.copy_(part.view_as(m))


def all_reduce_coalesced_(tensors: list[torch.Tensor], topology: Topology, bucket_bytes: int) -> None:
    """Sum each tensor across ranks in place, one collective per fused bucket (per dtype)."""
    coalesced_(tensors, topology.all_reduce_, bucket_bytes)


def all_gather_coalesced(
    tensors: list[torch.Tensor], topology: Topology, bucket_bytes: int
) -> list[list[torch.Tensor]]:
    """Every rank's version of ``tensors`` (``out[rank][i]``), packed as raw bytes into fused buffers.

    All ranks must pass tensors of the same shapes and dtypes (a ``Compressor`` guarantees it).
    """
    world = topology.world_size
    out: list[list[torch.Tensor]] = [[torch.empty(0)] * len(tensors) for _ in range(world)]
    for group in fuse_groups(tensors, bucket_bytes):
        members = [tensors[i] for i in group]
        packed = pack_bytes(members)  # (B,) bytes of this bucket
        gathered = topology.all_gather(packed).view(world, packed.numel())  # (W, B)
        for r in range(world):
            for i, t in zip(group, unpack_bytes(gathered[r], members), strict=True):
                out[r][i] = t
    return out


def pack_bytes(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Tensors as one byte buffer (B,)."""
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def unpack_bytes(raw: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """The inverse of :func:`pack_bytes` for tensors of ``like``'s shapes and dtypes."""
    parts = raw.split([t.numel() * t.element_size() for t in like])
    # clone: a byte slice may sit at an offset the wider dtype cannot view
    return [p.clone().view(t.dtype).view(t.shape) for p, t in zip(parts, like, strict=True)]
