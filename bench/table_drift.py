"""Drift between two table versions: the seconds of a 1 M × 20 comparison, and what each detector sees.

    python bench/table_drift.py [--rows 1000000] [--matrix-rows 100000] [--seeds 3] [--resamples 100]

1. **Speed**: a reference of ``--rows`` rows × 20 columns (14 numbers: normal, log-normal, uniform,
   Poisson counts; 1 boolean; 4 categories of 4 to 1,000 values; 1 source of 10 values) against a
   current version of as many rows from other seeds, with a few columns changed (×100 in 2 % of
   rows, °F→°C, a mean shift, a new category) so the unit detector's slower paths run too. Wall
   seconds of ``compare`` (best of ``--reps``; without and with ``source_column``) and of
   ``write_html`` (20 plots), in this one process.
2. **Detection matrix** on ``--matrix-rows`` rows of one N(70, 15) column: each shift kind applied
   to 100 %, 10 % or 2 % of the current rows, over ``--seeds`` seeds; a detector counts a hit when it
   crosses its default threshold (PSI > 0.2, KS p < 0.05, Wasserstein / σ > 0.1) or, for the unit
   detector, when it names the applied unit (any unit named for a non-unit shift is a false alarm,
   listed). "scale ×1.5" multiplies the values (the nearest known factor, mi→km ×1.609, is 7 % away).
3. **False alarms**: ``--resamples`` pairs of unchanged 20-column tables (1,000 and 20,000 rows),
   compared with the defaults and per source: how many tables, columns and unit changes alarmed.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from _common import print_table, write_result
from vatra.config import DriftConfig
from vatra.data.tables.drift import compare
from vatra.data.tables.drift_html import write_html

SHIFTS: dict[str, tuple[Callable[[np.ndarray], np.ndarray], str | None]] = {
    "mean +0.1σ": (lambda x: x + 1.5, None),
    "mean +0.5σ": (lambda x: x + 7.5, None),
    "scale ×1.5": (lambda x: x * 1.5, None),
    "unit ×100": (lambda x: x * 100.0, "×100"),
    "unit ×2.54": (lambda x: x * 2.54, "in→cm (×2.54)"),
    "°F→°C": (lambda x: (x - 32.0) * 5.0 / 9.0, "°F→°C"),
    "none": (lambda x: x, None),
}
FRACTIONS = (1.0, 0.1, 0.02)
DETECTORS = ("psi", "ks", "wasserstein", "unit")


def wide_table(rows: int, seed: int, *, changed: bool) -> pa.Table:
    rng = np.random.default_rng(seed)
    cols: dict[str, object] = {}
    for i in range(4):
        cols[f"normal{i}"] = rng.normal(50.0 + i, 10.0, rows)
        cols[f"lognormal{i}"] = rng.lognormal(1.0, 0.8, rows)
        cols[f"count{i}"] = rng.poisson(3.0 + i, rows)
    cols["uniform0"], cols["uniform1"] = rng.uniform(0.0, 1.0, rows), rng.uniform(-5.0, 5.0, rows)
    cols["flag"] = rng.random(rows) < 0.3
    for i, k in enumerate((4, 20, 100, 1000)):
        cols[f"cat{i}"] = pa.array(rng.integers(0, k, rows).astype(str)).dictionary_encode()
    cols["site"] = pa.array(rng.integers(0, 10, rows).astype(str))
    if changed:
        x = cols["normal0"]
        assert isinstance(x, np.ndarray)
        x[: rows // 50] *= 100.0
        cols["normal1"] = (np.asarray(cols["normal1"]) - 32.0) * 5.0 / 9.0
        cols["normal2"] = np.asarray(cols["normal2"]) + 5.0
        cols["cat0"] = pa.array(rng.choice(["0", "1", "2", "3", "new"], rows)).dictionary_encode()
    return pa.table(cols)


def speed(rows: int, reps: int) -> dict[str, Any]:
    reference, current = wide_table(rows, 0, changed=False), wide_table(rows, 1, changed=True)
    cfg = DriftConfig()
    compare(reference.slice(0, 1000), current.slice(0, 1000), cfg)  # scipy's import, outside the timing
    out: dict[str, Any] = {"rows": rows, "columns": reference.num_columns}
    for label, source in (("compare_s", ""), ("compare_by_source_s", "site")):
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            report = compare(reference, current, cfg, source_column=source)
            times.append(time.perf_counter() - t0)
        out[label] = min(times)
        out[f"{label}_all"] = times
        out[f"summary{'_by_source' if source else ''}"] = report.summary_line()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        page = write_html(report, reference, current, Path(tmp) / "drift.html", title="bench")
        out["write_html_s"] = time.perf_counter() - t0
        out["html_bytes"] = page.stat().st_size
    return out


def matrix(rows: int, seeds: int) -> list[dict[str, Any]]:
    cfg = DriftConfig()
    results = []
    for kind, (shift, unit) in SHIFTS.items():
        for fraction in FRACTIONS if kind != "none" else (1.0,):
            hits = dict.fromkeys(DETECTORS, 0)
            named: list[str] = []
            for seed in range(seeds):
                rng = np.random.default_rng(1000 + seed)
                reference, current = rng.normal(70.0, 15.0, rows), rng.normal(70.0, 15.0, rows)
                k = round(fraction * rows)
                current[:k] = shift(current[:k])
                col = compare(pa.table({"x": reference}), pa.table({"x": current}), cfg).columns[0]
                hits["psi"] += col.stats["psi"] > cfg.psi
                hits["ks"] += col.stats["ks_pvalue"] < cfg.ks_pvalue
                hits["wasserstein"] += col.stats["wasserstein"] > cfg.wasserstein
                found = [u.name for u in col.units]
                hits["unit"] += unit in found if unit else 0
                named += [n for n in found if n != unit]
            results.append(
                {
                    "shift": kind,
                    "fraction": fraction,
                    "seeds": seeds,
                    **hits,
                    "wrong_units": sorted(set(named)),
                }
            )
    return results


def false_alarms(resamples: int) -> list[dict[str, Any]]:
    """Unchanged tables: ``resamples`` pairs of the 20-column table from different seeds, compared
    with the defaults (``auto``: KS / chi² at 1,000 rows, Wasserstein / Jensen–Shannon at 20,000)
    and per source; a table alarms when any column drifted or changed units."""
    cfg = DriftConfig()
    out = []
    for rows in (1000, 20_000):
        tables = columns = units = 0
        for i in range(resamples):
            reference, current = (
                wide_table(rows, 10_000 + 2 * i, changed=False),
                wide_table(rows, 10_001 + 2 * i, changed=False),
            )
            report = compare(reference, current, cfg, source_column="site")
            tables += bool(report.drifted)
            columns += len(report.drifted)
            units += len(report.unit_changes)
        compared = resamples * (reference.num_columns - 1)
        out.append(
            {
                "rows": rows,
                "resamples": resamples,
                "tables_alarmed": tables,
                "columns_alarmed": columns,
                "columns_compared": compared,
                "unit_changes": units,
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--matrix-rows", type=int, default=100_000)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--resamples", type=int, default=100)
    args = parser.parse_args()
    t0 = time.perf_counter()

    fast = speed(args.rows, args.reps)
    print(f"{args.rows:,} × {fast['columns']} against {args.rows:,} × {fast['columns']}:")
    print_table(
        ["step", "seconds"],
        [
            ["compare", fast["compare_s"]],
            ["compare, source_column = site", fast["compare_by_source_s"]],
            ["write_html (20 plots)", fast["write_html_s"]],
        ],
    )
    print(fast["summary"])

    found = matrix(args.matrix_rows, args.seeds)
    print(f"\ndetections over {args.seeds} seeds, {args.matrix_rows:,} rows of N(70, 15):")
    rows = []
    for r in found:
        unit = f"{r['unit']}/{r['seeds']}" if SHIFTS[str(r["shift"])][1] else "-"
        wrong = ", ".join(r["wrong_units"]) or "-"
        rows.append(
            [
                r["shift"],
                f"{r['fraction']:.0%}",
                *(f"{r[d]}/{r['seeds']}" for d in DETECTORS[:3]),
                unit,
                wrong,
            ]
        )
    print_table(
        ["shift", "rows changed", "PSI", "KS", "Wasserstein", "unit named", "other units named"], rows
    )
    quiet = false_alarms(args.resamples)
    print(f"\nfalse alarms: {args.resamples} pairs of unchanged 20-column tables, defaults, per source:")
    print_table(
        ["rows", "tables alarmed", "columns alarmed", "unit changes named"],
        [
            [
                f"{q['rows']:,}",
                f"{q['tables_alarmed']}/{q['resamples']}",
                f"{q['columns_alarmed']}/{q['columns_compared']}",
                q["unit_changes"],
            ]
            for q in quiet
        ],
    )
    wall = time.perf_counter() - t0
    write_result(
        "table_drift",
        {
            "speed": fast,
            "matrix": found,
            "matrix_rows": args.matrix_rows,
            "false_alarms": quiet,
            "wall_s": wall,
            "args": vars(args),
        },
    )
    print(
        f"{wall:.0f} s (median compare of the speed runs: {statistics.median(fast['compare_s_all']):.2f} s)"
    )


if __name__ == "__main__":
    main()
