"""How one Arrow column maps to a pinned pandera column: its kind, the widenings accepted without a
violation, and the inference rules (documented in :mod:`vatra.data.tables.schema`)."""

from __future__ import annotations

import math
from functools import cache
from typing import TYPE_CHECKING, Any

from vatra._extras import require

if TYPE_CHECKING:
    import pyarrow as pa

FEATURE = "a table's pinned schema"


def pandera_pandas() -> Any:
    """``pandera.pandas``, imported on first use (its import costs about a second)."""
    return require("pandera.pandas", "delta", FEATURE)


def compute() -> Any:
    """``pyarrow.compute``, imported on first use."""
    return require("pyarrow.compute", "tables", FEATURE)


def kind_of(t: pa.DataType) -> str:
    """'int', 'float', 'bool', 'string', 'timestamp', 'null' or 'other' (dictionaries: their values')."""
    import pyarrow as pa

    if pa.types.is_dictionary(t):
        t = t.value_type
    if pa.types.is_integer(t):
        return "int"
    if pa.types.is_floating(t):
        return "float"
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return "string"
    if pa.types.is_timestamp(t):
        return "timestamp"
    if pa.types.is_null(t):
        return "null"
    return "other"


@cache
def arrow_type_of(pandas_dtype: Any) -> pa.DataType:
    """The Arrow type pandas converts ``pandas_dtype`` to (``Int64`` → int64, ``str`` → large_string)."""
    import pandas as pd
    import pyarrow as pa

    return pa.array(pd.Series([], dtype=pandas_dtype)).type


def nullable_pandas(t: pa.DataType) -> Any:
    """The pandas dtype a column of ``t`` is checked as: nullable for integers and booleans (numpy's
    would turn nulls into floats), pandas' ``str`` for strings (mapped explicitly, it wraps the Arrow
    buffers; left to pyarrow, a column goes through Python objects, ~0.1 s per million rows)."""
    import pandas as pd
    import pyarrow as pa

    if pa.types.is_boolean(t):
        return pd.BooleanDtype()
    if pa.types.is_integer(t):
        return pd.api.types.pandas_dtype(f"{'U' if pa.types.is_unsigned_integer(t) else ''}Int{t.bit_width}")
    if kind_of(t) == "string":
        return pd.api.types.pandas_dtype("str")
    return None


def accepts(src: pa.DataType, dst: pa.DataType) -> bool:
    """Whether a column of type ``src`` is a lossless widening of the pinned ``dst`` (cast, not flagged)."""
    ks, kd = kind_of(src), kind_of(dst)
    if ks == "null" or (ks, kd) in {("int", "int"), ("int", "float"), ("float", "float")}:
        return True
    if ks == kd == "timestamp":
        return (src.tz is None) == (dst.tz is None)
    return ks == kd and ks in ("bool", "string")


def finite(x: float) -> bool:
    return not (math.isinf(x) or math.isnan(x))


def widened_bounds(lo: float, hi: float, margin: float, integer: bool) -> tuple[float, float]:
    """``[lo, hi]`` widened by ``margin`` × span each side, not across zero, rounded outward to two
    significant digits of the width (``[18, 90]`` → ``[0, 110]``, ``[-4.5, 4.7]`` → ``[-7, 7]``)."""
    span = (hi - lo) or abs(hi) or 1.0
    a, b = lo - margin * span, hi + margin * span
    if lo >= 0:
        a = max(a, 0.0)
    if hi <= 0:
        b = min(b, 0.0)
    width = (b - a) or span
    exponent = math.floor(math.log10(width)) - 1
    step = 10.0**exponent
    if integer:
        step, exponent = max(step, 1.0), max(exponent, 0)
    digits = max(0, -exponent)
    a = round(math.floor(a / step) * step, digits) + 0.0  # + 0.0 turns -0.0 into 0.0
    b = round(math.ceil(b / step) * step, digits) + 0.0
    a, b = min(a, lo), max(b, hi)  # float rounding never moves a bound inside the data
    return (math.floor(a), math.ceil(b)) if integer else (a, b)


def decoded(col: Any) -> Any:
    """A dictionary-encoded column as its plain values (the pinned dtype is the values' type)."""
    import pyarrow as pa

    if pa.types.is_dictionary(col.type):
        return col.cast(col.type.value_type)
    return col


def numeric_stats(col: Any) -> tuple[int, tuple[float, float] | None, bool]:
    """(nulls counting NaN, the finite (min, max) or None, whether ±inf occurs) of a numeric column."""
    pc = compute()
    nulls = col.null_count
    has_inf = False
    if kind_of(col.type) == "float":
        nulls += pc.sum(pc.is_nan(col)).as_py() or 0
        has_inf = bool(pc.any(pc.is_inf(col)).as_py())
    mm = pc.min_max(col)
    lo, hi = mm["min"].as_py(), mm["max"].as_py()
    if lo is None or not (finite(lo) and finite(hi)):
        return nulls, None, has_inf
    return nulls, (lo, hi), has_inf


def categories(col: Any, max_categories: int) -> list[Any] | None:
    """The sorted distinct non-null values of ``col`` if there are 1 to ``max_categories`` of them."""
    values = compute().unique(col.drop_null()) if col.null_count else compute().unique(col)
    if not 0 < len(values) <= max_categories:
        return None
    return sorted(values.to_pylist())


def infer_column(col: Any, max_categories: int, range_margin: float) -> Any:
    """The pandera ``Column`` the inference rules (in :mod:`vatra.data.tables.schema`) give ``col``."""
    pandera = pandera_pandas()
    col = decoded(col)
    kind = kind_of(col.type)
    checks: list[Any] = []
    nullable = col.null_count > 0
    dtype: str | None = None
    if kind in ("int", "float"):
        dtype = "UInt64" if str(col.type) == "uint64" else "Int64" if kind == "int" else "float64"
        nulls, observed, has_inf = numeric_stats(col)
        nullable = nulls > 0
        if observed is not None and not has_inf:
            a, b = widened_bounds(*observed, range_margin, integer=kind == "int")
            checks.append(pandera.Check.in_range(a, b))
    elif kind in ("bool", "string"):
        dtype = "boolean" if kind == "bool" else "str"
        values = categories(col, max_categories)
        if values is not None:
            checks.append(pandera.Check.isin(values))
    elif kind == "timestamp":
        dtype = f"datetime64[ns, {col.type.tz}]" if col.type.tz else "datetime64[ns]"
    elif kind == "null":
        nullable = True
    return pandera.Column(dtype, checks=checks, nullable=nullable)
