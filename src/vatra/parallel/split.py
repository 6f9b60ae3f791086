"""Pipeline stage boundaries from measured per-block cost: contiguous blocks with balanced sums."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

import torch
from torch import nn


def measure_block_costs(
    blocks: Sequence[nn.Module], activation: torch.Tensor, repeats: int = 2
) -> list[float]:
    """Seconds of one forward + backward of each block on ``activation`` (a micro-batch's hidden
    state, e.g. ``(B, T, C)``), the fastest of ``repeats`` timed runs after one warm-up.

    The blocks' gradients are left as they were (zeroed to None only if they were None before):
    measuring must not change training. NOTE: on a GPU this needs a synchronize per timing.
    """
    costs: list[float] = []
    for block in blocks:
        had_grad = [p.grad is not None for p in block.parameters()]
        best = float("inf")
        for attempt in range(repeats + 1):
            x = activation.detach().requires_grad_(True)
            start = time.perf_counter()
            block(x).sum().backward()
            if activation.device.type == "cuda":
                torch.cuda.synchronize()
            if attempt:  # the first run warms caches and allocators
                best = min(best, time.perf_counter() - start)
        for p, had in zip(block.parameters(), had_grad, strict=True):
            if not had:
                p.grad = None
        costs.append(best)
    return costs


def split_stages(
    costs: Sequence[float], n_stages: int, *, first_extra: float = 0.0, last_extra: float = 0.0
) -> list[range]:
    """Contiguous, non-empty ranges of block indices, one per stage, that minimise the largest
    stage's cost (the pipeline runs at the pace of its slowest stage). ``first_extra`` and
    ``last_extra``: what the first and last stage carry besides blocks (embeddings; norm, head, loss).

    Exact dynamic programme over split points: O(stages × blocks²), nothing for tens of blocks.
    """
    n = len(costs)
    if not 1 <= n_stages <= n:
        raise ValueError(f"cannot split {n} blocks into {n_stages} non-empty stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def stage_cost(s: int, lo: int, hi: int) -> float:
        extra = (first_extra if s == 0 else 0.0) + (last_extra if s == n_stages - 1 else 0.0)
        return prefix[hi] - prefix[lo] + extra

    inf = float("inf")
    # best[s][j]: the smallest possible largest cost when stages 0..s-1 hold blocks 0..j-1
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        for j in range(s, n - (n_stages - s) + 1):
            for i in range(s - 1, j):
                value = max(best[s - 1][i], stage_cost(s - 1, i, j))
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    bounds = [n]
    for s in range(n_stages, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    bounds.reverse()
    return [range(lo, hi) for lo, hi in itertools.pairwise(bounds)]
