"""Versions of a Delta table: their history (what made each), a snapshot of one, and the exact
difference between two (rows added and removed, matched by content; each column's summary)."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from vatra._extras import require
from vatra.data.tables.delta import COMMIT_KEY, FEATURE, Table, file_order, read_version
from vatra.errors import VatraError

if TYPE_CHECKING:
    import pyarrow as pa


@dataclass(frozen=True)
class VersionInfo:
    version: int
    time: float  # seconds since the epoch
    operation: str
    rows_added: int | None
    rows: int | None  # rows in this version
    ingest: dict[str, Any] | None  # the vatra.ingest record, when vatra made the commit


def history(table: Table) -> list[VersionInfo]:
    """Every version, oldest first, with its row count and what made it."""
    pa = require("pyarrow", "tables", FEATURE)
    dt = table.open()
    out = []
    for h in sorted(dt.history(), key=lambda h: int(h["version"])):
        v = int(h["version"])
        metrics = h.get("operationMetrics") or {}
        raw = h.get(COMMIT_KEY)
        record = json.loads(raw) if isinstance(raw, str) else None
        try:
            snap = table.open(v)
            rows: int | None = int(
                pa.table(snap.get_add_actions(flatten=True)).column("num_records").to_numpy().sum()
            )
        except (VatraError, KeyError):
            rows = None  # a version whose files were vacuumed
        # an ingest that widened a column rewrote the earlier rows too: its record has the batch's
        added = (
            record["rows"] if isinstance(record, dict) and "rows" in record else metrics.get("num_added_rows")
        )
        out.append(
            VersionInfo(
                v,
                float(h.get("timestamp", 0)) / 1000.0,
                str(h.get("operation", "")),
                None if added is None else int(added),
                rows,
                record,
            )
        )
    return out


@dataclass
class Snapshot:
    version: int
    rows: int
    schema: pa.Schema
    schema_hash: str | None
    head: pa.Table


def show(table: Table, version: int | None = None, limit: int = 10) -> Snapshot:
    dt = table.open(version)
    data = read_version(dt)
    pinned = table.schema()
    return Snapshot(
        int(dt.version()), data.num_rows, data.schema, pinned.hash if pinned else None, data.slice(0, limit)
    )


@dataclass
class ColumnChange:
    column: str
    before: dict[str, Any]
    after: dict[str, Any]


@dataclass
class Diff:
    v1: int
    v2: int
    rows_v1: int
    rows_v2: int
    added: int
    removed: int
    columns_added: list[str]
    columns_removed: list[str]
    changes: list[ColumnChange]


def _row_hashes(t: pa.Table) -> np.ndarray:
    pd = require("pandas", "delta", FEATURE)
    if t.num_rows == 0:
        return np.zeros(0, dtype=np.uint64)
    return np.asarray(pd.util.hash_pandas_object(t.to_pandas(), index=False).to_numpy(), dtype=np.uint64)


def _multiset_minus(a: np.ndarray, b: np.ndarray) -> int:
    """How many items of ``a`` are left after taking away ``b`` (both multisets of hashes)."""
    ua, ca = np.unique(a, return_counts=True)
    ub, cb = np.unique(b, return_counts=True)
    _, ia, ib = np.intersect1d(ua, ub, return_indices=True)
    left = ca.copy()
    left[ia] = np.maximum(ca[ia] - cb[ib], 0)
    return int(left.sum())


def column_summary(col: Any) -> dict[str, Any]:
    """Count, nulls, and mean/std/min/max (numbers) or distinct values and the top three (others)."""
    pa = require("pyarrow", "tables", FEATURE)
    import pyarrow.compute as pc

    out: dict[str, Any] = {"rows": len(col), "nulls": col.null_count}
    t = col.type
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t):
        vals = pc.cast(col, pa.float64()).to_numpy(zero_copy_only=False)
        vals = vals[~np.isnan(vals)]
        if len(vals):
            out.update(
                mean=float(vals.mean()), std=float(vals.std()), min=float(vals.min()), max=float(vals.max())
            )
        return out
    counts = pc.value_counts(col.drop_null() if hasattr(col, "drop_null") else col)
    pairs = sorted(((c["counts"].as_py(), str(c["values"].as_py())) for c in counts), reverse=True)
    out.update(distinct=len(pairs), top=[f"{v} ({n})" for n, v in pairs[:3]])
    return out


def _as_types(t: pa.Table, schema: pa.Schema) -> pa.Table:
    """``t`` with each column that ``schema`` gives another type cast to it where that is exact."""
    pa = require("pyarrow", "tables", FEATURE)
    cols = []
    for name, col in zip(t.column_names, t.columns, strict=True):
        if name in schema.names and col.type != schema.field(name).type:
            with contextlib.suppress(pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
                col = col.cast(schema.field(name).type, safe=True)  # else the rows differ
        cols.append(col)
    return pa.table(cols, names=t.column_names)


def diff(table: Table, v1: int, v2: int) -> Diff:
    """Rows added and removed from ``v1`` to ``v2`` (exact: rows of rewritten files are matched by
    content) and each column's summary at both versions."""
    d1, d2 = table.open(v1), table.open(v2)
    f1, f2 = set(file_order(d1)), set(file_order(d2))
    only1 = read_version(d1, only=f1 - f2) if f1 - f2 else None
    only2 = read_version(d2, only=f2 - f1) if f2 - f1 else None
    if only1 is not None and only2 is not None:  # a widened column: 1 and 1.0 are the same row
        only1 = _as_types(only1, only2.schema)
    h1 = _row_hashes(only1) if only1 is not None else np.zeros(0, dtype=np.uint64)
    h2 = _row_hashes(only2) if only2 is not None else np.zeros(0, dtype=np.uint64)
    t1, t2 = read_version(d1), read_version(d2)
    changes = [
        ColumnChange(c, column_summary(t1.column(c)), column_summary(t2.column(c)))
        for c in t2.column_names
        if c in t1.column_names
    ]
    return Diff(
        int(d1.version()),
        int(d2.version()),
        t1.num_rows,
        t2.num_rows,
        _multiset_minus(h2, h1),
        _multiset_minus(h1, h2),
        [c for c in t2.column_names if c not in t1.column_names],
        [c for c in t1.column_names if c not in t2.column_names],
        changes,
    )
