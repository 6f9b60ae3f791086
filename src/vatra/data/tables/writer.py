"""Ingest: files checked against the pinned schema and committed to the table as one version, with
every value stored exactly as it was read.

Each column is written as its *target* type: the pinned dtype where that widens what the table
holds (an integer column whose schema ``vatra data schema update`` widened to float64, narrow
integers where ``Int64`` is pinned, a column that was all null until now), else the type the table
already has (the batch's own type for a new table or a new column). When a target differs from the
table's type, the commit rewrites the table's rows in the wider type and appends the batch, in one
overwrite commit: delta-rs has no in-place type change, and its ``schema_mode="merge"`` would cast
1.5 to 1 without a word. Earlier versions keep their own files and types. A rewrite costs one pass
over the table's rows (read and written once), and only happens on such a widening.

A batch value that its target type cannot hold exactly (a fraction where the table holds integers
and the schema allows any type, text in a number column after a hand edit) refuses the ingest with
one line naming the column, file, row and value; nothing is written. With ``--force`` it is stored
as null instead, counted per column and recorded in the commit and in ``_vatra/events.jsonl``.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vatra._extras import require
from vatra.data.tables.delta import (
    COMMIT_KEY,
    FEATURE,
    META_DIR,
    SCHEMA_FILE,
    SchemaRefused,
    Table,
    TableError,
    _deltalake,
    _one_line,
    arrow_schema,
    concat,
    read_file,
    read_version,
)
from vatra.errors import ConfigError

if TYPE_CHECKING:
    import pyarrow as pa

    from vatra.data.tables.schema import TableSchema, Violation


@dataclass
class Ingested:
    """What one ingest did."""

    version: int
    rows: int
    files: list[dict[str, Any]]
    schema_created: bool
    schema_hash: str
    forced: bool = False
    violations: list[str] = field(default_factory=list)
    nulled: dict[str, int] = field(default_factory=dict)  # forced only: values stored as null
    widened: dict[str, str] = field(default_factory=dict)  # column: "int64 → double"


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _cast_errors() -> tuple[type[Exception], ...]:
    pa = require("pyarrow", "tables", FEATURE)
    return (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError)


def _plain(t: pa.DataType) -> pa.DataType:
    """A dictionary type as its values' type (Delta stores the values)."""
    pa = require("pyarrow", "tables", FEATURE)
    return t.value_type if pa.types.is_dictionary(t) else t


def widens(held: pa.DataType, to: pa.DataType) -> bool:
    """Whether every value of a column of type ``held`` has an exact value in ``to``, a wider type
    (an integer past 2⁵³, which float64 cannot hold, is caught when the rows are cast)."""
    pa = require("pyarrow", "tables", FEATURE)
    types = pa.types
    if types.is_null(held):
        return not types.is_null(to)
    if types.is_integer(held) and types.is_integer(to):
        signs = types.is_signed_integer(to) or types.is_unsigned_integer(held)
        return signs and to.bit_width > held.bit_width
    if types.is_integer(held):
        return bool(to == pa.float64())
    if types.is_floating(held):
        return types.is_floating(to) and to.bit_width > held.bit_width
    return False


def storable(name: str, t: pa.DataType) -> pa.DataType:
    """The Arrow type that a Delta table holds ``t``'s values in exactly: unsigned integers as the
    next wider signed type (``uint64`` as ``int64``: a value past 2⁶³ is refused when cast),
    timestamps in microseconds (delta-rs would drop nanoseconds silently: they are refused instead),
    anything else as it is. A type Delta has no column for (times of day, durations, float16) is a
    one-line refusal."""
    pa = require("pyarrow", "tables", FEATURE)
    types = pa.types
    if types.is_unsigned_integer(t):
        return {8: pa.int16(), 16: pa.int32()}.get(t.bit_width, pa.int64())
    if types.is_timestamp(t):
        return pa.timestamp("us", t.tz)
    try:
        _deltalake().Schema.from_arrow(pa.schema([pa.field(name, t)]))
    except Exception:  # delta-rs raises a bare Exception for a type it cannot hold
        raise ConfigError(
            f"column {name} is {t}, which a Delta table cannot hold; convert it before the ingest "
            "(e.g. to a string, or to a number of seconds)"
        ) from None
    return t


def target_schema(held: pa.Schema | None, batch: pa.Schema, pinned: TableSchema) -> pa.Schema:
    """The type each column is written as: the table's (or for a new column, the batch's), widened
    to the pinned dtype where :func:`widens` allows; a column still all null takes the batch's."""
    pa = require("pyarrow", "tables", FEATURE)
    from vatra.data.tables._column_rules import arrow_type_of

    names = list(held.names) if held is not None else []
    names += [n for n in batch.names if n not in names]
    fields = []
    for name in names:
        base = held.field(name).type if held is not None and name in held.names else None
        if (base is None or pa.types.is_null(base)) and name in batch.names:
            base = _plain(batch.field(name).type)
        column = pinned.pandera_schema.columns.get(name)
        if column is not None and column.dtype is not None:
            want = arrow_type_of(column.dtype.type)
            if widens(base, want):
                base = want
        fields.append(pa.field(name, storable(name, base)))
    return pa.schema(fields)


def _exact(col: Any, to: pa.DataType) -> tuple[Any, int, tuple[int, Any] | None]:
    """``col`` as ``to`` with a null wherever a value does not cast exactly: (column, values lost,
    the first lost (row index, value) or None)."""
    pa = require("pyarrow", "tables", FEATURE)
    if col.type == to:
        return col, 0, None
    errors = _cast_errors()
    col = col.cast(_plain(col.type))  # dictionary-encoded: its values, exactly
    try:
        return col.cast(to, safe=True), 0, None
    except errors:
        pass
    out: list[Any] = []
    lost, first = 0, None
    for i, v in enumerate(col.to_pylist()):  # the slow path: only when some value does not fit
        cast = None
        if v is not None:
            try:
                cast = pa.array([v], type=col.type).cast(to, safe=True)[0].as_py()
            except errors:
                cast = None
            if cast is None:
                lost += 1
                first = first or (i, v)
        out.append(cast)
    return pa.array(out, type=to), lost, first


def conform(batch: pa.Table, target: pa.Schema, *, name: str, force: bool) -> tuple[pa.Table, dict[str, int]]:
    """``batch`` (one file, called ``name``) with exactly the ``target`` columns and types: a missing
    column is all null, a value that does not cast exactly refuses the ingest (:class:`ConfigError`)
    unless ``force``, which stores it as null and counts it: (table, values made null per column)."""
    pa = require("pyarrow", "tables", FEATURE)
    nulled: dict[str, int] = {}
    cols: list[Any] = []
    for fld in target:
        if fld.name not in batch.column_names:
            cols.append(pa.nulls(batch.num_rows, fld.type))
            continue
        col, lost, first = _exact(batch.column(fld.name), fld.type)
        if first is not None and not force:
            row, value = first
            raise ConfigError(
                f"{name}: column {fld.name}, row {row + 1}: {value!r} cannot be stored exactly in the "
                f"table's {fld.type} column ({lost} such value(s)); nothing was written. Fix the file, "
                "or ingest it with --force to store such values as null (counted and recorded)"
            )
        if lost:
            nulled[fld.name] = lost
        cols.append(col)
    return pa.Table.from_arrays(cols, schema=target), nulled


def _widen_rows(table: Table, dt: Any, target: pa.Schema) -> pa.Table:
    """The table's current rows in the ``target`` types (a new column all null). An old value with
    no exact value in the wider type refuses the ingest, even with --force: old rows are kept."""
    pa = require("pyarrow", "tables", FEATURE)
    held = read_version(dt)
    cols = []
    for fld in target:
        if fld.name not in held.column_names:
            cols.append(pa.nulls(held.num_rows, fld.type))
            continue
        col, _, first = _exact(held.column(fld.name), fld.type)
        if first is not None:
            raise ConfigError(
                f"{table.uri}: column {fld.name} cannot be widened to {fld.type}: version {dt.version()} "
                f"holds {first[1]!r}, which it cannot hold exactly; nothing was written. Put the dtype "
                f"in {table.uri}/{META_DIR}/{SCHEMA_FILE} back to what the table holds"
            )
        cols.append(col)
    return pa.Table.from_arrays(cols, schema=target)


def ingest(
    table: Table,
    files: Sequence[str],
    *,
    force: bool = False,
    max_categories: int = 50,
    range_margin: float = 0.25,
) -> Ingested:
    """Append ``files`` (CSV / Parquet) to ``table`` as one commit, validated against the pinned schema.

    The first ingest infers the schema from the files' rows (unless the user already put one at
    ``_vatra/schema.yaml``; files without rows are refused then) and pins it. Every later ingest is
    validated lazily, all violations of all files collected; any violation refuses the whole ingest
    (:class:`SchemaRefused`, nothing written) unless ``force``, which accepts it and records the
    violations in the commit and in ``_vatra/events.jsonl``. Values are stored exactly (module
    docstring).
    """
    dl = _deltalake()
    pa = require("pyarrow", "tables", FEATURE)
    from vatra.data.tables.schema import TableSchema, report_lines, summary_line

    if not files:
        raise ConfigError("vatra data ingest: name at least one CSV or Parquet file")
    if max_categories < 0:
        raise ConfigError(f"--max-categories {max_categories}: must be a count ≥ 0 (default 50)")
    if not 0 <= range_margin < math.inf:  # NaN fails too
        raise ConfigError(
            f"--range-margin {range_margin}: must be a finite share ≥ 0 of each value range (default 0.25)"
        )
    missing = [f for f in files if not Path(f).exists()]
    if missing:
        raise ConfigError(f"vatra data ingest: no such file: {missing[0]}")
    batches = [read_file(f) for f in files]
    records = [
        {"name": Path(f).name, "sha256": _sha256(f), "rows": b.num_rows}
        for f, b in zip(files, batches, strict=True)
    ]
    rows = sum(b.num_rows for b in batches)
    exists = table.exists()
    schema = table.schema()
    created = schema is None
    if schema is None:
        if exists:
            raise ConfigError(
                f"{table.uri}: a Delta table without a pinned schema ({META_DIR}/{SCHEMA_FILE}); "
                f"pin one from its rows with: vatra data schema update {table.uri}"
            )
        if rows == 0:
            raise ConfigError(
                f"vatra data ingest: {', '.join(map(str, files))}: no rows, only a header; the first ingest "
                "pins the table's schema (types, ranges, categories) from its rows: ingest a file with "
                f"rows first, or write the schema yourself at {table.uri}/{META_DIR}/{SCHEMA_FILE}"
            )
        schema = TableSchema.infer(concat(batches), max_categories=max_categories, range_margin=range_margin)
    violations: list[Violation] = []
    for f, b in zip(files, batches, strict=True):
        violations.extend(_in_file(v, f, len(files)) for v in schema.validate(b))
    if violations and not force:
        raise SchemaRefused(
            f"{summary_line(violations, rows)}; nothing was written. Fix the file(s), accept them with "
            "--force, or change the schema with: vatra data schema update",
            report_lines(violations),
        )
    dt = table.open() if exists else None
    held = arrow_schema(dt) if dt is not None else None
    target = target_schema(held, concat(batches).schema, schema)
    nulled: dict[str, int] = {}
    parts = []
    for f, b in zip(files, batches, strict=True):
        part, lost = conform(b, target, name=Path(f).name, force=force)
        parts.append(part)
        for column, n in lost.items():
            nulled[column] = nulled.get(column, 0) + n
    widened = {
        f.name: f"{f.type} → {target.field(f.name).type}"
        for f in (held or [])
        if f.type != target.field(f.name).type
    }
    if dt is not None and widened:
        parts.insert(0, _widen_rows(table, dt, target))
    data = pa.concat_tables(parts).combine_chunks()  # one chunk: delta-rs keeps the row order
    lines = report_lines(violations)
    meta = {
        "files": records,
        "rows": rows,
        "schema_hash": schema.hash,
        "forced": bool(violations),
        "violations": lines,
        "nulled": nulled,
        "widened": widened,
    }
    if created:
        table.pin_schema(schema)
    extra = held is not None and bool(set(target.names) - set(held.names))
    try:
        dl.write_deltalake(
            dt if dt is not None else table.uri,
            data,
            mode="overwrite" if widened else "append",
            schema_mode="overwrite" if widened else "merge" if extra else None,
            storage_options=table.delta_options or None,
            commit_properties=dl.CommitProperties(custom_metadata={COMMIT_KEY: json.dumps(meta)}),
        )
    except (OSError, pa.ArrowInvalid, dl.exceptions.DeltaError) as err:
        raise TableError(f"{table.uri}: the ingest was not committed: {_one_line(err)}") from None
    version = table.latest()
    if created:
        table.log_event("schema_pinned", version=version, schema_hash=schema.hash, inferred=True)
    if widened:
        table.log_event("column_widened", version=version, columns=widened)
    if violations:
        table.log_event(
            "forced_ingest",
            version=version,
            files=[r["name"] for r in records],
            violations=lines,
            nulled=nulled,
        )
    return Ingested(version, rows, records, created, schema.hash, bool(violations), lines, nulled, widened)


def _in_file(v: Violation, path: str, n_files: int) -> Violation:
    """The violation, naming its file when several were ingested together."""
    return v if n_files == 1 else replace(v, check=f"{v.check} in {Path(path).name}")
