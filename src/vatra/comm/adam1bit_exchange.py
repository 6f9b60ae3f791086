"""1-bit Adam's compressed all-reduce: error feedback on the workers' side and on the servers'.

For W ranks every tensor is cut into W chunks (whole rows of a matrix, so onebit keeps a scale per
row; flat pieces otherwise); rank j serves chunk j. Per tensor and step:

1. every rank i compresses ``x = mᵢ + eᵢ`` chunk by chunk and keeps ``eᵢ ← x − C(x)``;
2. it sends chunk j's payload to rank j (point to point: (W−1)/W of its payload);
3. rank j decompresses the W payloads of its chunk, averages them, compresses ``a = avg + sⱼ`` and
   keeps ``sⱼ ← a − C(a)``;
4. it sends that payload to every other rank ((W−1) chunk payloads), and every rank decompresses
   the W server chunks into the same m̄.

A rank thus sends 2·(W−1)/W of one compressed copy of the tensor per step, like a ring all-reduce
of the payload, and every byte is counted as it is handed to ``isend``. A compressor whose payloads
add up (random-k with indices every rank draws alike) is all-reduced instead: the sum of values at
shared indices is exact, so the server side has no error to keep; 1-bit Adam sums random-k's
values as int8 under a scale every rank shares (:func:`_int8_sum`). On two ranks a block top-k's
payloads are gathered whole instead (each rank's to the other: the same bytes, and no server cut).
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as real objects.

import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from vatra.comm._base import Compressor, Ctx, Payload, SparseCompressor
from vatra.comm.adam1bit import NoTwoSidedMemory, TwoSidedMemory
from vatra.comm.batching import all_reduce_coalesced_, int8_sum_, pack_bytes, unpack_bytes
from vatra.comm.hooks import TensorDraws, _average_payloads, _compress, _keys
from vatra.comm.overlap import run_bucket
from vatra.comm.ring import exchange
from vatra.comm.topology import nbytes

if TYPE_CHECKING:
    from vatra.comm.adam1bit import Adam1BitState

__all__ = ["adam1bit_hook", "chunks", "compressed_average"]

_NO_FEEDBACK = NoTwoSidedMemory()


def adam1bit_hook(state: "Adam1BitState", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Warm-up: the exact average of the gradients. Compressed: each rank's momentum mᵢ, averaged
    by the two-sided compressed all-reduce; m̄ goes where the gradient was."""
    buffer, keys, grads = bucket.buffer(), _keys(bucket), bucket.gradients()
    frozen = state.frozen

    def work() -> torch.Tensor:
        t0 = time.perf_counter()
        if frozen:
            _momentum_average(state, keys, grads)
        elif state.warmup is not None:
            _warmup_average(state, keys, grads)
        else:
            _half_average_(buffer, state)
        state.comm_time_s += time.perf_counter() - t0
        return buffer

    return run_bucket(state.worker, work)


def _half_average_(buffer: torch.Tensor, state: "Adam1BitState") -> None:
    """The warm-up's average of the gradients, sent in fp16 (half the bytes; the sums every rank
    gets are the same, so a sum that overflows is sent again in fp32 by every rank)."""
    half = buffer.half()
    state.topology.all_reduce_(half)
    if torch.isfinite(half).all():
        buffer.copy_(half)
    else:
        state.fp32_resends += 1
        state.topology.all_reduce_(buffer)
    buffer.div_(state.topology.world_size)


def _warmup_average(state: "Adam1BitState", keys: list[int], grads: list[torch.Tensor]) -> None:
    """The warm-up's average of the gradients in fp4 or fp8 (``comm.warmup_precision``,
    :mod:`vatra.comm.minifloat`): each matrix through the two-sided exchange without error feedback
    (a gradient's rounding must not reach the momentum phase's residuals), so every rank gets the
    same average at ~0.14 (fp4) or ~0.26 (fp8) of fp32's bytes; tensors under ``comm.min_numel`` as
    in the fp16 warm-up."""
    least = max(state.min_numel, state.topology.world_size)
    small = [g for g in grads if g.numel() < least]
    if small:
        flat = torch.cat([g.reshape(-1) for g in small])
        _half_average_(flat, state)
        for g, t in zip(small, flat.split([g.numel() for g in small]), strict=True):
            g.copy_(t.view_as(g))
    large = [(k, g) for k, g in zip(keys, grads, strict=True) if g.numel() >= least]
    if large:
        compressed_average(state, large, state.warmup, _NO_FEEDBACK, state.warmup_draws)


def _momentum_average(state: "Adam1BitState", keys: list[int], grads: list[torch.Tensor]) -> None:
    """Each gradient becomes the rank's momentum, averaged across ranks. What travels is the update
    that momentum makes, u = mᵢ/(√v̂ + ε): compressed as m, a coordinate whose frozen v̂ is ~0 (an
    input that is always 0 in the warm-up) would get a value of its neighbours' size, over ε."""
    world = state.topology.world_size
    denominators = [state.to_update_(k, g) for k, g in zip(keys, grads, strict=True)]
    least = max(state.min_numel, world)  # a tensor smaller than the world has no chunk per rank
    small = [g for g in grads if g.numel() < least]
    if small:  # |u| is clipped to Adam's bound (~7.3): half precision cannot overflow
        halves = [g.half() for g in small]
        all_reduce_coalesced_(halves, state.topology, state.bucket_bytes)
        for g, h in zip(small, halves, strict=True):
            g.copy_(h).div_(world)
    large = [(k, g) for k, g in zip(keys, grads, strict=True) if g.numel() >= least]
    if large:
        if isinstance(state.compressor, SparseCompressor) and state.ratio is not None:
            state.compressor.ratio = state.ratio_at(state.step)
        compressed_average(state, large)
    torch._foreach_mul_(grads, denominators)  # back to the momentum: m̄


def chunks(t: torch.Tensor, world: int) -> list[torch.Tensor]:
    """``world`` views of ``t`` that cover it: blocks of whole rows of a matrix (at least one row
    each), else pieces of the flat tensor. Only the shape decides, so every rank cuts alike."""
    if t.dim() >= 2 and t.shape[0] >= world:
        return list(t.reshape(t.shape[0], -1).tensor_split(world, dim=0))  # (rows_j, n/rows)
    return list(t.reshape(-1).tensor_split(world))


def compressed_average(
    state: "Adam1BitState",
    large: list[tuple[int, torch.Tensor]],
    comp: Compressor | None = None,
    feedback: TwoSidedMemory | None = None,
    draws: TensorDraws | None = None,
) -> None:
    """Replace each tensor (a rank's momentum) with the two-sided compressed average over ranks, by
    ``comp`` with ``feedback``'s error feedback and ``draws`` (default: the state's compressor, memory
    and draws; the warm-up passes its own compressor and draws, and no feedback)."""
    if comp is None:
        comp, draws = state.compressor, state.draws
    if comp.sums:
        if state.sum_int8:
            _int8_sum(state, large)
            return
        payloads, summed = _compress(state, large)  # worker error feedback in state.memory
        _average_payloads(state, large, payloads, summed, state.sum_topology, state.topology)
        return
    world, rank = state.topology.world_size, state.topology.rank
    if world == 2 and isinstance(comp, SparseCompressor) and comp.block:
        # Two ranks: each one's whole payload to the other costs what a chunk to its server and
        # the served chunk back cost, and skips the server's second cut, which would keep k of the
        # up to 2k places the two payloads hold (the rest waiting in the server's error)
        payloads, whole = _compress(state, large)  # worker error feedback in state.memory
        _average_payloads(state, large, payloads, whole, state.sum_topology, state.topology)
        return
    memory = feedback or state.memory
    assert isinstance(memory, TwoSidedMemory)
    worker: list[list[Payload]] = [[] for _ in range(world)]  # [chunk j][tensor]: this rank's payloads
    ctxs: list[list[Ctx]] = [[] for _ in range(world)]  # [chunk j][tensor]
    for key, m in large:
        x = memory.compensate(m, key)  # mᵢ + eᵢ
        sent = torch.empty_like(x)
        if draws is not None:
            draws.reseed(key, state.step)
        for j, (part, out) in enumerate(zip(chunks(x, world), chunks(sent, world), strict=True)):
            payload, ctx = comp.compress(part)
            out.copy_(comp.decompress(payload, ctx).view_as(out))
            worker[j].append(payload)
            ctxs[j].append(ctx)
        memory.update(x, key, sent)
    # 2. chunk j of every tensor to its server j; this rank's chunk from every rank
    mine = worker[rank]
    got = _swap(
        state, {j: worker[j] for j in range(world) if j != rank}, {i: mine for i in range(world) if i != rank}
    )
    got[rank] = mine
    # 3. the average of this rank's chunk, compressed again with the server's error feedback
    served: list[Payload] = []
    for t, ((key, _), ctx) in enumerate(zip(large, ctxs[rank], strict=True)):
        total = torch.zeros(ctx.shape, dtype=ctx.dtype)  # (chunk shape)
        for i in range(world):
            total += comp.decompress(got[i][t], ctx)
        a = memory.compensate_server(total.div_(world), key)
        back, back_ctx = comp.compress(a)
        memory.update_server(a, key, comp.decompress(back, back_ctx))
        served.append(back)
    # 4. every server's chunk to every rank; all decompress the same m̄
    chunk_of = _swap(
        state,
        {j: served for j in range(world) if j != rank},
        {i: worker[i] for i in range(world) if i != rank},
    )
    chunk_of[rank] = served
    for t, (_, g) in enumerate(large):
        for j, part in enumerate(chunks(g, world)):
            part.copy_(comp.decompress(chunk_of[j][t], ctxs[j][t]).view_as(part))


def _int8_sum(state: "Adam1BitState", large: list[tuple[int, torch.Tensor]]) -> None:
    """Summable payloads (random-k's values at the indices every rank drew) all-reduced as int8 with
    one scale per tensor that every rank shares (:func:`int8_sum_`); each rank's error feedback
    keeps its own rounding. Values whose maxima are not finite are summed in fp32 instead."""
    comp, world, draws = state.compressor, state.topology.world_size, state.draws
    assert draws is not None, "int8 sums are for shared random-k draws"
    xs, values, ctxs = [], [], []
    for key, m in large:
        x = state.memory.compensate(m, key)  # mᵢ + eᵢ
        draws.reseed(key, state.step)
        (v,), ctx = comp.compress(x)
        xs.append(x)
        values.append(v.float())
        ctxs.append(ctx)
    done = int8_sum_(values, [None] * len(values), state.sum_topology, state.bucket_bytes)
    if done is None:
        sent, summed = values, [v.clone() for v in values]
        all_reduce_coalesced_(summed, state.sum_topology, state.bucket_bytes)
    else:
        sent, summed = done
    for (key, g), x, s, total, ctx in zip(large, xs, sent, summed, ctxs, strict=True):
        state.memory.update(x, key, comp.decompress([s], ctx))
        g.copy_(comp.decompress([total.div_(world)], ctx))


def _swap(
    state: "Adam1BitState", send: dict[int, list[Payload]], like: dict[int, list[Payload]]
) -> dict[int, list[Payload]]:
    """Send ``send[j]`` (a payload per tensor) to rank j; receive from each rank i payloads shaped
    as ``like[i]``."""
    out = {i: torch.empty(sum(nbytes(t) for p in ps for t in p), dtype=torch.uint8) for i, ps in like.items()}
    exchange({j: pack_bytes([t for p in ps for t in p]) for j, ps in send.items()}, out, state.counter)
    return {i: _regroup(unpack_bytes(out[i], [t for p in like[i] for t in p]), like[i]) for i in like}


def _regroup(flat: list[torch.Tensor], like: list[Payload]) -> list[Payload]:
    """A flat list of payload tensors cut into payloads as long as ``like``'s."""
    out, start = [], 0
    for p in like:
        out.append(flat[start : start + len(p)])
        start += len(p)
    return out
