"""Run the fuzz targets (tests/fuzz) coverage-guided under atheris for minutes; table + JSON.

    python bench/fuzz.py --minutes 10 [--target wire --target secagg] [--jobs 2]

Each target runs in its own process (``python -m tests.fuzz.run``) with ``-rss_limit_mb`` and a
per-input ``-timeout``; its corpus is kept under ``bench/results/fuzz/<target>/corpus`` (a re-run
continues from it; ``--fresh`` starts from the seeds). libFuzzer stops at a finding: the input is
kept as ``crash-*`` / ``timeout-*`` / ``oom-*`` there, the error is recorded, and the target is
started again for the time left (once more per distinct error; a repeat ends the target). Columns:
executions, executions per second, ``cov`` (distinct instrumented edges reached: paths) and ``ft``
(libFuzzer's coverage features), corpus size, peak RSS, findings.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _common import RESULTS, print_table, write_result

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ("wire", "secagg", "config", "manifest", "table", "ablog", "contract", "notice")
_STATUS = re.compile(r"cov: (\d+) ft: (\d+) corp: (\d+)/")
_STAT = re.compile(r"stat::(\w+):\s+(\d+)")


def _error(log: str) -> str:
    """The finding's one-line reason: the Python exception, or libFuzzer's timeout / out-of-memory line."""
    if "Uncaught Python exception" in log:
        lines = (
            log.split("Uncaught Python exception: ===", 1)[1].split("Test unit written", 1)[0].splitlines()
        )
        tail = [ln for ln in lines if ln.strip() and not ln.startswith((" ", "Traceback", "=", "^"))]
        return tail[-1] if tail else "Python exception"
    found = re.search(r"ERROR: libFuzzer: ([^\n]*)", log)
    return found.group(1).strip() if found else "crash"


def _one_run(name: str, folder: Path, seconds: int, rss_mb: int, timeout_s: int) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    cmd = [sys.executable, "-m", "tests.fuzz.run", name, str(folder / "corpus"), f"-max_total_time={seconds}"]
    cmd += [
        f"-rss_limit_mb={rss_mb}",
        f"-timeout={timeout_s}",
        f"-artifact_prefix={folder}/",
        "-print_final_stats=1",
    ]
    start = time.monotonic()
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False
    )
    log = proc.stdout
    with (folder / "log.txt").open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n{log}\n")
    status = _STATUS.findall(log)
    stats = {k: int(v) for k, v in _STAT.findall(log)}
    execs = stats.get("number_of_executed_units") or max(
        (int(m) for m in re.findall(r"^#(\d+)", log, re.MULTILINE)), default=0
    )
    written = re.findall(r"Test unit written to (\S+)", log)
    done = re.search(r"Done \d+ runs in (\d+) second", log)
    return {
        "seconds": time.monotonic() - start,
        # libFuzzer's own count, without start-up; a run a finding ended has none: its wall time
        "fuzz_s": int(done.group(1)) if done else round(time.monotonic() - start),
        "executions": execs,
        "cov": int(status[-1][0]) if status else 0,
        "ft": int(status[-1][1]) if status else 0,
        "corpus": int(status[-1][2]) if status else 0,
        "peak_rss_mb": stats.get("peak_rss_mb", 0),
        "finding": None
        if proc.returncode == 0
        else {"error": _error(log), "input": written[-1] if written else ""},
    }


def fuzz_target(name: str, minutes: float, rss_mb: int, timeout_s: int, fresh: bool) -> dict[str, Any]:
    folder = RESULTS / "fuzz" / name
    if fresh and folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True, exist_ok=True)
    budget = minutes * 60.0
    runs: list[dict[str, Any]] = []
    findings: list[dict[str, str]] = []
    while budget >= 5:
        run = _one_run(name, folder, int(budget), rss_mb, timeout_s)
        runs.append(run)
        budget -= run["seconds"]
        if run["finding"] is None:
            break
        repeat = any(f["error"] == run["finding"]["error"] for f in findings)
        findings.append(run["finding"])
        print(f"{name}: finding: {run['finding']['error']} ({run['finding']['input']})", flush=True)
        if repeat:
            break
    seconds = sum(r["seconds"] for r in runs)
    execs = sum(r["executions"] for r in runs)
    return {
        "target": name,
        "seconds": round(seconds, 1),
        "fuzz_s": sum(r["fuzz_s"] for r in runs),
        "executions": execs,
        "execs_per_s": round(execs / seconds, 1) if seconds else 0.0,
        "cov": max(r["cov"] for r in runs),
        "ft": max(r["ft"] for r in runs),
        "corpus": runs[-1]["corpus"],
        "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
        "findings": findings,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=1.0, help="per target")
    parser.add_argument("--target", action="append", choices=TARGETS, help="repeat; default: all")
    parser.add_argument("--jobs", type=int, default=1, choices=(1, 2), help="targets at a time")
    parser.add_argument("--rss-mb", type=int, default=3072, help="libFuzzer -rss_limit_mb")
    parser.add_argument("--timeout-s", type=int, default=10, help="libFuzzer -timeout: one input's limit")
    parser.add_argument("--fresh", action="store_true", help="start from the seeds, not the kept corpus")
    args = parser.parse_args()
    names = args.target or list(TARGETS)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(args.jobs) as pool:  # each job is a subprocess: threads only wait
        rows = list(
            pool.map(lambda n: fuzz_target(n, args.minutes, args.rss_mb, args.timeout_s, args.fresh), names)
        )
    headers = ["target", "wall s", "fuzz s", "executions", "execs/s", "cov (paths)", "ft", "corpus"]
    keys = ["target", "seconds", "fuzz_s", "executions", "execs_per_s", "cov", "ft", "corpus", "peak_rss_mb"]
    print_table(
        [*headers, "peak RSS MB", "findings"],
        [[*(r[k] for k in keys), "; ".join(f["error"] for f in r["findings"]) or "none"] for r in rows],
    )
    suffix = "" if args.target is None else "_" + "_".join(names)
    write_result(f"fuzz{suffix}", {"minutes": args.minutes, "command": " ".join(sys.argv), "targets": rows})


if __name__ == "__main__":
    main()
