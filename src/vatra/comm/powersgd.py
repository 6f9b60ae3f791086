"""``powersgd``: torch's PowerSGD hook (rank-r P·Qᵀ per matrix, error feedback, warm start) with its
state, made synchronous and byte-counted.

torch's hook chains its all-reduces (uncompressed tensors → P → Q) through future callbacks.
Waiting for the whole chain before returning keeps the next bucket's collectives behind this
bucket's on every rank, which is what several buckets on gloo need.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as real objects
# (dist.GradBucket, torch.futures.Future[torch.Tensor]), not strings.

import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

from vatra.comm.topology import ByteCounter
from vatra.config._comm import CommConfig


class PowerSGDHookState:
    """torch's ``PowerSGDState`` plus vatra's step and byte accounting."""

    def __init__(self, cfg: CommConfig, counter: ByteCounter, seed: int = 0) -> None:
        self.inner = psgd.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=cfg.rank,
            start_powerSGD_iter=max(2, cfg.start_step),  # DDP rebuilds its buckets after step 1
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

    def _all_reduce_bytes(self, elements: int, element_size: int) -> int:
        w = self.world_size
        return 2 * (w - 1) * elements * element_size // w  # gloo's ring all-reduce volume

    def count(self, bucket: dist.GradBucket, compressed: bool) -> None:
        """Bytes of the all-reduces torch's hook just ran on this bucket (three when compressing)."""
        size = bucket.buffer().element_size()
        if not compressed:
            self.counter.add(self._all_reduce_bytes(bucket.buffer().numel(), size))
            return
        rank = self.inner.matrix_approximation_rank
        uncompressed = 0
        for g in bucket.gradients():
            n, m = g.shape[0], g.numel() // max(g.shape[0], 1)
            worth, _, _ = psgd._should_compress(n, m, min(n, m, rank), self.inner.min_compression_rate)
            uncompressed += 0 if worth else g.numel()
        idx = bucket.index()
        for elements in (
            uncompressed,
            self.inner.p_memory_dict[idx].numel(),
            self.inner.q_memory_dict[idx].numel(),
        ):
            self.counter.add(self._all_reduce_bytes(elements, size))


def powersgd_hook(state: PowerSGDHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    t0 = time.perf_counter()
    compressed = state.inner.iter >= state.inner.start_powerSGD_iter
    result = psgd.powerSGD_hook(state.inner, bucket).wait()
    state.count(bucket, compressed)
    state.comm_time_s += time.perf_counter() - t0
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(result)
    return fut
