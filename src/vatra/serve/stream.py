"""Scoring a file larger than memory: CSV, Parquet or a Delta table read in batches of rows, each
scored and appended to a Parquet file, in input order, with a progress bar on a terminal."""

from __future__ import annotations

import csv
import sys
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vatra.data.tabular.files import arrow
from vatra.errors import ConfigError

if TYPE_CHECKING:
    import pyarrow as pa

    from vatra.serve.predict import Predictor

DEFAULT_BATCH_ROWS = 65_536


def _kind(path: Path) -> str:
    if path.is_dir():
        if (path / "_delta_log").is_dir():
            return "delta"
        raise ConfigError(f"predict --data: {path} is a folder but not a Delta table (no _delta_log)")
    if not path.is_file():
        raise ConfigError(f"predict --data: no file {path}")
    suffix = path.suffix.lower()
    if suffix in (".parquet", ".pq"):
        return "parquet"
    if suffix in (".csv", ".tsv", ".txt"):
        return "csv"
    raise ConfigError(
        f"predict --data: {path.name}: give a .csv, .tsv or .parquet file, or a Delta table folder"
    )


def batches(
    path: Path,
    batch_rows: int,
    types: dict[str, Any] | None = None,
    columns: Collection[str] | None = None,
) -> tuple[Iterator[pa.RecordBatch], int | None]:
    """(record batches of at most ``batch_rows`` rows in file order, total rows when known).
    ``types``: CSV column types (so every block of a CSV reads a column alike); ``columns``: read
    only those of them the file has (None: all; an absent one is for the caller to name)."""
    pa = arrow()
    kind = _kind(path)

    def wanted(names: list[str]) -> list[str] | None:
        return None if columns is None else [c for c in names if c in columns]

    if kind == "parquet":
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(path)
        except (OSError, pa.ArrowException) as err:
            raise ConfigError(f"predict --data: cannot read {path}: {err}") from None
        picked = wanted(pf.schema_arrow.names)
        return pf.iter_batches(batch_size=batch_rows, columns=picked), pf.metadata.num_rows
    if kind == "delta":
        return _delta_batches(path, batch_rows, wanted)
    import pyarrow.csv as pcsv

    delimiter = "\t" if path.suffix.lower() == ".tsv" else ","
    try:
        with path.open(newline="", encoding="utf-8", errors="replace") as f:
            header = next(csv.reader(f, delimiter=delimiter), [])
        picked = wanted(header)
        reader = pcsv.open_csv(
            path,
            read_options=pcsv.ReadOptions(block_size=1 << 22),
            parse_options=pcsv.ParseOptions(delimiter=delimiter),
            convert_options=pcsv.ConvertOptions(
                column_types=types or {}, include_columns=picked if picked is not None else []
            ),
        )
    except (OSError, pa.ArrowException) as err:
        raise ConfigError(f"predict --data: cannot read {path}: {err}") from None
    return _rebatch(reader, batch_rows), None


def _guarded(it: Iterator[pa.RecordBatch], path: Path) -> Iterator[pa.RecordBatch]:
    """``it``, with a read error further into the file (a CSV cell that is no number in a later
    block, a damaged row group) as one line naming the file."""
    pa = arrow()
    try:
        yield from it
    except (OSError, pa.ArrowException) as err:
        raise ConfigError(f"predict --data: cannot read {path}: {' '.join(str(err).split())}") from None


def _delta_batches(
    path: Path, batch_rows: int, wanted: Callable[[list[str]], list[str] | None]
) -> tuple[Iterator[pa.RecordBatch], int | None]:
    """The latest version of a Delta table, its files in the order they were added (the order
    training reads a version in): streamed file by file, or read whole when its files are not
    plain Parquet (deletion vectors, column mapping)."""
    import pyarrow.parquet as pq

    from vatra.data.tables.delta import Table, local_files, read_version

    dt = Table.at(str(path)).open()
    picked = wanted(dt.to_pyarrow_dataset().schema.names)
    files = local_files(dt)
    if files is None:
        return iter(read_version(dt, picked).to_batches(max_chunksize=batch_rows)), None
    opened = [pq.ParquetFile(f) for f in files]
    rows = sum(f.metadata.num_rows for f in opened)
    return (b for f in opened for b in f.iter_batches(batch_size=batch_rows, columns=picked)), rows


def _rebatch(reader: Any, batch_rows: int) -> Iterator[pa.RecordBatch]:
    """CSV blocks re-cut into batches of ``batch_rows`` rows."""
    pa = arrow()
    pending: list[Any] = []
    held = 0
    for block in reader:
        pending.append(block)
        held += block.num_rows
        while held >= batch_rows:
            table = pa.Table.from_batches(pending).combine_chunks()
            yield from table.slice(0, batch_rows).to_batches()
            rest = table.slice(batch_rows)
            pending, held = rest.to_batches(), rest.num_rows
    if held:
        yield from pa.Table.from_batches(pending).combine_chunks().to_batches()


def read_whole(path: Path) -> pa.Table:
    """A CSV/Parquet file or Delta table read whole (``Predictor.predict(path)``)."""
    pa = arrow()
    it, _ = batches(path, DEFAULT_BATCH_ROWS)
    parts = list(it)
    if not parts:
        raise ConfigError(f"predict: {path} holds no rows")
    return pa.Table.from_batches(parts)


def csv_types(predictor: Predictor) -> dict[str, Any]:
    """Arrow types of the signature's columns: numbers as float64, categories as text."""
    pa = arrow()
    kinds = {"number": pa.float64(), "category": pa.string()}
    return {i["name"]: kinds[i["type"]] for i in predictor.signature["inputs"] if i["type"] in kinds}


def predict_file(
    predictor: Predictor,
    data: Path,
    out: Path,
    *,
    keep: Sequence[str] = (),
    batch_rows: int = DEFAULT_BATCH_ROWS,
    unseen: str = "error",
    progress: bool | None = None,
) -> dict[str, Any]:
    """Score ``data`` batch by batch into the Parquet file ``out`` (written beside, then renamed:
    a failed run leaves no half file). Returns rows, seconds and rows/s."""
    import pyarrow.parquet as pq

    if batch_rows < 1:
        raise ConfigError(f"predict --batch-rows {batch_rows}: give 1 or more")
    needed = None
    if predictor.preprocess is not None:  # a table model reads its input columns and the kept ones
        needed = {*(i["name"] for i in predictor.signature["inputs"]), *keep}
    it, total = batches(data, batch_rows, csv_types(predictor), needed)
    it = _guarded(it, data)
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_name(out.name + ".part")
    show = sys.stderr.isatty() if progress is None else progress
    start, rows = time.perf_counter(), 0
    writer = None
    bar = _Bar(total) if show else None
    try:
        for batch in it:
            scored = predictor.predict_arrow(batch, keep=keep, unseen=unseen)
            if writer is None:
                writer = pq.ParquetWriter(part, scored.schema)
            writer.write_table(scored)
            rows += batch.num_rows
            if bar is not None:
                bar.advance(batch.num_rows)
        if writer is None:
            raise ConfigError(f"predict --data: {data} holds no rows")
        writer.close()
        writer = None
        part.replace(out)
    finally:
        if bar is not None:
            bar.stop()
        if writer is not None:
            writer.close()
        part.unlink(missing_ok=True)
    seconds = time.perf_counter() - start
    return {"rows": rows, "seconds": seconds, "rows_per_s": rows / seconds if seconds > 0 else 0.0}


class _Bar:
    """A rich progress bar on stderr (rows scored of the total, when known)."""

    def __init__(self, total: int | None) -> None:
        from rich.console import Console
        from rich.progress import Progress

        self.progress = Progress(console=Console(stderr=True), transient=True)
        self.task = self.progress.add_task("scoring rows", total=total)
        self.progress.start()

    def advance(self, n: int) -> None:
        self.progress.advance(self.task, n)

    def stop(self) -> None:
        self.progress.stop()
