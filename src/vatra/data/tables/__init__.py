"""Versioned training tables on Delta Lake: ingest against a pinned schema, versions and their
differences, drift and unit-change detection.

Names are loaded on first use: importing this package (as ``data.name = "delta"`` does) loads
none of deltalake, pandera, pyarrow, scipy or matplotlib, so a missing extra is reported by the
function that needs it, in one line."""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "Ingested": "writer",
    "SchemaRefused": "delta",
    "Table": "delta",
    "TableError": "delta",
    "diff": "versions",
    "history": "versions",
    "ingest": "writer",
    "show": "versions",
    "ColumnDrift": "drift",
    "DriftReport": "drift",
    "UnitChange": "drift",
    "compare": "drift",
    "write_html": "drift_html",
    "TableSchema": "schema",
    "Violation": "schema",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'vatra.data.tables' has no attribute {name!r}")
    return getattr(importlib.import_module(f"vatra.data.tables.{_WHERE[name]}"), name)
