"""The rank the others wait on: a straggler named from collective timings (C4 / Minder style).

In synchronous data parallelism every rank meets the others in the gradient all-reduce, so a slow
rank shows twice: its own compute (step start to its local backward's end) is long, and every
other rank's *wait* (the rest of its step: the all-reduce and what follows) is long by about the
same amount, while the slow rank itself hardly waits. C4 reads this off the collectives' timings,
Minder off per-machine metrics compared across machines. Here, per monitor window, with each rank's
mean compute ``c_r`` and wait ``w_r`` (step time − compute):

- the suspect ``s`` is the rank of the longest compute; ``excess = c_s − median(c_others)``;
- it is a straggler when ``c_s / median(c_others) ≥ ratio`` (``heal.straggler_ratio``, the same
  threshold the healing policy names a straggler with) **and** the others waited for it: their
  mean wait exceeds the suspect's by at least half the excess (a rank that is slow but that nobody
  waits on, as under ``dist.mode = "diloco"``, is not what holds the group back);
- it is named once it is the suspect in two windows in a row (one slow window is what start-up or a
  descheduled process looks like), and named again only after it recovered.

The ``straggler`` event carries the figures and a ``cause`` (``slow_node``) whose confidence grows
with the ratio (:mod:`vatra.monitor.rca`).
"""

from __future__ import annotations

import statistics
from typing import Any

from vatra.monitor.rca import Evidence, classify

WAIT_SHARE = 0.5  # the others' extra wait must account for this share of the suspect's extra compute


class CollectiveStraggler:
    """Fed one window at a time (rank 0); returns the ``straggler`` event's fields when it names one."""

    def __init__(self, ratio: float) -> None:
        self.ratio = ratio
        self.suspect: int | None = None
        self.named: int | None = None

    def observe(self, compute: list[float], wait: list[float]) -> dict[str, Any] | None:
        """``compute[r]`` / ``wait[r]``: rank r's mean seconds per step in the window."""
        if len(compute) < 2:
            return None
        s = max(range(len(compute)), key=compute.__getitem__)
        others = [r for r in range(len(compute)) if r != s]
        median = statistics.median(compute[r] for r in others)
        ratio = compute[s] / median if median > 0 else 1.0
        excess = compute[s] - median
        others_wait = statistics.fmean(wait[r] for r in others)
        waited = ratio >= self.ratio and others_wait - wait[s] >= WAIT_SHARE * excess
        confirmed = waited and self.suspect == s
        self.suspect = s if waited else None
        if not waited:
            self.named = None
            return None
        if not confirmed or self.named == s:
            return None
        self.named = s
        evidence = [
            f"rank {s} computes {compute[s] * 1e3:.1f} ms a step, {ratio:.1f}× the other ranks' median "
            f"{median * 1e3:.1f} ms",
            f"the other ranks wait {others_wait * 1e3:.1f} ms a step in collectives, rank {s} "
            f"{wait[s] * 1e3:.1f} ms: they wait on rank {s}",
        ]
        cause = classify(Evidence(rank=s, straggler={"ratio_to_median": ratio, "evidence": evidence}))
        return {
            "straggler_rank": s,
            "ratio_to_median": ratio,
            "compute_s": compute,
            "wait_s": wait,
            "cause": cause,
        }
