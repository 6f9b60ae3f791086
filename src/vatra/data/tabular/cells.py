"""Why a column meant as numbers was read as text: the first cell that is not a number, and its row."""

from __future__ import annotations

from pathlib import Path

from vatra.data.tabular.files import _kind, arrow, read_table

# A number as pyarrow's CSV reader parses one: sign, digits, decimal point, exponent; or nan / inf.
NUMBER = r"^\s*[-+]?((\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|nan|NaN|inf|Inf|infinity|Infinity)\s*$"


def stray_text(files: list[str], column: str) -> str | None:
    """Where ``column`` holds a cell that is no number, when most of its cells are numbers.

    ``"'high' in row 37 of d.csv (line 38)"`` (rows count from 1 after the header), plus how many
    other cells are text; None when most cells are text (a column of categories, not a bad cell)
    or the column is not text. Reads only this column, once, when a config has already failed.
    """
    import pyarrow.compute as pc
    import pyarrow.csv as pcsv

    pa = arrow()
    nulls = sorted(pcsv.ConvertOptions().null_values)  # what the reader takes for a missing number
    first: str | None = None
    numbers = texts = 0
    for f in files:
        col = read_table([f], [column]).column(column)
        if not (col.type.equals("string") or col.type.equals("large_string")):
            continue
        filled = pc.invert(pc.is_in(col, value_set=pa.array(nulls, type=col.type))).fill_null(False)
        is_text = pc.and_(filled, pc.invert(pc.match_substring_regex(col, NUMBER).fill_null(True)))
        n_text = pc.sum(is_text).as_py() or 0
        texts += n_text
        numbers += int(pc.sum(filled).as_py() or 0) - n_text
        if n_text and first is None:
            row = pc.index(is_text, True).as_py()
            line = f" (line {row + 2})" if _kind(f) == "csv" else ""
            first = f"{col[row].as_py()!r} in row {row + 1} of {Path(f).name}{line}"
    if first is None or texts * 2 > numbers + texts:
        return None
    more = texts - 1
    return first + (f", and {more} more cell(s) that are no number" if more else "")


def outside_pins(files: list[str], column: str, pinned: list[str]) -> tuple[str, int] | None:
    """Where ``column`` first holds a value outside ``pinned`` (its categories in data.categories),
    ``"'female' in row 12 of d.csv (line 13)"``, and how many other cells are outside; None when
    every value is pinned (missing values are left to data.nan)."""
    import pyarrow.compute as pc

    pa = arrow()
    truth = {"true": "true", "1": "true", "false": "false", "0": "false"}  # a bool column reads as these
    first: str | None = None
    more = 0
    for f in files:
        col = read_table([f], [column]).column(column)
        allowed = [truth.get(p.lower(), p) for p in pinned] if pa.types.is_boolean(col.type) else pinned
        col = pc.cast(col, pa.string())
        out = pc.invert(pc.is_in(col, value_set=pa.array(allowed, pa.string()))).fill_null(False)
        n_out = int(pc.sum(out).as_py() or 0)
        if n_out and first is None:
            row = pc.index(out, True).as_py()
            line = f" (line {row + 2})" if _kind(f) == "csv" else ""
            first = f"{col[row].as_py()!r} in row {row + 1} of {Path(f).name}{line}"
            n_out -= 1
        more += n_out
    return None if first is None else (first, more)
