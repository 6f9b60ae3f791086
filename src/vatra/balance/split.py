"""How a global batch is cut into per-rank batches: integer splits within bounds, and the split that
gives every rank the same predicted compute time.

Each rank's compute time per step is modelled as ``a_r + c_r · b_r`` (a fixed cost per step: kernel
launches, Python, the optimizer's share; plus a cost per sample), fitted by least squares to the
(batch, time) pairs the balancer measured. A model through the origin alone (``a_r = 0``, time ∝
batch) makes a small batch look slow per sample, because its fixed cost is spread over few samples:
the balancer would shrink it further, and the split would run away from the balance point. The
fixed cost is only identifiable once a rank has run two batch sizes; until then it is 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

HISTORY = 6  # windows per rank a time model is fitted to (online and in the simulator)


@dataclass(frozen=True)
class TimeModel:
    """One rank's compute seconds per step: ``fixed + per_sample · batch``."""

    fixed: float
    per_sample: float

    def __call__(self, batch: float) -> float:
        return self.fixed + self.per_sample * batch


def fit_time_model(batches: Sequence[float], times: Sequence[float]) -> TimeModel:
    """Least-squares ``time = fixed + per_sample · batch`` over the observations (at least one).

    With one batch size, or a fit that is not physical (a negative fixed cost, a per-sample cost ≤ 0:
    noise), time is taken as proportional to the batch.
    """
    b, t = np.asarray(batches, dtype=float), np.asarray(times, dtype=float)
    through_origin = TimeModel(0.0, max(float(t @ b) / float(b @ b), 1e-12))
    if len(b) < 2 or np.ptp(b) < 0.5:
        return through_origin
    per_sample, fixed = np.polyfit(b, t, 1)
    if fixed < 0.0 or per_sample <= 0.0:
        return through_origin
    return TimeModel(float(fixed), float(per_sample))


def _fill(total: int, shape: Callable[[float], np.ndarray], lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """The real split ``clip(shape(x), lo, hi)`` whose sum is ``total``, for the x bisection finds
    (``shape`` grows with x in every entry)."""
    low, high = 0.0, 1.0
    while np.clip(shape(high), lo, hi).sum() < total:
        high *= 2.0
        if high > 1e18:
            break
    for _ in range(200):
        mid = 0.5 * (low + high)
        if np.clip(shape(mid), lo, hi).sum() < total:
            low = mid
        else:
            high = mid
    return np.clip(shape(high), lo, hi)


def _round(x: np.ndarray, total: int, lo: np.ndarray, hi: np.ndarray) -> list[int]:
    """Integers summing to ``total`` near ``x`` (whose sum is ``total``, up to rounding): floors, then
    the largest remainders get one more (never above ``hi``, never below ``lo``)."""
    base = np.clip(np.floor(x + 1e-9), lo, hi).astype(int)
    while base.sum() > total:  # x summed a hair above total
        r = int(np.argmax(np.where(base > lo, base - x, -np.inf)))
        base[r] -= 1
    while base.sum() < total:
        r = int(np.argmax(np.where(base < hi, x - base, -np.inf)))
        base[r] += 1
    return [int(v) for v in base]


def _bounds(
    total: int, n: int, lo: Sequence[int] | int, hi: Sequence[int] | int | None
) -> tuple[np.ndarray, np.ndarray]:
    lo_a = np.broadcast_to(np.asarray(lo, dtype=float), (n,)).copy()
    hi_a = np.broadcast_to(np.asarray(total if hi is None else hi, dtype=float), (n,)).copy()
    if lo_a.sum() > total or hi_a.sum() < total or np.any(lo_a > hi_a):
        raise ValueError(
            f"no split of {total} samples fits the bounds {lo_a.astype(int).tolist()} … "
            f"{hi_a.astype(int).tolist()}"
        )
    return lo_a, hi_a


def proportional_split(
    total: int, weights: Sequence[float], lo: Sequence[int] | int = 1, hi: Sequence[int] | int | None = None
) -> list[int]:
    """``total`` samples in integers proportional to ``weights`` (> 0), each within ``[lo, hi]``; where a
    bound binds, the others share what is left in the same proportions (water-filling)."""
    w = np.asarray(weights, dtype=float)
    if len(w) == 0 or np.any(~np.isfinite(w)) or np.any(w <= 0):
        raise ValueError(f"weights must be finite and > 0, got {list(weights)}")
    lo_a, hi_a = _bounds(total, len(w), lo, hi)
    return _round(_fill(total, lambda x: x * w, lo_a, hi_a), total, lo_a, hi_a)


def equal_time_split(
    total: int,
    models: Sequence[TimeModel],
    lo: Sequence[int] | int = 1,
    hi: Sequence[int] | int | None = None,
) -> list[int]:
    """The split whose predicted compute times ``models[r](b_r)`` are equal (all ranks finish
    together), each batch within ``[lo, hi]``: b_r = (T − fixed_r) / per_sample_r for the T that sums
    to ``total``."""
    fixed = np.asarray([m.fixed for m in models])
    per = np.asarray([m.per_sample for m in models])
    lo_a, hi_a = _bounds(total, len(models), lo, hi)
    return _round(_fill(total, lambda t: (t - fixed) / per, lo_a, hi_a), total, lo_a, hi_a)


def predicted_step(models: Sequence[TimeModel], sizes: Sequence[int]) -> float:
    """A synchronous step lasts as long as its slowest rank's compute."""
    return max(m(b) for m, b in zip(models, sizes, strict=True))


def change_bounds(
    current: Sequence[int], caps: Sequence[int], max_change: float, min_batch: int
) -> tuple[list[int], list[int]]:
    """Per-rank bounds of the next split: within ``max_change`` of each current batch, at least
    ``min_batch``, at most the rank's cap; where the caps bind harder than the change limit, the
    other ranks may grow up to their caps so the global batch still fits."""
    lo = [min(b, max(min_batch, math.floor(b * (1.0 - max_change) + 1e-9))) for b in current]
    hi = [
        max(min(cap, math.ceil(b * (1.0 + max_change) - 1e-9)), lo_r)
        for b, cap, lo_r in zip(current, caps, lo, strict=True)
    ]
    if sum(hi) < sum(current):
        hi = [max(h, cap) for h, cap in zip(hi, caps, strict=True)]
    return lo, hi
