"""Root-cause analysis over the fault campaign: is each injected fault named, and how soon?

Each run is one of the fault campaign's (bench/fault_campaign.py: ``vatra train examples/digits.toml
--nproc 2 --max-restarts 2``, the fault injected from outside at a drawn step, a rerun after a
preemption or a freed disk), 2 per kind by default. For each run:

- **vatra's verdict**: the most confident ``cause`` among the run's events
  (:func:`vatra.monitor.rca.diagnosis`); on a full disk, where no event can be written, the
  launcher's console line ``vatra: cause: ...``;
- **exit codes only**, the baseline a torchrun user has: the agent's report of each failed worker
  (exit code, signal) and the launcher's exit code, classified by the same rules with no other
  evidence;
- **time to cause**: from the fault (the harness's injection; for NaN and LR faults, the run's
  own ``chaos`` event) to the first event that names the expected cause.

Accuracy per kind is the share of runs whose verdict is the expected cause (docs/root-cause.md).

    .venv/bin/python bench/rca.py [--runs-per-kind 2] [--kinds kill9,sigterm,...] [--seed 0] [--keep DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _faults as F
import fault_campaign as fc
from _common import print_table, write_result
from vatra.monitor.rca import Evidence, classify, diagnosis

EXPECTED = {
    "kill9": "dead_node",
    "sigterm": "preemption",
    "corrupt_object": "corrupt_checkpoint",
    "truncate_manifest": "corrupt_checkpoint",
    "lost_node": "dead_node",
    "disk_full": "disk_full",
    "nan_burst": "nan",
    "lr_spike": "nan",
}
_LINE = re.compile(r"^vatra: cause: (.+?)(?: on rank \d+)? \(confidence ([0-9.]+)\)")
_WORDS = {
    "out of memory": "oom",
    "communication timeout": "comm_timeout",
    "dead node": "dead_node",
    "slow node": "slow_node",
    "NaN / divergence": "nan",
    "data error": "data_error",
    "disk full": "disk_full",
    "corrupt checkpoint": "corrupt_checkpoint",
    "preemption": "preemption",
    "user code error": "user_error",
    "unknown cause": "unknown",
}


def console_causes(base: Path) -> list[tuple[str, float]]:
    """(kind, confidence) of every ``vatra: cause:`` line the launches printed."""
    out = []
    for path in sorted(base.glob("launch*.stdout")):
        for text in path.read_text(errors="replace").splitlines():
            if m := _LINE.match(text):
                out.append((_WORDS.get(m.group(1), "unknown"), float(m.group(2))))
    return out


def baseline(events: list[dict[str, Any]], launches: fc.Launches) -> str:
    """What exit codes alone say: the agent's reports and the launcher's exit code, no other evidence."""
    causes = [
        classify(Evidence(exit_code=e.get("exit_code"), signal=e.get("signal")))
        for e in events
        if e.get("event") == "worker_failed"
    ]
    causes += [classify(Evidence(exit_code=a.rc)) for a in launches.attempts if a.rc not in (0, 1)]
    best = max(causes, key=lambda c: c["confidence"], default=None)
    return best["kind"] if best else "unknown"


def one_run(setup: fc.Setup, fault: fc.Fault) -> dict[str, Any]:
    base = setup.work / fault.name
    base.mkdir(parents=True)
    variant = "erasure" if fault.kind == "lost_node" else "local"
    extra = [*fc.chaos_sets(fault), *(fc.erasure_sets(base / "nodes") if variant == "erasure" else [])]
    mount = F.tmpfs(base / "mnt", fc.TMPFS_MB) if fault.kind == "disk_full" else contextlib.nullcontext(base)
    with mount as where:
        run = where / "run"
        launches = fc.launch_until_done(setup, setup.command(run, extra), run, base, fault)
        events = F.read_lines(run / "events.jsonl")
    verdict = diagnosis(events)
    said = console_causes(base)
    if verdict is None and said:  # nothing in events.jsonl (a full disk): the console's line
        kind, confidence = max(said, key=lambda s: s[1])
        verdict = {"kind": kind, "confidence": confidence, "event": "console"}
    expected = EXPECTED[fault.kind]
    detail = launches.injection.detail if launches.injection else {}
    chaos = [e["time"] for e in events if e.get("event") == "chaos"]
    fault_time = chaos[0] if fault.kind in fc.ACCURACY_KINDS and chaos else detail.get("at_time")
    named = [
        e["time"]
        for e in events
        if isinstance(e.get("cause"), dict) and e["cause"]["kind"] == expected and "time" in e
    ]
    later = [t - fault_time for t in named if fault_time is not None and t >= fault_time]
    return {
        "kind": fault.kind,
        "step": fault.step,
        "injected": fc.injected(fault, launches.injection),
        "expected": expected,
        "verdict": verdict["kind"] if verdict else "unknown",
        "confidence": verdict["confidence"] if verdict else 0.0,
        "correct": bool(verdict) and verdict["kind"] == expected,
        "baseline": baseline(events, launches),
        "time_to_cause_s": later[0] if later else None,
        "exit_codes": [a.rc for a in launches.attempts],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs-per-kind", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kinds", default=",".join(fc.KINDS))
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--keep", type=Path, default=None, help="Keep the run folders here (default: removed).")
    args = ap.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    if "disk_full" in kinds and (why := F.can_mount()) is not None:
        print(f"skipping disk_full: {why}")
        kinds.remove("disk_full")
    work = args.keep or Path(tempfile.mkdtemp(prefix="vatra-rca-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        setup = fc.Setup(F.ROOT / "examples" / "digits.toml", [], 2, 2, args.timeout, work)
        plan = fc.draw_plan(args.runs_per_kind * len(kinds), kinds, args.seed, setup.cfg, 2)
        records = []
        for fault in plan:
            record = one_run(setup, fault)
            records.append(record)
            print(
                f"[{fault.index + 1}/{len(plan)}] {fault.kind}: {record['verdict']} "
                f"({record['confidence']:.2g}), exit codes only: {record['baseline']}, "
                f"time to cause {record['time_to_cause_s']}",
                flush=True,
            )
            if args.keep is None:
                shutil.rmtree(work / fault.name, ignore_errors=True)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    rows = []
    for kind in kinds:
        mine = [r for r in records if r["kind"] == kind]
        times = sorted(r["time_to_cause_s"] for r in mine if r["time_to_cause_s"] is not None)
        rows.append(
            {
                "kind": kind,
                "expected": EXPECTED[kind],
                "runs": len(mine),
                "accuracy": sum(r["correct"] for r in mine) / len(mine),
                "exit_codes_only": sum(r["baseline"] == EXPECTED[kind] for r in mine) / len(mine),
                "verdicts": sorted({r["verdict"] for r in mine}),
                "median_time_to_cause_s": times[len(times) // 2] if times else None,
            }
        )
    heads = ["kind", "expected", "runs", "accuracy", "exit codes only", "named", "time to cause (s)"]
    print_table(
        heads, [[*list(r.values())[:5], ",".join(r["verdicts"]), r["median_time_to_cause_s"]] for r in rows]
    )
    total = sum(r["correct"] for r in records) / len(records)
    base = sum(r["baseline"] == r["expected"] for r in records) / len(records)
    print(f"accuracy {total:.2f} over {len(records)} runs (exit codes only: {base:.2f})")
    write_result(
        "rca",
        {
            "command": "bench/rca.py " + " ".join(sys.argv[1:]),
            "per_kind": rows,
            "accuracy": total,
            "exit_codes_only_accuracy": base,
            "wall_s": time.perf_counter() - t0,
            "runs": records,
        },
    )


if __name__ == "__main__":
    main()
