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
    lines += [_row(f"rank {r['rank']} fixed", r["step_s"], r["shares"]) for r in fix.get("ranks", [])]
    lines.append(f"verdict: {report['verdict']}")
    for finding in report["findings"]:
        lines += [f"  {finding['kind']}: {line}" for line in finding["evidence"]]
        if finding["advice"]:
            lines.append(f"  {finding['kind']}: to do: {finding['advice']}")
    if fix.get("ranks"):
        part = TARGET.get(report["verdict"], "idle")
        was, now = fix["before"][part], fix["after"][part]
        change = f" ({(now - was) / was:+.0%})" if was else ""
        sets = ", ".join(f"{k}={v}" for k, v in fix["overrides"].items())
        lines.append(
            f"fix {sets}: {part} {was:.0%} → {now:.0%} of the step{change}; step "
            f"{fix['step_s']['before'] * 1e3:.1f} → {fix['step_s']['after'] * 1e3:.1f} ms"
        )
        lines.append(f"keep it: {fix['command']}")
    elif fix.get("note"):
        lines.append(f"fix: {fix['note']}")
    elif report["findings"][0]["fixes"]:
        sets = " ".join(f"--set {k}={v}" for k, v in report["findings"][0]["fixes"].items())
        lines.append(f"safe fix (apply and re-measure with --fix): {sets}")
    return "\n".join(lines)
