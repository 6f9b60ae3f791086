"""The verdict: what bounds the profiled steps, with its evidence and the safe fixes to try.

Rules, over the ranks' breakdowns (shares of the step time; thresholds in docs/profiling.md):

* ``checkpoint-stall``: checkpoint saves take ≥ 15 % of the window on some rank;
* ``data-bound``: the training thread waits for data ≥ 30 % of the step on some rank (the seed's
  distributed profiler found 30 % in data loading);
* ``straggler``: one rank's own time (step minus exposed communication and data wait) is ≥ 1.3×
  the other ranks' median while they spend ≥ 20 % of their step waiting in collectives, and its
  extra time is at least half of their wait (they wait for it, not for the link);
* ``communication-bound``: the ranks spend ≥ 30 % of their step (mean) waiting in collectives;
* ``overhead-bound``: the compute phases run ≥ 300 top-level ops per step whose median is
  < 20 µs, or their ops fill < 50 % of those phases (the rest is Python and dispatch);
* ``compute-bound`` otherwise: forward, backward and the optimizer fill the step.

The first rule that holds is the verdict; every rule that holds is a finding with its evidence.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

CHECKPOINT_SHARE = 0.15
DATA_SHARE = 0.30
STRAGGLER_RATIO = 1.3
STRAGGLER_WAIT = 0.20
STRAGGLER_EXPLAINS = 0.5
COMM_SHARE = 0.30
TINY_OPS_PER_STEP = 300
TINY_OP_US = 20.0
OP_FILL = 0.5
MAX_WORKERS = 8  # loader worker processes a fix asks for, at most
MAX_THREADS = 16  # prefetch threads a fix asks for, at most (threads that wait cost little)


@dataclass
class Finding:
    kind: str
    evidence: list[str]
    # candidate fixes, each a set of --set overrides (section.key → value); --fix tries every one
    fixes: list[dict[str, Any]] = field(default_factory=list)
    advice: str = ""


def judge(ranks: list[dict[str, Any]], cfg: Any, cuda: bool = False) -> list[Finding]:
    """Every rule that holds, the verdict first; ``[compute-bound]`` when none does. ``cfg``: the
    run's resolved config (the fixes start from its values)."""
    found: list[Finding] = []
    share = {part: [r["shares"][part] for r in ranks] for part in ranks[0]["shares"]}
    worst = max(ranks, key=lambda r: r["shares"]["checkpoint"])
    if worst["shares"]["checkpoint"] >= CHECKPOINT_SHARE:
        every = cfg.checkpoint.every_steps
        fixes = [{"checkpoint.every_steps": every * 4}] if isinstance(every, int) and every > 0 else []
        found.append(
            Finding(
                "checkpoint-stall",
                [f"rank {worst['rank']}: checkpoint saves take {worst['shares']['checkpoint']:.0%} of "
                 f"the step time (threshold {CHECKPOINT_SHARE:.0%})"],
                fixes,
                "save less often (checkpoint.every_steps, or 'auto' for Young/Daly), or "
                "checkpoint.async = true",
            )
        )  # fmt: skip
    worst = max(ranks, key=lambda r: r["shares"]["data_wait"])
    if worst["shares"]["data_wait"] >= DATA_SHARE:
        found.append(_data_bound(worst, cfg, cuda))
    if len(ranks) > 1:
        found += _straggler(ranks)
    mean_comm = statistics.fmean(share["comm_exposed"])
    if mean_comm >= COMM_SHARE and not any(f.kind == "straggler" for f in found):
        bucket = cfg.dist.bucket_cap_mb
        found.append(
            Finding(
                "communication-bound",
                [f"the ranks wait in collectives {mean_comm:.0%} of their step (mean; threshold "
                 f"{COMM_SHARE:.0%})",
                 f"collective time hidden under compute: "
                 f"{statistics.fmean(r['comm_overlapped'] for r in ranks) * 1e3:.1f} ms of "
                 f"{statistics.fmean(r['comm_total'] for r in ranks) * 1e3:.1f} ms a window"],
                [{"dist.bucket_cap_mb": bucket / 4}] if bucket > 1 else [],
                "smaller buckets start the all-reduce earlier in backward (more overlap); on a slow "
                "link, compress the gradients (comm.method = 'powersgd' or 'topk', docs/communication.md)",
            )
        )  # fmt: skip
    ops = statistics.median(r["ops_per_step"] for r in ranks)
    op_us = statistics.median(r["median_op_us"] for r in ranks)
    fill = statistics.median(r["op_share_of_compute"] for r in ranks)
    if (ops >= TINY_OPS_PER_STEP and op_us < TINY_OP_US) or fill < OP_FILL:
        found.append(
            Finding(
                "overhead-bound",
                [f"{ops:.0f} top-level ops per step, median {op_us:.1f} µs; ops fill {fill:.0%} of "
                 "forward, backward and optimizer (the rest is Python and dispatch)"],
                [],
                "fewer, larger ops: a larger train.batch_size, train.compile = true, fused optimizers",
            )
        )  # fmt: skip
    if not found:
        compute = statistics.fmean(
            r["shares"]["forward"] + r["shares"]["backward"] + r["shares"]["optimizer"] for r in ranks
        )
        found.append(
            Finding(
                "compute-bound",
                [f"forward, backward and optimizer fill {compute:.0%} of the step (mean over ranks)"],
            )
        )
    return found


def _straggler(ranks: list[dict[str, Any]]) -> list[Finding]:
    """One rank's own work (step − exposed comm − data wait) well above the others', and the extra
    explains at least half of what the others wait in collectives: they wait for it, not the link."""
    own = [r["step_s"] * (1 - r["shares"]["comm_exposed"] - r["shares"]["data_wait"]) for r in ranks]
    slow = max(range(len(ranks)), key=lambda i: own[i])
    rest = [i for i in range(len(ranks)) if i != slow]
    usual = statistics.median(own[i] for i in rest)
    wait_share = statistics.median(ranks[i]["shares"]["comm_exposed"] for i in rest)
    wait_s = statistics.median(ranks[i]["shares"]["comm_exposed"] * ranks[i]["step_s"] for i in rest)
    ratio = own[slow] / max(usual, 1e-9)
    explains = (own[slow] - usual) >= STRAGGLER_EXPLAINS * wait_s
    if ratio < STRAGGLER_RATIO or wait_share < STRAGGLER_WAIT or not explains:
        return []
    rank = ranks[slow]["rank"]
    return [
        Finding(
            "straggler",
            [f"rank {rank}: {own[slow] * 1e3:.1f} ms of its own work per step, {ratio:.1f}× the other "
             f"ranks' median ({usual * 1e3:.1f} ms)",
             f"the other ranks wait in collectives {wait_share:.0%} of their step ({wait_s * 1e3:.1f} ms), "
             f"{(own[slow] - usual) / max(wait_s, 1e-9):.0%} of it explained by rank {rank}'s extra work"],
            [],
            f"find what slows rank {rank} (its host, its data shard), or let balance.method = "
            "'proportional' give it a smaller share of each batch",
        )
    ]  # fmt: skip


def _data_bound(worst: dict[str, Any], cfg: Any, cuda: bool) -> Finding:
    """Enough parallel reads that loading a batch (the wait measured) overlaps the rest of the
    step: k = ⌈wait ÷ the step's other work⌉ + 1 readers. Without loader workers two candidates:
    k prefetch threads (cheap for reads that wait) or k worker processes (for reads that compute);
    with workers, twice as many. Pinned memory is on with CUDA already (the loader pins there)."""
    wait, step = worst["parts"]["data_wait"] / worst["steps"], worst["step_s"]
    k = max(2, math.ceil(wait / max(step - wait, 1e-4)) + 1)
    workers, factor = cfg.data.workers, max(cfg.data.prefetch_factor, 4)
    fixes: list[dict[str, Any]] = []
    if workers == 0:
        if min(k, MAX_THREADS) > cfg.data.prefetch:
            fixes.append({"data.prefetch": min(k, MAX_THREADS)})
        fixes.append({"data.workers": min(k, MAX_WORKERS), "data.prefetch_factor": factor})
    elif workers < MAX_WORKERS:
        fixes.append({"data.workers": min(MAX_WORKERS, workers * 2), "data.prefetch_factor": factor})
    evidence = [
        f"rank {worst['rank']}: waits for data {worst['shares']['data_wait']:.0%} of the step "
        f"({wait * 1e3:.1f} ms of {step * 1e3:.1f} ms; threshold {DATA_SHARE:.0%})",
        f"data.workers = {workers}, data.prefetch = {cfg.data.prefetch}, "
        f"data.prefetch_factor = {cfg.data.prefetch_factor}",
        "pinned memory: on (the loader pins batches whenever the device is CUDA)"
        if cuda
        else "pinned memory: not applicable (no CUDA device)",
    ]
    return Finding("data-bound", evidence, fixes, "read batches in parallel and ahead of the step")
