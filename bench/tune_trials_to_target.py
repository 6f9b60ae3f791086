"""Trials (and wall time) to a target validation accuracy for each sampler, on the whole user path.

  python bench/tune_trials_to_target.py [--trials 100] [--seeds 5] [--workers 2]
                                        [--samplers random,tpe,gp,adaptive] [--scaling 1,2,4]

Every study is ``vatra tune examples/tune_digits.toml`` as a user runs it (the digits MLP over the
example's 9-parameter space, 15 epochs per trial, the median pruner with its defaults, a journal
file), one after another in this run,
with ``tune.sampler`` and ``run.seed`` set per study. From each study's ``study.json``: the number
of trials (in the order they were asked, pruned and failed ones included: they cost time too)
until the first whose validation accuracy reaches 0.97, 0.975 and 0.98; the median over seeds of
the seeds that reached it, and how many did. ``--scaling``: the adaptive sampler's study with 1, 2
and 4 workers, wall time from the first trial's start to the completion of the first trial at
0.97. Prints tables and writes ``bench/results/tune_trials_to_target.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import print_table, write_result

ROOT = Path(__file__).resolve().parents[1]
TARGETS = (0.97, 0.975, 0.98)


def study(
    out: Path, sampler: str, seed: int, trials: int, workers: int, pruner: str, tag: str = ""
) -> dict[str, Any]:
    """One ``vatra tune`` run; its study.json and wall seconds."""
    name = f"{tag}{sampler}-s{seed}-w{workers}"
    sets = [f"run.name={name}", f"run.out_dir={out}", f"run.seed={seed}", f"tune.sampler={sampler}"]
    sets += [f"tune.trials={trials}", f"tune.workers={workers}"]
    sets += [f"tune.pruner={pruner}"] if pruner else []
    cmd = [sys.executable, "-m", "vatra", "tune", "examples/tune_digits.toml"]
    for s in sets:
        cmd += ["--set", s]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, **json.loads((out / name / "study.json").read_text())}


def trials_to(result: dict[str, Any], target: float) -> int | None:
    """1-based count of trials asked up to the first one at ``target`` (None when none reached it)."""
    for i, t in enumerate(sorted(result["trials"], key=lambda t: t["number"]), start=1):
        if t["state"] == "COMPLETE" and t["value"] is not None and t["value"] >= target:
            return i
    return None


def seconds_to(result: dict[str, Any], target: float) -> float | None:
    started = [t["started_at"] for t in result["trials"] if t.get("started_at")]
    hits = [
        t["completed_at"]
        for t in result["trials"]
        if t["state"] == "COMPLETE" and t["value"] is not None and t["value"] >= target
    ]
    return min(hits) - min(started) if hits and started else None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--samplers", default="random,tpe,gp,adaptive")
    parser.add_argument("--pruner", default="", help="tune.pruner for every study ('' = the example's)")
    parser.add_argument(
        "--scaling", default="1,2,4", help="worker counts for the adaptive sampler; '' = skip"
    )
    args = parser.parse_args()
    samplers = [s for s in args.samplers.split(",") if s]
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in samplers}
    scaling: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        for seed in range(args.seeds):  # seed-major: the samplers of one seed run close in time
            for sampler in samplers:
                r = study(out, sampler, seed, args.trials, args.workers, args.pruner)
                runs[sampler].append(
                    {
                        "seed": seed,
                        "wall_s": r["wall_s"],
                        "best": r["best"]["value"] if r["best"] else None,
                        "states": {
                            s: sum(t["state"] == s for t in r["trials"])
                            for s in ("COMPLETE", "PRUNED", "FAIL")
                        },
                        **{f"trials_to_{t}": trials_to(r, t) for t in TARGETS},
                    }
                )
                print(f"{sampler} seed {seed}: {runs[sampler][-1]}", flush=True)
        for w in [int(x) for x in args.scaling.split(",") if x]:
            r = study(out, "adaptive", 0, args.trials, w, args.pruner, tag="scaling-")
            per = [t["duration_s"] for t in r["trials"] if t["duration_s"]]
            scaling.append(
                {
                    "workers": w,
                    "wall_s": r["wall_s"],
                    "seconds_to_0.97": seconds_to(r, 0.97),
                    "trials_to_0.97": trials_to(r, 0.97),
                    "median_trial_s": statistics.median(per) if per else None,
                }
            )
            print(f"adaptive, {w} workers: {scaling[-1]}", flush=True)

    rows = []
    for sampler, rs in runs.items():
        row: list[Any] = [sampler]
        for t in TARGETS:
            got = [r[f"trials_to_{t}"] for r in rs if r[f"trials_to_{t}"] is not None]
            row.append(f"{statistics.median(got):g} ({len(got)}/{len(rs)})" if got else f"- (0/{len(rs)})")
        row.append(statistics.median(r["best"] for r in rs if r["best"] is not None))
        row.append(statistics.median(r["wall_s"] for r in rs))
        rows.append(row)
    print(f"\ntrials to target, median over the seeds that reached it (reached / run), {args.trials} trials:")
    print_table(["sampler", *(f"to {t}" for t in TARGETS), "best (median)", "study wall s (median)"], rows)
    if scaling:
        print("\nadaptive sampler, seed 0, by worker count:")
        print_table(
            ["workers", "wall s to 0.97", "trials to 0.97", "study wall s", "median trial s"],
            [
                [s["workers"], s["seconds_to_0.97"], s["trials_to_0.97"], s["wall_s"], s["median_trial_s"]]
                for s in scaling
            ],
        )
    write_result("tune_trials_to_target", {"args": vars(args), "runs": runs, "scaling": scaling})


if __name__ == "__main__":
    main()
