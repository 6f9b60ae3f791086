"""The console's view of a profile: a table of each rank's shares, the verdict and its evidence,
and the fix before/after with the command line that keeps it."""

from __future__ import annotations

from typing import Any

from vatra.monitor.profile.breakdown import PARTS

HEADS = ("data", "fwd", "bwd", "comm", "optim", "ckpt", "other", "idle")
# the part of the step each verdict's fix is meant to shrink
TARGET = {"data-bound": "data_wait", "checkpoint-stall": "checkpoint", "communication-bound": "comm_exposed"}


def _row(label: str, step_s: float, shares: dict[str, float]) -> str:
    return f"{label:<14}{step_s * 1e3:>9.1f}" + "".join(f"{shares[p]:>7.0%}" for p in PARTS)


def format_report(report: dict[str, Any]) -> str:
    a, b = report["steps"]
    lines = [
        f"vatra profile: steps {a}-{b} on {report['world_size']} rank(s), reader: {report['reader']}",
        f"{'':<14}{'step ms':>9}" + "".join(f"{h:>7}" for h in HEADS),
    ]
    lines += [_row(f"rank {r['rank']}", r["step_s"], r["shares"]) for r in report["ranks"]]
    fix = report.get("fix", {})
    for i, tried in enumerate(fix.get("tried", []), 1):
        lines += [_row(f"rank {r['rank']} fix {i}", r["step_s"], r["shares"]) for r in tried["ranks"]]
    lines.append(f"verdict: {report['verdict']}")
    for finding in report["findings"]:
        lines += [f"  {finding['kind']}: {line}" for line in finding["evidence"]]
        if finding["advice"]:
            lines.append(f"  {finding['kind']}: to do: {finding['advice']}")
    part = TARGET.get(report["verdict"], "idle")
    for i, tried in enumerate(fix.get("tried", []), 1):
        was, now = fix["before"]["mean"][part], tried["mean"][part]
        change = f" ({(now - was) / was:+.0%})" if was else ""
        lines.append(
            f"fix {i} {_sets(tried['overrides'], ', ')}: {part} {was:.0%} → {now:.0%} of the step"
            f"{change}; step {fix['before']['step_s'] * 1e3:.1f} → {tried['step_s'] * 1e3:.1f} ms"
        )
    if fix.get("command"):
        lines.append(f"kept fix {fix['kept'] + 1}: {fix['command']}")
    elif fix.get("note"):
        lines.append(f"fix: {fix['note']}")
    elif not fix and report["findings"][0]["fixes"]:
        options = " | ".join(_sets(c, " ", "--set ") for c in report["findings"][0]["fixes"])
        lines.append(f"safe fixes (--fix tries each and keeps the fastest): {options}")
    return "\n".join(lines)


def _sets(overrides: dict[str, Any], sep: str, prefix: str = "") -> str:
    return sep.join(f"{prefix}{k}={v}" for k, v in overrides.items())
