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


# int8 sums (:func:`int8_sum_`) serve up to this many ranks: a rank's share of the 127 levels falls as
# (127 − W)/W; callers send fp16 above it
INT8_SUM_WORLD = 8


def int8_sum_(
    xs: list[torch.Tensor], dims: list[int | None], topology: Topology, bucket_bytes: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    """Sum fp32 tensors across ranks as int8, under scales every rank shares.

    Each tensor has one scale (``dims[i]`` None) or one per slice along ``dims[i]`` (the maximum is
    taken over that dimension): the sum over ranks of their largest |value| there, over 127 − W.
    Rounded to the nearest, rank i's |q| ≤ (127 − W)·amaxᵢ/Σamax + ½, so the W summed int8 never pass
    127 and the sum is exact (partial sums too, so any topology may add them). Costs one all-reduce
    of the maxima (fp32) before the int8 one. Returns what this rank sent (q·s, for its error
    feedback) and the sums, in fp32; None where a maximum is not finite: every rank sees the same
    summed maxima, so every rank returns None and none waits alone.
    """
    world = topology.world_size
    amax = [
        x.abs().amax() if d is None else x.abs().amax(dim=d, keepdim=True)
        for x, d in zip(xs, dims, strict=True)
    ]
    total = torch.cat([a.reshape(-1) for a in amax])
    topology.all_reduce_(total)
    if not bool(torch.isfinite(total).all()):
        return None
    total = total.clamp_min_(torch.finfo(torch.float32).tiny).div_(127 - world)
    scales = [s.view_as(a) for s, a in zip(total.split([a.numel() for a in amax]), amax, strict=True)]
    qs = [torch.round(x / s).to(torch.int8) for x, s in zip(xs, scales, strict=True)]
    sent = [q.float().mul_(s) for q, s in zip(qs, scales, strict=True)]
    all_reduce_coalesced_(qs, topology, bucket_bytes)
    return sent, [q.float().mul_(s) for q, s in zip(qs, scales, strict=True)]


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
