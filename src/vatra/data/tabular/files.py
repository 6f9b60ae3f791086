"""Table files: which CSV/Parquet files ``data.path`` names, their columns, their rows, and the
layout of Parquet row groups. pyarrow (the ``tables`` extra) is imported on first use."""

from __future__ import annotations

import glob
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from vatra._extras import require
from vatra.config import DataConfig
from vatra.errors import ConfigError

if TYPE_CHECKING:
    import pyarrow as pa

CSV = (".csv", ".csv.gz", ".tsv")
PARQUET = (".parquet", ".pq")


def arrow() -> Any:
    """The ``pyarrow`` module (the ``tables`` extra), imported on first use."""
    require("pyarrow", "tables", "data.name = 'table'")
    import pyarrow as pa

    return pa


def _kind(path: str) -> str:
    low = path.lower()
    if low.endswith(CSV):
        return "csv"
    if low.endswith(PARQUET):
        return "parquet"
    raise ConfigError(
        f"data.path: {path!r} is neither CSV ({', '.join(CSV)}) nor Parquet ({', '.join(PARQUET)})"
    )


def table_files(cfg: DataConfig) -> list[str]:
    """The files ``data.path`` names, sorted by name: a file, every table file in a folder, or a glob."""
    if not cfg.path:
        raise ConfigError(
            "data.path: set it to a CSV or Parquet file, a folder of them, or a glob ('*.parquet')"
        )
    if glob.has_magic(cfg.path):
        files = sorted(p for p in glob.glob(cfg.path) if Path(p).is_file())
        if not files:
            raise ConfigError(f"data.path: the glob {cfg.path!r} matches no file")
    elif Path(cfg.path).is_dir():
        files = sorted(
            str(p) for p in Path(cfg.path).iterdir() if p.is_file() and p.name.lower().endswith(CSV + PARQUET)
        )
        if not files:
            raise ConfigError(f"data.path: the folder {cfg.path!r} holds no CSV or Parquet file")
    elif Path(cfg.path).is_file():
        files = [cfg.path]
    else:
        raise ConfigError(f"data.path: {cfg.path!r} does not exist")
    for f in files:
        _kind(f)
    return files


def _delimiter(path: str) -> str:
    return "\t" if path.lower().endswith(".tsv") else ","


def read_schema(path: str) -> pa.Schema:
    """The columns of one file (Parquet metadata; a CSV's inferred header)."""
    pa = arrow()
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    try:
        if _kind(path) == "parquet":
            schema = pq.read_schema(path)
        else:
            with pcsv.open_csv(path, parse_options=pcsv.ParseOptions(delimiter=_delimiter(path))) as reader:
                schema = reader.schema
        names = schema.names  # pyarrow decodes the column names only here
    except (OSError, pa.ArrowException) as err:  # any Arrow error: a corrupt file is not readable
        raise ConfigError(f"data.path: cannot read {path}: {err}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"data.path: {path}: a column name is not UTF-8 text ({err}); save the file as UTF-8"
        ) from None
    twice = sorted(n for n, k in Counter(names).items() if k > 1)
    if twice:  # a column is looked up by name: which of two would be read is undefined
        raise ConfigError(f"data.path: {path}: columns {twice[:5]} appear more than once; rename them")
    return schema


def same_columns(files: list[str]) -> pa.Schema:
    """The first file's schema, after checking every file has the same columns."""
    schema = read_schema(files[0])
    for f in files[1:]:
        other = read_schema(f)
        if set(other.names) != set(schema.names):
            raise ConfigError(
                f"data.path: {f} has columns {other.names} but {files[0]} has {schema.names}; "
                "all files must have the same columns"
            )
    return schema


def read_table(files: list[str], columns: list[str]) -> pa.Table:
    """The named columns of every file, concatenated in file order (types promoted: int + float → float)."""
    pa = arrow()
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    tables = []
    for f in files:
        try:
            if _kind(f) == "parquet":
                tables.append(pq.read_table(f, columns=columns))
            else:
                parse = pcsv.ParseOptions(delimiter=_delimiter(f))
                convert = pcsv.ConvertOptions(include_columns=columns)
                tables.append(pcsv.read_csv(f, parse_options=parse, convert_options=convert))
        except (OSError, pa.ArrowException) as err:
            raise ConfigError(f"data.path: cannot read {f}: {err}") from None
    try:
        return pa.concat_tables(tables, promote_options="permissive").combine_chunks()
    except pa.ArrowException as err:
        raise ConfigError(f"data.path: the files' column types do not agree: {err}") from None


def row_groups(files: list[str]) -> np.ndarray:
    """(G, 4) int64: file index, row group in the file, rows, global index of its first row."""
    import pyarrow.parquet as pq

    rows = []
    for i, f in enumerate(files):
        try:
            meta = pq.ParquetFile(f).metadata
        except (OSError, arrow().ArrowInvalid) as err:
            raise ConfigError(f"data.path: cannot read {f}: {err}") from None
        rows += [(i, g, meta.row_group(g).num_rows) for g in range(meta.num_row_groups)]
    out = np.zeros((len(rows), 4), dtype=np.int64)
    if rows:
        out[:, :3] = rows
        out[:, 3] = np.cumsum(out[:, 2]) - out[:, 2]
    return out
