"""The console's one line for each event that changes the course of a run.

A resume (from which checkpoint version and step, and whether the world size changed), a recovery
after a worker died, a rollback and a skipped update each get one plain line as they happen;
events.jsonl keeps the full record. Rank 0's progress display prints them
(:class:`~vatra.monitor.progress.ProgressDisplay`), so a group of ranks prints each line once.
"""

from __future__ import annotations

from typing import Any

from vatra.monitor.rca import line


def _world(fields: dict[str, Any]) -> str:
    before, now = fields.get("saved_world_size"), fields.get("world_size")
    return f"world size {before} → {now}" if before and now and before != now else ""


def _resume(fields: dict[str, Any]) -> str:
    where = f"checkpoint version {fields['version']} at step {fields['resumed_step']}"
    notes = [n for n in (_world(fields),) if n]
    failures = fields.get("failures") or []
    if not failures:
        tail = f" ({'; '.join(notes)})" if notes else ""
        return f"resumed from {where}{tail}"
    first = failures[0]
    how = f"killed by {first['signal']}" if first.get("signal") else f"exit code {first.get('exit_code')}"
    at = f" at step {first['step']}" if first.get("step") is not None else ""
    lost = int(fields.get("steps_lost") or 0)
    notes.insert(0, f"{lost} step{'s' if lost != 1 else ''} lost")
    return f"recovering: rank {first.get('rank')} {how}{at}; resumed from {where} ({'; '.join(notes)})"


def _heal(fields: dict[str, Any]) -> str | None:
    action, reason = fields.get("action"), fields.get("reason", "")
    evidence = fields.get("evidence") or {}
    if action == "skip_update":
        return f"skipped step {evidence.get('at_step', fields['step'])}: {reason}"
    if action == "rollback":
        source = evidence.get("source", "")
        via = f" ({source})" if source else ""
        at = evidence.get("at_step", evidence.get("from_step"))
        return f"rollback: {reason} at step {at}, back to step {evidence.get('to_step', fields['step'])}{via}"
    if action == "lr_restore":
        return "learning rate back on schedule: the loss is back on its baseline"
    return None


def describe(kind: str, fields: dict[str, Any]) -> str | None:
    """The console line for event ``kind`` with ``fields`` (as in events.jsonl), or None: not one
    the console tells."""
    if kind == "resume":
        return _resume(fields)
    if kind == "heal":
        return _heal(fields)
    if kind in ("straggler", "checkpoint_corrupt") and isinstance(fields.get("cause"), dict):
        rank = fields.get("straggler_rank")
        return line(fields["cause"], rank if isinstance(rank, int) else None)
    if kind == "preemption_notice":
        return (
            f"preemption notice ({fields['detail']}): saving a checkpoint within {fields['window_s']:.0f} s"
        )
    return None
