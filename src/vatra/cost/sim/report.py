"""The simulator's output: a table, a JSON file and, where matplotlib is installed, a plot."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from vatra.cost.sim.engine import Outcome


def table(results: list[Outcome], title: str) -> Table:
    base = results[0].cost_usd if results and results[0].policy == "on-demand" else None
    t = Table(title=title)
    for col in (
        "policy",
        "cost $",
        "vs on-demand",
        "completion h",
        "lost work h",
        "restarts",
        "migrations",
        "checkpoints",
    ):
        t.add_column(col, justify="left" if col == "policy" else "right")
    for o in results:
        versus = f"{(o.cost_usd / base - 1) * 100:+.1f} %" if base else "-"
        done = f"{o.completion_h:.1f}" if o.finished else "unfinished"
        t.add_row(o.policy, f"{o.cost_usd:,.0f}", versus, done, f"{o.lost_work_h:.2f}", f"{o.restarts:.1f}",
                  f"{o.migrations:.1f}", f"{o.checkpoints:.0f}")  # fmt: skip
    return t


def write(out: Path, payload: dict[str, object], results: list[Outcome], console: Console) -> None:
    """``results.json`` and ``policies.png``; a plot that cannot be drawn is a note, never a failure."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    console.print(f"wrote {out / 'results.json'}", markup=False, highlight=False)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        console.print(
            "note: no plot: pip install 'vatra[report]' for matplotlib", markup=False, highlight=False
        )
        return
    try:
        names = [o.policy for o in results]
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
        left.bar(names, [o.cost_usd for o in results], color="#4c72b0")
        left.set_ylabel("cost (USD)")
        right.bar(names, [o.completion_h for o in results], color="#dd8452")
        right.set_ylabel("completion (hours)")
        for ax in (left, right):
            ax.tick_params(axis="x", labelrotation=20)
        fig.tight_layout()
        fig.savefig(out / "policies.png", dpi=110)
        plt.close(fig)
        console.print(f"wrote {out / 'policies.png'}", markup=False, highlight=False)
    except Exception as err:
        console.print(f"note: no plot: {err}", markup=False, highlight=False)
