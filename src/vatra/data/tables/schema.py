"""The schema pinned beside a Delta table: a pandera ``DataFrameSchema`` inferred from the first
ingest, stored as YAML a person can edit, checked lazily on every later ingest.

Inference (:meth:`TableSchema.infer`, per column of the first Arrow table):

- **dtype**: integers → ``Int64`` (``UInt64`` for ``uint64``), floats → ``float64``, booleans →
  ``boolean``, strings and dictionary-encoded strings → ``str``, timestamps → ``datetime64[ns]``
  (``datetime64[ns, <tz>]`` when zoned). Other Arrow types (dates, decimals, binary, nested) are
  pinned by presence and nullability only. ``coerce`` stays false: a column that arrives with
  another type is a dtype violation, never silently cast — except for lossless widenings, which
  are accepted and cast to the pinned type (:meth:`TableSchema.conform`): an integer where a
  float is pinned (a later CSV whose prices all look whole reads as integers; exact up to 2⁵³,
  beyond that a violation), narrower integers or floats where wider ones are pinned, another
  unit of a timestamp or another zone of a zoned one (naive ↔ zoned is a violation), plain, large
  or dictionary-encoded strings, and an all-null column for any dtype. A float where an integer
  is pinned is a violation (the fraction would be lost).
- **nullable**: the first data had nulls (NaN counts as null in a float column, as in pandas).
- **range** (numbers, not booleans or timestamps): the observed ``[min, max]`` widened by
  ``range_margin`` × span on each side (× ``|value|`` for a constant column), never across zero
  (data all ≥ 0 keep a lower bound ≥ 0: a count never goes negative), then rounded outward to two
  significant digits of the width. A float column holding ±inf gets no range.
- **categories**: a string (plain or dictionary) or boolean column with at most
  ``max_categories`` distinct values gets ``isin``; with more (ids, free text) only its dtype.
- **strict**: a column the schema does not name is a violation (``column_in_schema``), so is a
  named column the batch lacks (``column_in_dataframe``) unless its ``required`` is false.

Validation converts the Arrow table to pandas column by column (zero-copy for floats without
nulls) and runs pandera with ``lazy=True``, so every failure of every column comes back at once as
:class:`Violation` rows grouped by (column, check). Evolution is explicit:
:meth:`TableSchema.updated` returns the schema that also accepts a batch and one line per change.
pandera and pandas are imported on first use: importing this module stays cheap.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vatra._extras import require
from vatra.data.tables._column_rules import (
    FEATURE,
    accepts,
    arrow_type_of,
    compute,
    decoded,
    infer_column,
    kind_of,
    nullable_pandas,
    numeric_stats,
    pandera_pandas,
    widened_bounds,
)
from vatra.errors import ConfigError

if TYPE_CHECKING:
    import pyarrow as pa

SCHEMA_FILE = "schema.yaml"
_HEADER = (
    "# The schema vatra pinned for this table (a pandera DataFrameSchema). Ingests that break it are\n"
    "# refused. Edit bounds, categories, nullable or dtypes here (any pandera check works), or\n"
    "# let `vatra data schema update` widen it to accept a new batch.\n"
)
# pandera's checks of the column set: their failure case is the column's name, not a value
_COLUMN_LEVEL = ("column_in_schema", "column_in_dataframe")


@dataclass(frozen=True)
class Violation:
    """One check a batch fails on one column, with how many rows fail it and a few of their values."""

    column: str
    check: str  # pandera's name: "dtype('float64')", "in_range(0, 120)", "isin([...])", "not_nullable", ...
    failures: int  # failing rows; 1 for a column-level check (dtype, missing or extra column)
    examples: tuple[str, ...]  # up to 3 distinct failing values as text; the dtype found for a dtype check


def _io() -> Any:
    require("yaml", "delta", FEATURE)
    return require("pandera.io.pandas_io", "delta", FEATURE)


def _canonical(value: Any) -> Any:
    """The serialized schema with order-free lists sorted and integral floats as ints, for hashing."""
    if isinstance(value, dict):
        out = {k: _canonical(v) for k, v in value.items() if k != "version"}
        for key in ("isin", "notin", "allowed_values", "forbidden_values"):
            if isinstance(out.get(key), list):
                out[key] = sorted(out[key], key=lambda v: (type(v).__name__, repr(v)))
        return out
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= 300 else text[:297] + "..."


def _unknown(key: str, known: Iterable[str], where: str, source: str) -> ConfigError:
    close = difflib.get_close_matches(key, list(known), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(
        f"{source}: unknown key {key!r} {where}{hint}; fix the file or delete the key "
        "(keys are pandera schema options, column options or check names)"
    )


def _check_keys(doc: Any, source: str) -> None:
    """Refuse keys pandera would silently drop (``nulable: true``, ``strcit: true``): a typo there
    would otherwise loosen the schema without a word."""
    import inspect

    pio = _io()
    pandera = pandera_pandas()
    Check = pandera.Check
    options = {*inspect.signature(pandera.Column.__init__).parameters, "checks"} - {"self"}
    if not isinstance(doc, dict):
        found = "an empty file" if doc is None else f"a {type(doc).__name__}"
        raise ConfigError(f"{source}: expected a mapping with a 'columns' key, found {found}; fix the file")
    top = set(pio.serialize_schema(pandera.DataFrameSchema(), minimal=False)) | {
        "metadata",
        "multiindex",
        "dataframe_library",
    }
    for key in doc:
        if key not in top:
            raise _unknown(str(key), top, "at the top level", source)
    if doc.get("schema_type", "dataframe") != "dataframe":
        raise ConfigError(f"{source}: schema_type must be 'dataframe', found {doc['schema_type']!r}")
    columns = doc.get("columns")
    if not isinstance(columns, dict) or not columns:
        raise ConfigError(f"{source}: 'columns' must map each column name to its options")
    checks = [n for n in dir(Check) if not n.startswith("_") and callable(getattr(Check, n))]
    for name, spec in columns.items():
        if spec is None:
            continue
        if not isinstance(spec, dict):
            raise ConfigError(f"{source}: column {name!r} must be a mapping of options, found {spec!r}")
        for key in spec:
            if key not in options and not callable(getattr(Check, str(key), None)):
                raise _unknown(str(key), [*options, *checks], f"in column {name!r}", source)


def _check_label(check: Any) -> str:
    """pandera's name for a check in its failure cases (``in_range(0, 120)``, ``not_nullable``)."""
    if isinstance(check, str):
        return check
    return str(check.error or check.name or check)


def _text(value: Any) -> str:
    return "null" if value is None or (isinstance(value, float) and math.isnan(value)) else str(value)


class TableSchema:
    """A pandera DataFrameSchema pinned beside a table, user-editable as YAML."""

    def __init__(self, schema: Any) -> None:
        self.pandera_schema = schema  # pandera.pandas.DataFrameSchema

    @classmethod
    def infer(cls, table: pa.Table, *, max_categories: int = 50, range_margin: float = 0.25) -> TableSchema:
        """The schema the first ``table`` of a Delta table pins (rules: the module docstring)."""
        pandera = pandera_pandas()
        columns = {
            name: infer_column(table.column(i), max_categories, range_margin)
            for i, name in enumerate(table.column_names)
        }
        return cls(pandera.DataFrameSchema(columns, strict=True, coerce=False))

    @classmethod
    def from_yaml(cls, text: str, *, source: str = SCHEMA_FILE) -> TableSchema:
        """Parse a (possibly hand-edited) schema file; :class:`ConfigError` names what is wrong in it,
        ``source`` (the file's path) first."""
        yaml = require("yaml", "delta", FEATURE)
        pio = _io()
        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(err, "problem", None) or _one_line(err)
            raise ConfigError(f"{source}: not valid YAML{where}: {problem}; fix the file") from None
        _check_keys(doc, source)
        try:
            return cls(pio.deserialize_schema(doc))
        except Exception as err:  # pandera raises TypeError, ValueError, AttributeError, its own errors
            for name, spec in doc["columns"].items():  # name the column that breaks, if one does
                try:
                    pio.deserialize_schema({"columns": {name: spec}})
                except Exception as col_err:
                    raise ConfigError(
                        f"{source}: column {name!r}: {_one_line(col_err)}; fix the file"
                    ) from None
            raise ConfigError(f"{source}: {_one_line(err)}; fix the file") from None

    def to_yaml(self) -> str:
        """pandera's YAML for the schema, under a comment saying how to edit it."""
        return _HEADER + str(_io().to_yaml(self.pandera_schema))

    @property
    def hash(self) -> str:
        """sha256 of the schema's canonical form: equal schemas hash equal, whatever the YAML layout."""
        doc = _canonical(_io().serialize_schema(self.pandera_schema))
        return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()

    @property
    def columns(self) -> list[str]:
        return [str(c) for c in self.pandera_schema.columns]

    def conform(self, table: pa.Table) -> pa.Table:
        """``table`` with each accepted widening (module docstring) cast to the pinned Arrow type, so
        the batch can be written beside the earlier ones; other columns are left as they are."""
        import pyarrow as pa

        columns = [self._conformed(name, table.column(i)) for i, name in enumerate(table.column_names)]
        return pa.table(columns, names=table.column_names)

    def _conformed(self, name: str, col: Any) -> Any:
        import pyarrow as pa

        pinned = self.pandera_schema.columns.get(name)
        if pinned is None or pinned.dtype is None:
            return col
        dst = arrow_type_of(pinned.dtype.type)
        src = col.type
        if src == dst or not accepts(src, dst):
            return col
        if kind_of(src) == "string":
            return decoded(col)  # string and large_string both convert to pandas' str
        try:
            return col.cast(dst, safe=True)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            return col  # overflow or lost precision: pandera reports the dtype

    def _frame(self, table: pa.Table) -> Any:
        """The pandas frame pandera checks: pinned columns in their pinned pandas dtype (nullable ints
        and booleans), zero-copy where Arrow allows."""
        import pandas as pd

        series = {}
        for i, name in enumerate(table.column_names):
            col = self._conformed(name, table.column(i))
            pinned = self.pandera_schema.columns.get(name)
            want = pinned.dtype.type if pinned is not None and pinned.dtype is not None else None
            nullable = want if isinstance(want, pd.api.extensions.ExtensionDtype) else None
            target = None if want is None else arrow_type_of(want)  # the type a conformed column has

            def mapper(t: Any, nullable: Any = nullable, target: Any = target) -> Any:
                return nullable if nullable is not None and t == target else nullable_pandas(t)

            series[name] = col.to_pandas(types_mapper=mapper)
        return pd.DataFrame(series, copy=False)

    def validate(self, table: pa.Table) -> list[Violation]:
        """Every violation of every column of ``table`` (pandera, lazy); ``[]`` when it is valid."""
        pandera = pandera_pandas()
        frame = self._frame(table)
        try:
            self.pandera_schema.validate(frame, lazy=True, inplace=True)
        except pandera.errors.SchemaErrors as err:
            return self._violations(err.schema_errors, frame, table.column_names)
        return []

    def _violations(self, errors: list[Any], frame: Any, names: list[str]) -> list[Violation]:
        """pandera's schema errors as Violations, one per (column, check), in column order."""
        from pandera.errors import SchemaErrorReason as Reason

        found: dict[tuple[str, str], Violation] = {}
        wrong_type = {str(e.schema.name) for e in errors if e.reason_code == Reason.WRONG_DATATYPE}
        for e in errors:
            label = _check_label(e.check)
            examples: tuple[str, ...] = ()
            if label in _COLUMN_LEVEL:
                column, failures = str(e.failure_cases), 1
            else:
                column = str(e.schema.name)
                if e.reason_code == Reason.WRONG_DATATYPE:
                    failures, examples = 1, (str(frame[column].dtype),)
                elif e.reason_code == Reason.CHECK_ERROR:
                    if column in wrong_type:
                        continue
                    failures, examples = 1, (_one_line(e.failure_cases),)
                else:
                    cases = e.failure_cases["failure_case"]
                    failures = len(cases)
                    shown = [] if label == "not_nullable" else cases.drop_duplicates().head(3)
                    examples = tuple(_text(v) for v in shown)
            # the same check twice on one column (a hand edit) is one violation
            found.setdefault((column, label), Violation(column, label, failures, examples))
        order: dict[str, int] = {}
        for c in [*self.columns, *names]:
            order.setdefault(c, len(order))
        rank = {"column_in_schema": 0, "column_in_dataframe": 0, "not_nullable": 2}
        return sorted(
            found.values(),
            key=lambda v: (
                order.get(v.column, len(order)),
                rank.get(v.check, 1 if v.check[:6] == "dtype(" else 3),
            ),
        )

    def updated(
        self,
        table: pa.Table,
        *,
        add_columns: bool = True,
        widen: bool = True,
        categories: bool = True,
        max_categories: int = 50,
        range_margin: float = 0.25,
    ) -> tuple[TableSchema, list[str]]:
        """The schema that accepts ``table`` as well, and one line per change made.

        ``add_columns``: new columns are inferred and added, missing ones become ``required: false``.
        ``widen``: an integer column that receives floats becomes ``float64``, a column that receives
        nulls becomes nullable, a range grows (on the side the batch broke) to take the new values
        with ``range_margin`` (a range is an ``in_range`` check; hand-written ``ge``/``le`` checks are
        left alone). ``categories``: new values join ``isin``, or the check is dropped when
        that makes more than ``max_categories``. Anything else (a float column that now holds text)
        stays a violation: edit the file by hand if the change is intended.
        """
        schema, changes = self.pandera_schema, []
        names = table.column_names
        for name, pinned in self.pandera_schema.columns.items():
            if name not in names:
                if add_columns and pinned.required:
                    schema = schema.update_column(name, required=False)
                    changes.append(f"column {name}: no longer required (absent from this batch)")
                continue
            col = decoded(self._conformed(name, table.column(names.index(name))))
            update, notes = self._widened(pinned, col, widen, categories, max_categories, range_margin)
            if update:
                schema = schema.update_column(name, **update)
                changes.extend(f"column {name}: {note}" for note in notes)
        if add_columns:
            new = {
                name: infer_column(table.column(i), max_categories, range_margin)
                for i, name in enumerate(names)
                if name not in self.pandera_schema.columns
            }
            for name, column in new.items():
                dtype = "any dtype" if column.dtype is None else str(column.dtype)
                changes.append(f"new column {name} ({dtype}{', nullable' if column.nullable else ''})")
            if new:
                schema = schema.add_columns(new)
        return TableSchema(schema), changes

    @staticmethod
    def _widened(
        pinned: Any, col: Any, widen: bool, categories: bool, max_categories: int, range_margin: float
    ) -> tuple[dict[str, Any], list[str]]:
        """The ``update_column`` arguments that make ``pinned`` accept ``col``, and what they change."""
        pandera = pandera_pandas()
        update: dict[str, Any] = {}
        notes: list[str] = []
        kind = kind_of(col.type)
        pinned_kind = None if pinned.dtype is None else kind_of(arrow_type_of(pinned.dtype.type))
        numeric = kind in ("int", "float")
        nulls, observed, _ = numeric_stats(col) if numeric else (col.null_count, None, False)
        if widen and pinned_kind == "int" and kind == "float":
            update["dtype"] = "float64"
            notes.append(f"dtype widened from {pinned.dtype} to float64")
        if widen and nulls and not pinned.nullable:
            update["nullable"] = True
            notes.append("now nullable")
        checks, changed = [], False
        for check in pinned.checks:
            stats = check.statistics or {}
            if check.name == "in_range" and widen and observed is not None:
                (lo, hi), a, b = observed, stats["min_value"], stats["max_value"]
                if lo < a or hi > b:
                    wa, wb = widened_bounds(
                        min(a, lo), max(b, hi), range_margin, integer=kind == pinned_kind == "int"
                    )
                    a, b = (wa if lo < a else a), (wb if hi > b else b)
                    check = pandera.Check.in_range(
                        a, b, include_min=stats["include_min"], include_max=stats["include_max"]
                    )
                    changed = True
                    notes.append(f"range widened to [{a}, {b}]")
            elif check.name == "isin" and categories and kind in ("bool", "string"):
                allowed = list(stats["allowed_values"])
                new = [v for v in compute().unique(col.drop_null()).to_pylist() if v not in set(allowed)]
                if new:
                    changed = True
                    if len(allowed) + len(new) > max_categories:
                        notes.append(f"over {max_categories} categories, category check dropped")
                        continue
                    check = pandera.Check.isin(sorted(allowed + new))
                    shown = ", ".join(repr(v) for v in sorted(new))
                    notes.append(f"new categor{'ies' if len(new) > 1 else 'y'} {shown}")
            checks.append(check)
        if changed:
            update["checks"] = checks
        return update, notes


_RANGE = re.compile(r"in_range\((.*), (.*)\)")


def _phrase(v: Violation, rows: int) -> str:
    """What ``v`` means, in a few words for the summary line."""
    n = f"{v.failures:,} of {rows:,} row{'s' if rows != 1 else ''}"
    eg = f" ({', '.join(v.examples)})" if v.examples else ""
    if v.check == "column_in_schema":
        return "not in the pinned schema"
    if v.check == "column_in_dataframe":
        return "missing"
    if v.check.startswith("dtype("):
        return f"dtype {v.check[7:-2]} expected, got {v.examples[0] if v.examples else 'another'}"
    if v.check == "not_nullable":
        return f"{n} null"
    if match := _RANGE.fullmatch(v.check):
        return f"{n} out of range [{match[1]}, {match[2]}]{eg}"
    if v.check.startswith("isin("):
        return f"{n} not in the pinned categories{eg}"
    return f"{n} fail {v.check}{eg}"


def summary_line(violations: list[Violation], rows: int) -> str:
    """ONE line naming every column that breaks the schema and how: the refusal message of an ingest."""
    if not violations:
        return f"all {rows:,} rows match the pinned schema"
    by_column: dict[str, list[str]] = {}
    for v in violations:
        by_column.setdefault(v.column, []).append(_phrase(v, rows))
    parts = "; ".join(f"{c}: {', '.join(p)}" for c, p in by_column.items())
    k = len(by_column)
    return f"{k} column{'s' if k != 1 else ''} break{'' if k != 1 else 's'} the pinned schema ({parts})"


def report_lines(violations: list[Violation]) -> list[str]:
    """One aligned line per failing (column, check): the check, how many rows fail, examples."""
    if not violations:
        return []
    width = max(len(v.column) for v in violations)
    check_width = min(40, max(len(v.check) for v in violations))
    lines = []
    for v in violations:
        if v.check.startswith("dtype("):
            what = f"got {v.examples[0]}" if v.examples else "wrong dtype"
        elif v.check in _COLUMN_LEVEL:
            what = "column"
        else:
            what = f"{v.failures:,} row{'s' if v.failures != 1 else ''}"
            if v.examples:
                what += f", e.g. {', '.join(v.examples)}"
        lines.append(f"{v.column:<{width}}  {v.check:<{check_width}}  {what}")
    return lines
