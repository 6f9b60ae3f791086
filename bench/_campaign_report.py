"""The fault campaign's report (bench/fault_campaign.py): the undisturbed reference runs, the
per-kind table with totals, and one line per run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from _common import print_table


@dataclass
class Reference:
    """An undisturbed run on one store variant: what every fault run is compared with."""

    variant: str
    weights: dict[str, Any]
    val_accuracy: float
    wall_s: float
    productive_s: float


def kind_row(kind: str, records: list[dict[str, Any]], clean_ratio: float) -> dict[str, Any]:
    productive = sum(r["ettr_parts"]["productive"] for r in records)
    ettr_wall = sum(r["ettr_parts"]["wall"] for r in records)  # every launch, as the run folder records it
    ratio = productive / ettr_wall if ettr_wall else 0.0
    wall = sum(r["wall_s"] for r in records)
    return {
        "kind": kind,
        "runs": len(records),
        "injected": sum(r["injected"] for r in records),
        "ok": sum(r["ok"] for r in records),
        "stopped": sum(r["stopped"] for r in records),
        "clear_stops": sum(r["clear_stops"] for r in records),
        "data_lost_runs": sum(bool(r["lost"]) for r in records),
        "versions_lost": sum(len(r["lost"]) for r in records),
        "effective_ratio": ratio,
        "vs_clean": ratio / clean_ratio if clean_ratio else 0.0,
        "mean_wall_s": wall / len(records) if records else 0.0,
    }


def report(
    records: list[dict[str, Any]], refs: dict[str, Reference], kinds: tuple[str, ...]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The per-kind table (in ``kinds``' order) and totals, printed with the undisturbed runs' figures."""
    clean = {v: r.productive_s / r.wall_s for v, r in refs.items()}
    rows = []
    for kind in kinds:
        mine = [r for r in records if r["kind"] == kind]
        if mine:
            rows.append(kind_row(kind, mine, clean["erasure" if kind == "lost_node" else "local"]))
    totals = kind_row("total", records, clean["local"])
    heads = [
        "kind",
        "runs",
        "injected",
        "ok",
        "stopped",
        "clear stops",
        "data lost",
        "eff. time",
        "vs clean",
        "wall s",
    ]
    keys = ["kind", "runs", "injected", "ok", "stopped", "clear_stops", "data_lost_runs", "effective_ratio"]
    keys += ["vs_clean", "mean_wall_s"]
    print_table(heads, [[row[k] for k in keys] for row in [*rows, totals]])
    print(
        "ok: final weights bitwise equal to the undisturbed run's "
        "(nan_burst, lr_spike: accuracy within 1 point)"
    )
    for variant, ref in refs.items():
        print(
            f"undisturbed {variant}: wall {ref.wall_s:.1f} s, productive {ref.productive_s:.2f} s "
            f"(ratio {clean[variant]:.3f}), val acc {ref.val_accuracy:.4f}"
        )
    return rows, totals


def print_runs(records: list[dict[str, Any]]) -> None:
    rows = []
    for r in records:
        bad = next((a for a in r["attempts"] if a["rc"] != 0), None)
        rows.append(
            [
                r["index"],
                r["kind"],
                r["step"],
                "→".join(str(a["rc"]) for a in r["attempts"]),
                "yes" if r["ok"] else "NO",
                len(r["lost"]),
                (bad["last_line"][:90] if bad else ""),
            ]
        )
    print_table(["run", "kind", "step", "exit codes", "ok", "lost", "first stop's last stderr line"], rows)
