"""One profile: measure the window, judge it, and with ``fix`` re-measure the same window with the
verdict's safe fixes as ``--set`` overrides; the report ``profile.json`` holds.

How the window is trained is the caller's: ``vatra profile`` launches the ranks like ``vatra
train``; a test or a benchmark may call ``vatra.fit`` in its own process.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vatra._io import atomic_write
from vatra.monitor.profile.verdict import judge

# (the run's --set overrides, the run folder) → analyse(run folder), after training the window
Measure = Callable[[list[str], Path], dict[str, Any]]


def window_overrides(first: int, last: int) -> list[str]:
    """The profiler on steps first..last, and the run stopped after the window."""
    return [f"monitor.profile_steps={first}:{last}", f"train.steps={last}"]


def profile_run(
    measure: Measure,
    cfg: Any,
    overrides: list[str],
    window: tuple[int, int],
    folder: Path,
    *,
    fix: bool,
    cuda: bool,
    config_path: str,
) -> dict[str, Any]:
    """Profile ``window`` of the run ``cfg`` (resolved with the user's ``overrides``) in ``folder``;
    ``fix``: apply the verdict's fixes in ``folder/fix`` and compare. Writes ``profile.json``."""
    steps = window_overrides(*window)
    before = measure([*overrides, *steps], folder)
    findings = judge(before["ranks"], cfg, cuda)
    report: dict[str, Any] = {
        **before,
        "verdict": findings[0].kind,
        "findings": [vars(f) for f in findings],
        "thresholds": "docs/profiling.md",
    }
    fixes = findings[0].fixes
    if fix and fixes:
        extra = [f"{key}={value}" for key, value in fixes.items()]
        after = measure([*overrides, *steps, *extra], folder / "fix")
        keep = ["vatra", "train", config_path, *[a for s in (*overrides, *extra) for a in ("--set", s)]]
        report["fix"] = {
            "overrides": fixes,
            "run_dir": str(folder / "fix"),
            "ranks": after["ranks"],
            "before": before["mean"],
            "after": after["mean"],
            "step_s": {"before": before["step_s"], "after": after["step_s"]},
            "command": shlex.join(keep),
        }
    elif fix:
        report["fix"] = {"overrides": {}, "note": f"no safe automatic fix for {findings[0].kind}"}
    atomic_write(folder / "profile.json", json.dumps(report, indent=2) + "\n")
    return report
