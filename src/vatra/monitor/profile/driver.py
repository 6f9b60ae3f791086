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
    ``fix``: try each of the verdict's candidate fixes in ``folder/fix<i>``, keep the one with the
    shortest step if it beats the run as written. Writes ``profile.json``."""
    steps = window_overrides(*window)
    before = measure([*overrides, *steps], folder)
    findings = judge(before["ranks"], cfg, cuda)
    report: dict[str, Any] = {
        **before,
        "verdict": findings[0].kind,
        "findings": [vars(f) for f in findings],
        "thresholds": "docs/profiling.md",
    }
    if fix:
        report["fix"] = _try_fixes(measure, before, findings[0].fixes, overrides, steps, folder, config_path)
    atomic_write(folder / "profile.json", json.dumps(report, indent=2) + "\n")
    return report


def _try_fixes(
    measure: Measure,
    before: dict[str, Any],
    candidates: list[dict[str, Any]],
    overrides: list[str],
    steps: list[str],
    folder: Path,
    config_path: str,
) -> dict[str, Any]:
    """Each candidate measured over the same window; the fastest kept when it beats ``before``."""
    tried = []
    for i, fixes in enumerate(candidates, 1):
        extra = [f"{key}={value}" for key, value in fixes.items()]
        after = measure([*overrides, *steps, *extra], folder / f"fix{i}")
        tried.append(
            {
                "overrides": fixes,
                "run_dir": str(folder / f"fix{i}"),
                **_summary(after),
                "ranks": after["ranks"],
            }
        )
    out: dict[str, Any] = {"before": _summary(before), "tried": tried, "kept": None}
    best = min(tried, key=lambda t: t["step_s"], default=None)
    if best is None:
        out["note"] = "no safe automatic fix for this verdict"
    elif best["step_s"] >= before["step_s"]:
        out["note"] = "no candidate shortened the step; nothing to keep"
    else:
        extra = [f"{key}={value}" for key, value in best["overrides"].items()]
        keep = ["vatra", "train", config_path, *[a for s in (*overrides, *extra) for a in ("--set", s)]]
        out.update(kept=tried.index(best), command=shlex.join(keep))
    return out


def _summary(measured: dict[str, Any]) -> dict[str, Any]:
    return {"step_s": measured["step_s"], "mean": measured["mean"]}
