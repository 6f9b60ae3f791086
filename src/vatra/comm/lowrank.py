"""vatra's own PowerSGD (Vogels et al., NeurIPS 2019): rank-r P·Qᵀ per matrix with warm start and error
feedback, like torch's hook, but one step's matrices share two fused all-reduces.

torch's hook runs three all-reduces per DDP bucket (uncompressed tensors, then P, then Q), chained
through future callbacks, and keys its state by bucket, so it must send its first steps uncompressed
while DDP rebuilds its buckets. Here state is keyed by parameter (compressed from step 0), each
bucket's hook call only computes its matrices' P = M·Q (on the hook's worker thread, while backward
goes on), and the last bucket of the step runs the exchange for all of them: one all-reduce of every
P and the uncompressed tensors, one of every Q. Factors travel in ``comm.factor_dtype`` (fp16 by
default, or int8 under scales every rank shares: half the bytes again, one small all-reduce of the
scales more per phase); they are orthogonalised and applied in fp32. The uncompressed tensors
(biases, small matrices) travel in the same dtype beside P, with error feedback of their own (in fp32
they are sent as they are): one message less a step, which on a CPU shared by several ranks is time
every rank waits. On gloo's default group each phase is cut into a few asynchronous all-reduces of
matrices in order (:func:`_exchange_groups`), so one group's work overlaps the next groups' bytes
on the wire. On CPU the step is bound by passes over the gradient more than by the link, so error
feedback works in place and M̂ is written into the bucket.

Per matrix M (the gradient plus its error-feedback residual, viewed as n × m) and step:
P = M·Q, all-reduce P (mean), P̂ = orth(P), Q = Mᵀ·P̂, all-reduce Q (mean), M̂ = P̂·Qᵀ, residual
M − M̂, and Q is kept as the next step's start. Every rank starts Q from the same seeded draw.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as real objects.

import time
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from vatra.comm.batching import all_reduce_coalesced_, int8_sum_
from vatra.comm.memory import Memory
from vatra.comm.overlap import BucketWorker, run_bucket
from vatra.comm.topology import ByteCounter, FlatTopology, Topology

MIN_COMPRESSION_RATE = 2.0  # as torch's hook: compress a matrix only if P and Q are ≤ half its size


def worth_compressing(shape: torch.Size, rank: int) -> bool:
    if len(shape) < 2:
        return False
    n, m = shape[0], shape.numel() // max(shape[0], 1)
    r = min(n, m, rank)
    return n * m >= MIN_COMPRESSION_RATE * (n + m) * r


class LowRankMemory(Memory):
    """Error feedback plus each matrix's warm-start Q, checkpointed together (by the plugin, by name).

    The residual buffer is worked in place: it becomes M = g + e, and M − M̂ once the average is known
    (the same values as :class:`Memory`'s, without two allocations and two passes per matrix).
    """

    def __init__(self) -> None:
        super().__init__()
        self.factors: dict[Hashable, torch.Tensor] = {}

    def compensate_(self, tensor: torch.Tensor, key: Hashable) -> torch.Tensor:
        """M = tensor + residual, in the residual's own buffer (which :meth:`settle_` finishes)."""
        residual = self.residuals.get(key)
        if residual is None or residual.shape != tensor.shape:
            residual = self.residuals[key] = tensor.detach().clone()
            return residual
        return residual.add_(tensor)

    def settle_(self, key: Hashable, transmitted: torch.Tensor) -> None:
        """The residual (holding M since :meth:`compensate_`) becomes M − transmitted."""
        self.residuals[key].sub_(transmitted)

    def state_dict(self) -> dict[str, dict[Hashable, torch.Tensor]]:
        return {**super().state_dict(), "factors": self.factors}

    def load_state_dict(self, state: dict[str, dict[Hashable, torch.Tensor]]) -> None:
        super().load_state_dict(state)
        self.factors = dict(state.get("factors", {}))


@dataclass
class _Bucket:
    buffer: torch.Tensor
    keys: list[int]
    grads: list[torch.Tensor]
    done: "torch.futures.Future[torch.Tensor]" = field(default_factory=torch.futures.Future)
    # (key, compensated matrix (n, m) in the residual's buffer, its P = M·Q (n, r), the gradient)
    matrices: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # (key, tensor): sent as they are in fp32, or in the factors' dtype (fp16, int8) with error feedback
    vectors: list[tuple[int, torch.Tensor]] = field(default_factory=list)


@dataclass
class LowRankState:
    """What :func:`lowrank_hook` keeps; ``index`` maps a parameter's id to its position in the module,
    which seeds its first Q identically on every rank."""

    topology: Topology
    memory: LowRankMemory
    index: dict[int, int]
    rank: int = 4
    start_step: int = 2
    factor_dtype: torch.dtype = torch.float32
    bucket_bytes: int = 4 << 20
    seed: int = 0
    overlap: bool = False
    step: int = 0
    comm_time_s: float = 0.0
    fp32_resends: int = 0  # steps whose half-precision factors overflowed and went again in fp32
    counter: ByteCounter = field(init=False)

    def __post_init__(self) -> None:
        self.counter = self.topology.counter
        self.worker = BucketWorker("vatra-powersgd") if self.overlap else None
        self.pending: list[_Bucket] = []

    def forget(self) -> None:
        """A skipped step: the residuals go; warm-start factors are directions only and stay, unless a
        non-finite gradient (what a skip is for, as a rule) made them non-finite too."""
        self.memory.forget()
        factors = self.memory.factors
        self.memory.factors = {k: q for k, q in factors.items() if bool(torch.isfinite(q).all())}

    def close(self, wait: bool = True) -> None:
        if self.worker is not None:
            self.worker.close(wait)

    def start_q(self, key: int, m: int, r: int, like: torch.Tensor) -> torch.Tensor:
        q = self.memory.factors.get(key)
        if q is not None and q.shape == (m, r):
            return q
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.index[key])
        return torch.randn(m, r, generator=g).to(like)


def lowrank_hook(state: LowRankState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    world = state.topology.world_size
    if state.step < state.start_step:  # an uncompressed warm-up, when asked for (comm.start_step)

        def plain() -> torch.Tensor:
            t0 = time.perf_counter()
            state.topology.all_reduce_(buffer)
            buffer.div_(world)
            state.comm_time_s += time.perf_counter() - t0
            return buffer

        return run_bucket(state.worker, plain)
    job = _Bucket(buffer, [id(p) for p in bucket.parameters()], bucket.gradients())
    state.pending.append(job)
    if not bucket.is_last():

        def project() -> torch.Tensor:
            t0 = time.perf_counter()
            _project(state, job)
            state.comm_time_s += time.perf_counter() - t0
            return buffer

        run_bucket(state.worker, project)  # P = M·Q now, while backward goes on
        return job.done.then(_result)  # the average comes with the last bucket's exchange
    jobs, state.pending = state.pending, []

    def exchange() -> torch.Tensor:
        t0 = time.perf_counter()
        _project(state, job)
        _exchange(state, jobs)
        state.comm_time_s += time.perf_counter() - t0
        return buffer

    last = run_bucket(state.worker, exchange)

    def settle(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        """The earlier buckets' futures: done by the exchange, or failed with it (never left waiting)."""
        try:
            return fut.wait()
        except Exception as err:
            for j in jobs[:-1]:
                if not j.done.done():
                    j.done.set_exception(err)  # type: ignore[arg-type]
            raise

    return last.then(settle)


def _result(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
    return fut.wait()


def _project(state: LowRankState, job: _Bucket) -> None:
    """Each matrix of the bucket: M = gradient + residual, P = M·Q."""
    for key, g in zip(job.keys, job.grads, strict=True):
        if not worth_compressing(g.shape, state.rank):
            job.vectors.append((key, g))
            continue
        m = state.memory.compensate_(g, key).view(g.shape[0], -1)  # (n, m), the residual's buffer
        q = state.start_q(key, m.shape[1], min(m.shape[0], m.shape[1], state.rank), m)
        job.matrices.append((key, m, m @ q, g))


def _exchange(state: LowRankState, jobs: list[_Bucket]) -> None:
    """The step's two phases for every bucket's matrices, then each bucket's average. On gloo's
    default group each phase is cut into a few asynchronous all-reduces (:func:`_pipeline_groups`);
    elsewhere, and for int8 factors, it is one all-reduce."""
    vectors = [kv for j in jobs for kv in j.vectors]
    mats = [t for j in jobs for t in j.matrices]
    if state.factor_dtype == torch.int8:
        _exchange_int8(state, vectors, mats)
    else:
        pipelined = isinstance(state.topology, FlatTopology) and state.topology.world_size > 1
        groups = _pipeline_groups(mats) if pipelined else [list(range(len(mats)))]
        _exchange_groups(state, vectors, mats, groups, pipelined)
    for j in jobs[:-1]:
        j.done.set_result(j.buffer)


def _settle(
    state: LowRankState, key: int, m: torch.Tensor, g: torch.Tensor, h: torch.Tensor, qt: torch.Tensor
) -> None:
    """From P̂ and the summed Qᵀ: M̂ = P̂·Q̄ᵀ straight into the bucket, the residual M − M̂, and Q̄ kept
    as the next step's start."""
    mean_qt = qt.to(m.dtype).div_(state.topology.world_size)
    torch.matmul(h, mean_qt, out=g.view(m.shape))
    state.memory.settle_(key, g)
    state.memory.factors[key] = mean_qt.T  # (m, r)


def _exchange_int8(
    state: LowRankState,
    vectors: list[tuple[int, torch.Tensor]],
    mats: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]],
) -> None:
    sums = _int8_phase(state, vectors, [p for _, _, p, _ in mats], 0)
    # orthonormal columns spanning the summed P (the sum and the mean span the same space)
    hats = [torch.linalg.qr(w, mode="reduced").Q for w in sums]
    # Qᵀ = P̂ᵀ·M, (r, m): the same product as Mᵀ·P̂ but a row-major one, several times faster than the
    # transposed product at small r on CPU
    qts = _int8_phase(state, [], [h.T @ m for h, (_, m, _, _) in zip(hats, mats, strict=True)], 1)
    for h, qt, (key, m, _, g) in zip(hats, qts, mats, strict=True):
        _settle(state, key, m, g, h, qt)


def _int8_phase(
    state: LowRankState, vectors: list[tuple[int, torch.Tensor]], factors: list[torch.Tensor], dim: int
) -> list[torch.Tensor]:
    """One int8 all-reduce (:func:`int8_sum_`): the vectors, each with its error feedback (averaged in
    place), and the factors (fp32), one scale per rank-r component (per column of P, ``dim`` 0, per
    row of Qᵀ, ``dim`` 1), whose sums it returns. Maxima that are not finite: summed in fp32 on
    every rank (every rank holds the same summed maxima)."""
    world = state.topology.world_size
    xs = [state.memory.compensate(v, key) for key, v in vectors]
    parts = [*xs, *factors]
    done = int8_sum_(parts, [None] * len(xs) + [dim] * len(factors), state.topology, state.bucket_bytes)
    if done is None:
        state.fp32_resends += 1
        sent, summed = xs, [t.clone() for t in parts]
        all_reduce_coalesced_(summed, state.topology, state.bucket_bytes)
    else:
        sent, summed = done
    for (key, v), x, s, total in zip(vectors, xs, sent, summed, strict=False):
        state.memory.update(x, key, s)
        v.copy_(total).div_(world)
    return summed[len(xs) :]


PIPELINE_GROUPS = 4  # at most this many messages per phase when the exchange is pipelined


def _pipeline_groups(mats: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]) -> list[list[int]]:
    """The matrices cut, in order, into up to ``PIPELINE_GROUPS`` runs of about equal P + Q size."""
    sizes = [p.numel() + m.shape[1] * p.shape[1] for _, m, p, _ in mats]
    target = sum(sizes) / PIPELINE_GROUPS
    groups: list[list[int]] = [[]]
    size = 0
    for i, n in enumerate(sizes):
        if groups[-1] and size >= target:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += n
    return groups


@dataclass
class _Message:
    """One all-reduce of ``parts`` (fp32), sent in the state's factor dtype; ``work`` while it runs
    asynchronously."""

    parts: list[torch.Tensor]
    flat: torch.Tensor
    work: "dist.Work | None"


def _post(state: LowRankState, parts: list[torch.Tensor], asynchronous: bool) -> _Message:
    """Start the sum of ``parts``: on gloo's default group asynchronously, else on the topology."""
    if not parts:  # a phase with nothing to send (no vectors and no matrices in the group)
        return _Message(parts, torch.empty(0), None)
    flat = torch.cat([t.reshape(-1) for t in parts]).to(state.factor_dtype)
    if not asynchronous:
        state.topology.all_reduce_(flat)
        return _Message(parts, flat, None)
    w = state.topology.world_size
    state.counter.add(2 * (w - 1) * flat.numel() * flat.element_size() // w)  # gloo's ring volume
    return _Message(parts, flat, dist.all_reduce(flat, async_op=True))


def _collect(state: LowRankState, msg: _Message) -> tuple[list[torch.Tensor], bool]:
    """The message's sums (fp32), and whether they were summed again in fp32 because the
    half-precision sum was not finite: every rank holds the same summed bits, so every rank takes the
    same branch, in the same order."""
    if msg.work is not None:
        msg.work.wait()
    flat = msg.flat.float()
    resent = state.factor_dtype != torch.float32 and not bool(torch.isfinite(flat).all())
    if resent:
        state.fp32_resends += 1
        flat = torch.cat([t.reshape(-1) for t in msg.parts])
        state.topology.all_reduce_(flat)
    sums = flat.split([t.numel() for t in msg.parts]) if msg.parts else ()
    return [part.view_as(t) for part, t in zip(sums, msg.parts, strict=True)], resent


def _exchange_groups(
    state: LowRankState,
    vectors: list[tuple[int, torch.Tensor]],
    mats: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]],
    groups: list[list[int]],
    asynchronous: bool,
) -> None:
    """The exchange in fp32 or fp16, one message per group of matrices and phase (the vectors travel
    with the first; in fp16 with error feedback of their own). Asynchronous, a group's Q is computed
    while the next groups' P are on the wire, and a group's M̂ while the next groups' Q are: the same
    sums and the same arithmetic."""
    world, dtype = state.topology.world_size, state.factor_dtype
    exact = dtype == torch.float32
    xs = [v if exact else state.memory.compensate(v, key) for key, v in vectors]
    sent = [x if exact else x.to(dtype).float() for x in xs]  # the vectors as this rank sends them
    p_msgs = [
        _post(state, (xs if g == 0 else []) + [mats[i][2] for i in idx], asynchronous)
        for g, idx in enumerate(groups)
    ]
    hats: dict[int, torch.Tensor] = {}
    q_msgs = []
    for g, (idx, msg) in enumerate(zip(groups, p_msgs, strict=True)):
        sums, resent = _collect(state, msg)
        if g == 0:
            for (key, v), x, s, total in zip(vectors, xs, sent, sums, strict=False):
                if not exact:
                    state.memory.update(x, key, x if resent else s)
                v.copy_(total).div_(world)
            sums = sums[len(xs) :]
        for i, w in zip(idx, sums, strict=True):
            hats[i] = torch.linalg.qr(w, mode="reduced").Q  # orthonormal columns spanning the summed P
        # Qᵀ = P̂ᵀ·M, (r, m): the same product as Mᵀ·P̂ but a row-major one, several times faster than
        # the transposed product at small r on CPU
        q_msgs.append(_post(state, [hats[i].T @ mats[i][1] for i in idx], asynchronous))
    for idx, msg in zip(groups, q_msgs, strict=True):
        for i, qt in zip(idx, _collect(state, msg)[0], strict=True):
            key, m, _, grad = mats[i]
            _settle(state, key, m, grad, hats[i], qt)
