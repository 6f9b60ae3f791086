"""The adaptive batch: a global batch that follows the gradient noise scale, per-rank batches within
each rank's memory, and the arithmetic of both, apart from the training loop.

**The noise scale** (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training"):
B_simple = tr(Σ) / |G|², with G the true gradient and Σ the per-sample gradient covariance. Training
at batches well below it wastes steps (each is mostly noise), well above it wastes samples. A mean
gradient over b samples has E|g_b|² = |G|² + tr(Σ)/b, so two batch sizes give both unknowns. Every
adaptive step has them for free: rank r's own gradient (its b_r samples; the squared norm rides in
the trainer's synchronisation header) and the averaged one (all B = Σ b_r samples). With
uneven b_r the mean of the ranks' |g_r|² is |G|² + tr(Σ)·mean(1/b_r), so

    tr(Σ) = (mean_r |g_r|² − |G_B|²) / (mean_r 1/b_r − 1/B),    |G|² = |G_B|² − tr(Σ)/B.

One step's estimate is noisy (either can come out negative); both are averaged over steps
(exponentially, ``balance.noise_smoothing``) before the ratio is taken, as the paper advises. It
needs two ranks at least.

**The rule**: at each decision the global batch moves towards the noise scale, within
[the starting batch, ``max_global_batch``], by at most ``max_change`` of itself, and never above
the sum of the ranks' memory caps; the LR follows it, × B/B0 (``linear``, Goyal et al.'s rule for
SGD) or × sqrt(B/B0) (``sqrt``, for Adam: Malladi et al. 2022).

**Memory**: each rank's peak memory per step (the GPU allocator's peak; on the CPU the process's
peak RSS, VmHWM, reset each step through /proc/self/clear_refs) is bounded from above by the memory
held before training plus a per-sample cost that overstates the real one (:func:`memory_cap`); a rank's
cap is the batch whose predicted peak is 95 % of ``balance.memory_budget_gb``. An out-of-memory
error caps the rank at half the batch that failed, for the rest of the run.
"""

from __future__ import annotations

import math
import resource
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vatra.balance.split import TimeModel

GB = 1e9
HEADROOM = 0.95  # share of the memory budget a rank's predicted peak may reach


class NoiseScale:
    """Running estimate of the gradient noise scale B_simple = tr(Σ)/|G|² (module docstring)."""

    def __init__(self, smoothing: float) -> None:
        self.smoothing = smoothing
        self.trace: float | None = None  # running tr(Σ)
        self.sq: float | None = None  # running |G|²

    def update(self, ranks_sq: Sequence[float], sizes: Sequence[int], accum: int, global_sq: float) -> None:
        """One step: each rank's |g_r|² over its ``sizes[r] · accum`` samples, and the averaged |G_B|²."""
        b = np.asarray(sizes, dtype=float) * accum
        y = np.asarray(ranks_sq, dtype=float)
        if len(b) < 2 or not (np.all(np.isfinite(y)) and math.isfinite(global_sq)):
            return
        x_small, x_big = float(np.mean(1.0 / b)), 1.0 / float(b.sum())
        trace = (float(y.mean()) - global_sq) / (x_small - x_big)
        sq = global_sq - trace * x_big
        beta = self.smoothing
        self.trace = trace if self.trace is None else beta * self.trace + (1.0 - beta) * trace
        self.sq = sq if self.sq is None else beta * self.sq + (1.0 - beta) * sq

    @property
    def value(self) -> float | None:
        """B_simple in samples, or None before a positive estimate exists."""
        if self.trace is None or self.sq is None or self.sq <= 0.0 or self.trace <= 0.0:
            return None
        return self.trace / self.sq

    def state_dict(self) -> dict[str, Any]:
        return {"trace": self.trace, "sq": self.sq}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trace, self.sq = state["trace"], state["sq"]


def goodput_batch(noise: float | None, step: TimeModel | None) -> float | None:
    """The global batch that makes training progress fastest in wall time (Pollux's goodput:
    throughput × statistical efficiency), for a step lasting ``a + c·B`` seconds.

    With B_noise = φ, training needs 1 + φ/B times the fewest possible steps (McCandlish et al.),
    so a step of B samples makes progress ∝ B/(B + φ), and progress per second ∝
    B / ((B + φ)(a + cB)), whose maximum is at B* = sqrt(φ · a / c): the geometric mean of the noise
    scale and a/c, the batch at which the step's per-sample cost equals its fixed cost. Where the
    step time hardly grows with the batch (communication, launch overhead) larger batches pay;
    where it is all per-sample compute (a → 0) smaller ones do. None without a noise estimate; the
    noise scale itself for a step model that is not physical (the balancer first tries a larger
    batch once, to see how the step time grows).
    """
    if noise is None:
        return None
    if step is None or step.fixed <= 0.0 or step.per_sample <= 0.0:
        return noise
    return math.sqrt(noise * step.fixed / step.per_sample)


def next_global_batch(
    current: int, target: float | None, start: int, largest: int, max_change: float, fits: int
) -> int:
    """The next global batch: towards ``target`` within [``start``, ``largest``], at most ``max_change``
    of ``current`` away, and at most ``fits`` (what the ranks' memory caps add up to)."""
    target = float(current) if target is None else min(max(target, float(start)), float(largest))
    low = math.floor(current * (1.0 - max_change) + 1e-9)
    high = math.ceil(current * (1.0 + max_change) - 1e-9)
    return max(1, min(round(min(max(target, low), high)), fits))


def lr_multiplier(rule: str, optimizer: str, batch: int, start: int) -> float:
    """The LR multiplier at global batch ``batch`` (``start``: where the run began)."""
    if rule == "auto":
        rule = "linear" if optimizer == "sgd" else "sqrt"
    ratio = batch / start
    return {"linear": ratio, "sqrt": math.sqrt(ratio)}.get(rule, 1.0)


def memory_cap(
    batches: Sequence[float], peaks: Sequence[float], budget: float, base: float, floor: int
) -> int:
    """The largest batch whose peak memory stays within ``HEADROOM`` of ``budget`` bytes (at least
    ``floor``), from the (batch, peak) observations and ``base``, the memory the process held before
    training (model, data, libraries).

    With memory affine in the batch, ``fixed + per_sample · batch`` and fixed ≥ base, every
    observation bounds the per-sample cost from above, ``(peak − base) / batch``; the least of
    these bounds the peak of every larger batch (``base + bound · batch``), so the cap is safe and
    rises as larger batches are seen, and shrinking batches never lower it. A peak above the
    budget's headroom caps the batch below the one that had it, in proportion.
    """
    usable = HEADROOM * budget - base
    bounds = [(p - base) / b for b, p in zip(batches, peaks, strict=True) if b > 0]
    per_sample = min(bounds)
    cap = 1 << 40 if per_sample <= 0.0 else math.floor(usable / per_sample)
    for b, p in zip(batches, peaks, strict=True):
        if p - base > usable:  # over the headroom: this batch was too large
            cap = min(cap, math.floor(b * max(usable, 0.0) / (p - base)))
    return max(floor, cap)


class PeakMemory:
    """This process's peak memory over a stretch (a step): the allocator's on a GPU; on the CPU
    VmHWM, reset through /proc/self/clear_refs (Linux), else the lifetime peak RSS."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.clear_refs = Path("/proc/self/clear_refs")
        self.resettable = device.type == "cpu" and self._reset_rss()

    def _reset_rss(self) -> bool:
        try:
            self.clear_refs.write_text("5")
            return True
        except OSError:
            return False

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.resettable:
            self._reset_rss()

    def read(self) -> int:
        """Bytes."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        if self.resettable:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024

    def current(self) -> int:
        """Bytes held now (the baseline before training)."""
        if self.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.device))
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def budget(self, gb: float | None) -> float | None:
        """The budget in bytes: as configured; on a GPU by default its memory; else None (no cap)."""
        if gb is not None:
            return gb * GB
        if self.device.type == "cuda":
            return float(torch.cuda.get_device_properties(self.device).total_memory)
        return None
