"""DDP communication hooks: every compressor runs as ``ddp.register_comm_hook(state, hook)``.

The hook is synchronous: it runs its collectives on the autograd thread and returns a completed
future. That gives up overlapping communication with the rest of backward, and in return every
rank issues the same collectives in the same order (DDP hands buckets over in index order) —
follow-up collectives from gloo's completion callbacks are what made torch's own PowerSGD hook hang
with several buckets on gloo.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as real objects
# (dist.GradBucket, torch.futures.Future[torch.Tensor]), not strings.

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from vatra.comm._base import Compressor, Ctx, Payload, SparseCompressor
from vatra.comm.batching import all_gather_coalesced, all_reduce_coalesced_
from vatra.comm.memory import Memory
from vatra.comm.ring import RingTopology
from vatra.comm.topology import ByteCounter, FlatTopology, Topology

_WARMUP_RATIO = 0.25  # DGC starts its sparsity warm-up at 75 % sparsity


@dataclass
class HookState:
    """What the hook keeps between calls; the plugin sets ``step`` and reads ``counter``.

    Per-tensor state (error-feedback residuals, velocities) is keyed by the parameter's ``id``: DDP
    rebuilds its buckets after the first step, which reorders ``(bucket.index(), position)``.
    """

    compressor: Compressor
    memory: Memory
    topology: Topology
    start_step: int = 0
    sparsity_warmup: int = 0
    min_numel: int = 0
    bucket_bytes: int = 4 << 20
    step: int = 0
    comm_time_s: float = 0.0
    counter: ByteCounter = field(init=False)

    def __post_init__(self) -> None:
        self.counter = self.topology.counter
        # gloo's own bf16 sum is unreliable: bf16 payloads are summed by vatra's ring (in torch).
        self.sum_topology = self.topology
        if isinstance(self.topology, FlatTopology) and getattr(self.compressor, "wire_dtype", None) is (
            torch.bfloat16
        ):
            self.sum_topology = RingTopology(self.counter)
        self.ratio = self.compressor.ratio if isinstance(self.compressor, SparseCompressor) else None

    def forget(self) -> None:
        self.memory.forget()

    def ratio_at(self, step: int) -> float | None:
        """The share a sparsifier sends at ``step``: DGC's warm-up falls geometrically from 25 % at
        ``start_step`` to ``ratio`` over ``sparsity_warmup`` steps; every rank computes the same share,
        so payload sizes still depend only on the tensor's shape and the step."""
        ratio, warm = self.ratio, self.sparsity_warmup
        if ratio is None or warm <= 0 or step >= self.start_step + warm or ratio >= _WARMUP_RATIO:
            return ratio
        frac = max(0.0, (step - self.start_step) / warm)
        return float(_WARMUP_RATIO ** (1.0 - frac) * ratio**frac)


def compression_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket's gradients across ranks through ``state.compressor``."""
    t0 = time.perf_counter()
    buffer = bucket.buffer()
    world = state.topology.world_size
    if state.compressor.lossless or state.step < state.start_step:
        _accumulate(state, list(zip(_keys(bucket), bucket.gradients(), strict=True)))
        state.topology.all_reduce_(buffer)
        buffer.div_(world)
    else:
        if isinstance(state.compressor, SparseCompressor):
            state.compressor.ratio = state.ratio_at(state.step) or state.compressor.ratio
        _compressed_average(state, _keys(bucket), bucket.gradients())
    state.comm_time_s += time.perf_counter() - t0
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buffer)
    return fut


def _keys(bucket: dist.GradBucket) -> list[int]:
    return [id(p) for p in bucket.parameters()]


def _compressed_average(state: HookState, keys: list[int], grads: list[torch.Tensor]) -> None:
    """Small tensors: one fused fp32 all-reduce. Others: compress (with error feedback), exchange the
    payloads (summed or gathered, fused into ``bucket_bytes`` messages), decompress and average."""
    world = state.topology.world_size
    small = [(k, g) for k, g in zip(keys, grads, strict=True) if g.numel() < state.min_numel]
    large = [(k, g) for k, g in zip(keys, grads, strict=True) if g.numel() >= state.min_numel]
    _accumulate(state, small)
    if small:
        all_reduce_coalesced_([g for _, g in small], state.topology, state.bucket_bytes)
        for _, g in small:
            g.div_(world)
    if not large:
        return
    comp = state.compressor
    payloads: list[Payload] = []
    ctxs: list[Ctx] = []
    for key, g in large:
        x = state.memory.compensate(g, key)
        payload, ctx = comp.compress(x)
        state.memory.update(x, key, comp.decompress(payload, ctx))
        payloads.append(payload)
        ctxs.append(ctx)
    flat = [t for p in payloads for t in p]
    bounds = _bounds(payloads)
    if comp.summable:
        all_reduce_coalesced_(flat, state.sum_topology, state.bucket_bytes)
        for (_, g), ctx, (a, b) in zip(large, ctxs, bounds, strict=True):
            g.copy_(comp.decompress(flat[a:b], ctx)).div_(world)
        return
    per_rank = all_gather_coalesced(flat, state.topology, state.bucket_bytes)  # [rank][payload tensor]
    for (_, g), ctx, (a, b) in zip(large, ctxs, bounds, strict=True):
        total = torch.zeros_like(g)
        for rank_payload in per_rank:
            total += comp.decompress(rank_payload[a:b], ctx)
        g.copy_(total.div_(world))


def _accumulate(state: HookState, grads: list[tuple[int, torch.Tensor]]) -> None:
    """Tensors that travel uncompressed still pass through the memory: with momentum correction they
    send the rank's velocity (a no-op for plain error feedback)."""
    for key, g in grads:
        x = state.memory.accumulate(g, key)
        if x is not g:
            g.copy_(x)


def _bounds(payloads: list[Payload]) -> list[tuple[int, int]]:
    """Start and end of each tensor's payload in the flattened list."""
    out, start = [], 0
    for p in payloads:
        out.append((start, start + len(p)))
        start += len(p)
    return out
