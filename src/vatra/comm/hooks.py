"""DDP communication hooks: every compressor runs as ``ddp.register_comm_hook(state, hook)``.

Every rank must issue the same collectives in the same order, and DDP hands buckets over in index
order. The hook either does a bucket's work at once on the autograd thread and returns a finished
future, or (``HookState.overlap``, ``comm.overlap``) queues it on the state's one worker thread,
which runs buckets first-in first-out while backward goes on (``vatra.comm.overlap``). What it must
avoid is what made torch's own PowerSGD hook hang with several buckets on gloo: several buckets'
collectives in flight at once, issued from gloo's completion callbacks.

On the hierarchical topology a lossy compressor is composed with the hosts: gradients are summed
exactly inside each host, the host's leader compresses that sum (with the host's error feedback),
and only the leaders' compressed payloads cross hosts.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as real objects
# (dist.GradBucket, torch.futures.Future[torch.Tensor]), not strings.

import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from vatra.comm._base import Compressor, Ctx, Payload, SparseCompressor
from vatra.comm.batching import all_gather_coalesced, all_reduce_coalesced_, coalesced_
from vatra.comm.hierarchical import HierarchicalTopology
from vatra.comm.memory import Memory
from vatra.comm.overlap import BucketWorker, run_bucket
from vatra.comm.ring import RingTopology
from vatra.comm.topology import ByteCounter, FlatTopology, Topology

_WARMUP_RATIO = 0.25  # DGC starts its sparsity warm-up at 75 % sparsity
_STREAM = 0x636F6D6D  # "comm": the compressor's draws, apart from the rank's global RNG stream


class TensorDraws:
    """A stochastic compressor's randomness: before it compresses a tensor, its ``generator`` is
    seeded from ``(run.seed, rank, step, the tensor's index among the parameters)``.

    What is drawn for a tensor therefore depends on nothing else: not on the order tensors come in
    (DDP's first iteration runs one bucket in parameter order, later ones the order of backward, so
    a resumed run's first step sees another order than the uninterrupted run did), nor on the
    thread (the global RNG would interleave the worker's draws with dropout's). Resuming needs no
    saved RNG state: the step comes back with the checkpoint.
    """

    def __init__(self, seed: int, rank: int, index: dict[int, int], device: torch.device) -> None:
        self.base = [seed % 2**64, rank, _STREAM]
        self.index = index  # hook key (id of the parameter) -> its position in module.parameters()
        self.generator = torch.Generator(device=device)

    def reseed(self, key: int, step: int) -> None:
        entropy = np.random.SeedSequence([*self.base, step, self.index[key]]).generate_state(1, np.uint64)
        self.generator.manual_seed(int(entropy[0]))


@dataclass
class HookState:
    """What the hook keeps between calls; the plugin sets ``step`` and reads ``counter``.

    Per-tensor state (error-feedback residuals, velocities) is keyed by the parameter's ``id``: DDP
    rebuilds its buckets after the first step, which reorders ``(bucket.index(), position)``.
    With ``overlap`` the buckets run on a worker thread of this state's own (:meth:`close` ends it,
    and so does collecting the state); ``draws`` seeds a stochastic compressor's ``generator``.
    """

    compressor: Compressor
    memory: Memory
    topology: Topology
    start_step: int = 0
    min_numel: int = 0
    bucket_bytes: int = 4 << 20
    sparsity_warmup: int = 0
    overlap: bool = False
    draws: TensorDraws | None = None
    # DGC's local gradient clipping: on compressed steps each rank's gradient of a tensor is
    # clipped to this norm before error feedback accumulates it (0 = off; see _clip_local)
    local_clip: float = 0.0
    step: int = 0
    comm_time_s: float = 0.0  # time the buckets' work took (on the worker thread with overlap)
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
        self.worker = BucketWorker() if self.overlap else None
        if self.draws is not None:
            self.compressor.generator = self.draws.generator

    def forget(self) -> None:
        self.memory.forget()

    def ratio_at(self, step: int) -> float:
        """The share a sparsifier sends at ``step``: DGC's warm-up falls geometrically from 25 % at
        ``start_step`` to ``ratio`` over ``sparsity_warmup`` steps; every rank computes the same share,
        so payload sizes still depend only on the tensor's shape and the step."""
        ratio, warm = self.ratio, self.sparsity_warmup
        assert ratio is not None, "only a sparsifier has a share"
        if warm <= 0 or step >= self.start_step + warm or ratio >= _WARMUP_RATIO:
            return ratio
        frac = max(0.0, (step - self.start_step) / warm)
        return float(_WARMUP_RATIO ** (1.0 - frac) * ratio**frac)

    def close(self, wait: bool = True) -> None:
        """End the worker thread (a later bucket starts a new one)."""
        if self.worker is not None:
            self.worker.close(wait)


def compression_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket's gradients across ranks through ``state.compressor``."""
    buffer, keys, grads = bucket.buffer(), _keys(bucket), bucket.gradients()
    step = state.step
    warm = state.compressor.lossless or step < state.start_step

    def work() -> torch.Tensor:
        t0 = time.perf_counter()
        if warm:
            _accumulate(state, list(zip(keys, grads, strict=True)))
            state.topology.all_reduce_(buffer)
            buffer.div_(state.topology.world_size)
        else:
            if isinstance(state.compressor, SparseCompressor) and state.ratio is not None:
                state.compressor.ratio = state.ratio_at(step)
            _compressed_average(state, keys, grads)
        state.comm_time_s += time.perf_counter() - t0
        return buffer

    return run_bucket(state.worker, work)


def average_(state: HookState, keys: list[int], tensors: list[torch.Tensor]) -> None:
    """Average ``tensors`` across ranks in place as the hook averages a bucket, outside DDP (the
    pseudo-gradients of ``vatra.asyncdp``): exact (fused into ``bucket_bytes`` messages) while
    ``state.step < state.start_step`` or with a lossless method, else compressed with error feedback."""
    t0 = time.perf_counter()
    if state.compressor.lossless or state.step < state.start_step:
        _accumulate(state, list(zip(keys, tensors, strict=True)))
        all_reduce_coalesced_(tensors, state.topology, state.bucket_bytes)
        torch._foreach_div_(tensors, state.topology.world_size)
    else:
        if isinstance(state.compressor, SparseCompressor) and state.ratio is not None:
            state.compressor.ratio = state.ratio_at(state.step)
        _compressed_average(state, keys, tensors)
    state.comm_time_s += time.perf_counter() - t0


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
    if isinstance(state.topology, HierarchicalTopology):
        _host_compressed_average(state, state.topology, large)
        return
    payloads, ctxs = _compress(state, large)
    _average_payloads(state, large, payloads, ctxs, state.sum_topology, state.topology)


def _host_compressed_average(
    state: HookState, topo: HierarchicalTopology, large: list[tuple[int, torch.Tensor]]
) -> None:
    """The hierarchical composition: (1) every rank's gradient is summed exactly (fp32) to the host's
    leader; (2) the leader compresses the host sum with error feedback (its memory holds the host
    sum's residual and, with momentum correction, the host sum's velocity, masked where the host
    sent); (3) the leaders exchange payloads on their ring, the only bytes that cross hosts; (4) the
    leader decompresses the sum over hosts, divides by the world size and broadcasts it in the host.

    Members keep no memory of these tensors: what they still hold (a velocity from warm-up steps, a
    residual from an older checkpoint) goes to the leader with their gradient and is dropped, so
    the leader's memory is the host's from the first compressed step on."""
    grads = [g for _, g in large]
    if topo.is_leader:
        coalesced_(grads, topo.reduce_to_leader_, state.bucket_bytes)  # grads now hold the host sums
        payloads, ctxs = _compress(state, large)
        assert topo.leader_ring is not None
        _average_payloads(state, large, payloads, ctxs, topo.leader_ring, topo.leader_ring)
    else:
        handed = [state.memory.compensate(_clip_local(g, state.local_clip), k) for k, g in large]
        for k, _ in large:
            state.memory.drop(k)
        coalesced_(handed, topo.reduce_to_leader_, state.bucket_bytes)
    coalesced_(grads, topo.broadcast_from_leader_, state.bucket_bytes)


def _compress(state: HookState, large: list[tuple[int, torch.Tensor]]) -> tuple[list[Payload], list[Ctx]]:
    """Each tensor plus its error feedback, compressed; the memory keeps what the payload drops."""
    comp = state.compressor
    payloads: list[Payload] = []
    ctxs: list[Ctx] = []
    for key, g in large:
        x = state.memory.compensate(_clip_local(g, state.local_clip), key)
        if state.draws is not None:
            state.draws.reseed(key, state.step)
        payload, ctx = comp.compress(x)
        state.memory.update(x, key, comp.decompress(payload, ctx))
        payloads.append(payload)
        ctxs.append(ctx)
    return payloads, ctxs


def _average_payloads(
    state: HookState,
    large: list[tuple[int, torch.Tensor]],
    payloads: list[Payload],
    ctxs: list[Ctx],
    sum_topology: Topology,
    gather_topology: Topology,
) -> None:
    """Sum the payloads over ``sum_topology`` (summable ones) or gather them over ``gather_topology``,
    decompress the sum, and write it divided by the world size into the gradients."""
    comp, world = state.compressor, state.topology.world_size
    flat = [t for p in payloads for t in p]
    bounds = _bounds(payloads)
    if comp.sums:
        all_reduce_coalesced_(flat, sum_topology, state.bucket_bytes)
        for (_, g), ctx, (a, b) in zip(large, ctxs, bounds, strict=True):
            g.copy_(comp.decompress(flat[a:b], ctx)).div_(world)
        return
    per_rank = all_gather_coalesced(flat, gather_topology, state.bucket_bytes)  # [rank][payload tensor]
    for (_, g), ctx, (a, b) in zip(large, ctxs, bounds, strict=True):
        total = torch.zeros_like(g)
        for rank_payload in per_rank:
            total += comp.decompress(rank_payload[a:b], ctx)
        g.copy_(total.div_(world))


def _clip_local(grad: torch.Tensor, max_norm: float) -> torch.Tensor:
    """DGC's local gradient clipping (Lin et al. 2018, §3.2), per tensor: ``grad`` scaled down to
    ``max_norm`` where its norm is larger. The trainer's ``train.clip_grad_norm`` clips the averaged
    gradient after the exchange, which does not reach what error feedback keeps back: without this,
    one rank's spike would sit in its residual (and velocity) and be sent over the next steps."""
    if max_norm <= 0.0:
        return grad
    norm = float(grad.norm())
    return grad * (max_norm / norm) if norm > max_norm else grad


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
