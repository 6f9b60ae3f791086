"""``powersgd``: torch's PowerSGD hook (rank-r P·Qᵀ per matrix, error feedback, warm start) with its
state, one bucket at a time and byte-counted.

torch's hook chains its all-reduces (uncompressed tensors → P → Q) through future callbacks.
Waiting for the whole chain before the next bucket starts keeps the next bucket's collectives
behind this bucket's on every rank, which is what several buckets on gloo need. With
``comm.overlap`` that wait happens on the state's worker thread (buckets in order) while backward
goes on; without it, on the autograd thread.

On the worker, torch's hook seeds new factors under ``fork_rng`` of the global CPU generator: a
draw from the global RNG by the autograd thread at that moment would race with it. Backward draws
nothing (dropout's masks come from forward), and the seeding happens on the first compressed step
and where a memory starts afresh.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as real objects
# (dist.GradBucket, torch.futures.Future[torch.Tensor]), not strings.

import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

from vatra.comm.overlap import BucketWorker, run_bucket
from vatra.comm.topology import ByteCounter
from vatra.config._comm import CommConfig


class PowerSGDHookState:
    """torch's ``PowerSGDState`` plus vatra's step and byte accounting, and the worker thread that
    runs the buckets with ``comm.overlap`` (:meth:`close` ends it)."""

    def __init__(self, cfg: CommConfig, counter: ByteCounter, seed: int = 0) -> None:
        self.inner = psgd.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=cfg.rank,
            start_powerSGD_iter=max(2, int(cfg.start_step)),  # DDP rebuilds its buckets after step 1
            min_compression_rate=2,
            use_error_feedback=cfg.error_feedback,
            warm_start=True,
            random_seed=seed,
            compression_stats_logging_frequency=10**9,
        )
        self.counter = counter
        self.world_size = dist.get_world_size()
        self.step = 0
        self.comm_time_s = 0.0
        self.unchecked: set[int] = set()  # loaded buckets whose memories' sizes are not checked yet
        self.worker = BucketWorker("vatra-powersgd") if cfg.overlap else None

    def close(self, wait: bool = True) -> None:
        if self.worker is not None:
            self.worker.close(wait)

    def _all_reduce_bytes(self, elements: int, element_size: int) -> int:
        w = self.world_size
        return 2 * (w - 1) * elements * element_size // w  # gloo's ring all-reduce volume

    def _sizes(self, bucket: dist.GradBucket) -> tuple[int, int, int]:
        """Elements sent uncompressed, and of all P and all Q factors, for this bucket (as torch's
        hook decides which matrices are worth compressing)."""
        rank = self.inner.matrix_approximation_rank
        uncompressed = ps = qs = 0
        for g in bucket.gradients():
            n, m = g.shape[0], g.numel() // max(g.shape[0], 1)
            r = min(n, m, rank)
            worth, _, _ = psgd._should_compress(n, m, r, self.inner.min_compression_rate)
            if worth:
                ps, qs = ps + n * r, qs + m * r
            else:
                uncompressed += g.numel()
        return uncompressed, ps, qs

    def count(self, bucket: dist.GradBucket, compressed: bool) -> None:
        """Bytes of the all-reduces torch's hook just ran on this bucket (three when compressing)."""
        size = bucket.buffer().element_size()
        if not compressed:
            self.counter.add(self._all_reduce_bytes(bucket.buffer().numel(), size))
            return
        for elements in self._sizes(bucket):
            self.counter.add(self._all_reduce_bytes(elements, size))

    # ------------------------------------------------------------- training state
    def state_dict(self) -> dict[str, dict[int, torch.Tensor]]:
        """This rank's error feedback and warm-start factors, per DDP bucket index.

        The iteration count is not kept: a restarted process sends its first steps uncompressed
        again while DDP rebuilds its buckets, after which the indices mean the same buckets."""
        s = self.inner
        return {"error": dict(s.error_dict), "p": dict(s.p_memory_dict), "q": dict(s.q_memory_dict)}

    def load_state_dict(self, state: dict[str, dict[int, torch.Tensor]]) -> None:
        s = self.inner
        s.error_dict = dict(state.get("error", {}))
        s.p_memory_dict = dict(state.get("p", {}))
        s.q_memory_dict = dict(state.get("q", {}))
        self.unchecked = set(s.error_dict) | set(s.p_memory_dict)

    def forget(self) -> None:
        """Drop the error feedback (the warm-start factors are directions only: they stay)."""
        self.inner.error_dict.clear()

    def check_loaded(self, bucket: dist.GradBucket) -> None:
        """Before a loaded bucket is first compressed: drop memories whose sizes do not fit it
        (another bucket layout), so torch's hook starts them afresh instead of failing."""
        idx = bucket.index()
        self.unchecked.discard(idx)
        s = self.inner
        _, ps, qs = self._sizes(bucket)
        error, p, q = s.error_dict.get(idx), s.p_memory_dict.get(idx), s.q_memory_dict.get(idx)
        if error is not None and error.numel() != bucket.buffer().numel():
            del s.error_dict[idx]
        if p is not None and (p.numel() != ps or q is None or q.numel() != qs):
            s.p_memory_dict.pop(idx)
            s.q_memory_dict.pop(idx, None)


def powersgd_hook(state: PowerSGDHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    def work() -> torch.Tensor:
        t0 = time.perf_counter()
        # read when the bucket runs: torch's hook advances the iteration on the last bucket
        compressed = state.inner.iter >= state.inner.start_powerSGD_iter
        if compressed and state.unchecked:
            state.check_loaded(bucket)
        result = psgd.powerSGD_hook(state.inner, bucket).wait()
        state.count(bucket, compressed)
        state.comm_time_s += time.perf_counter() - t0
        return result

    return run_bucket(state.worker, work)
