"""Delta tables: where a table lives, its pinned schema and side folder, reading a version in a fixed
file order, and reading the CSV/Parquet files an ingest appends.

A table is a standard Delta Lake table (delta-rs writes it; Spark, DuckDB, Polars or plain
``deltalake`` read it). vatra keeps two things of its own beside the data, under ``<table>/_vatra/``
(a folder Delta readers and ``VACUUM`` ignore: its name starts with ``_``):

* ``schema.yaml``: the pinned pandera schema (:class:`~vatra.data.tables.schema.TableSchema`),
  written by the first ingest (or by the user before it) and changed only by
  ``vatra data schema update``;
* ``events.jsonl``: what was accepted against the schema (``--force``) and every schema change.

Each ingest (:mod:`vatra.data.tables.writer`) is one Delta commit whose ``vatra.ingest`` commit
metadata records the source files (name, sha256, rows), the schema hash, whether it was forced and
with which violations, and any column it widened, so ``vatra data log`` can say what made each
version. Versions' history, snapshots and differences are in :mod:`vatra.data.tables.versions`.

Rows of a version are read file by file in the order the files were added (then by path), so a
version always yields the same rows in the same order: a training run pinned to it splits and
shuffles them the same way every time.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vatra._extras import require
from vatra._io import atomic_write
from vatra.data.tabular.files import read_schema, read_table
from vatra.errors import ConfigError, VatraError

if TYPE_CHECKING:
    import pyarrow as pa
    from deltalake import DeltaTable

    from vatra.data.tables.schema import TableSchema

META_DIR = "_vatra"
SCHEMA_FILE = "schema.yaml"  # the pinned pandera schema, in META_DIR
COMMIT_KEY = "vatra.ingest"
FEATURE = "Delta tables"


class TableError(VatraError):
    """A table operation failed for a reason outside the user's command (storage, a broken log)."""


class SchemaRefused(ConfigError):
    """An ingest broke the pinned schema (exit 2): the message is one summary line; ``lines`` holds
    the report of every failing column."""

    def __init__(self, message: str, lines: list[str]) -> None:
        super().__init__(message)
        self.lines = lines


# ---------------------------------------------------------------- where the table lives
def _deltalake() -> Any:
    return require("deltalake", "delta", FEATURE)


def is_remote(uri: str) -> bool:
    return "://" in uri and not uri.startswith("file://")


def delta_options(options: Mapping[str, Any]) -> dict[str, str]:
    """delta-rs storage options from the checkpoint store's (fsspec / s3fs) form.

    ``endpoint_url``, ``key``, ``secret``, ``token`` and ``client_kwargs.region_name`` become
    ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``
    and ``AWS_REGION``; keys already in delta-rs form (upper case) pass through. An ``http://``
    endpoint (a local S3 server) also sets ``AWS_ALLOW_HTTP``. Writes use S3's conditional puts,
    so concurrent ingests cannot overwrite each other's commits.
    """
    out: dict[str, str] = {}
    client = options.get("client_kwargs") or {}
    names = {"key": "AWS_ACCESS_KEY_ID", "secret": "AWS_SECRET_ACCESS_KEY", "token": "AWS_SESSION_TOKEN"}
    for key, value in options.items():
        if key in names and value is not None:
            out[names[key]] = str(value)
        elif key.isupper():
            out[key] = str(value)
    endpoint = options.get("endpoint_url") or client.get("endpoint_url")
    if endpoint:
        out["AWS_ENDPOINT_URL"] = str(endpoint)
        if str(endpoint).startswith("http://"):
            out.setdefault("AWS_ALLOW_HTTP", "true")
    if client.get("region_name"):
        out["AWS_REGION"] = str(client["region_name"])
    if endpoint:
        out.setdefault("AWS_REGION", "us-east-1")  # a custom endpoint needs a region; any one will do
    out.setdefault("conditional_put", "etag")
    return out


@dataclass(frozen=True)
class Table:
    """A Delta table's address: its URI and the storage options (store form) that reach it."""

    uri: str
    options: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def at(cls, uri: str, options: Mapping[str, Any] | None = None) -> Table:
        if not uri:
            raise ConfigError("data.path: name the Delta table (a folder or s3://bucket/prefix)")
        if not is_remote(uri):
            path = Path(uri.removeprefix("file://")).expanduser().resolve()
            found = next((p for p in (path, *path.parents) if p.exists()), path)
            if not found.is_dir():
                where = "" if found == path else f" ({found} is a file)"
                raise ConfigError(
                    f"{path} is not a folder{where}; a Delta table is a folder: name a new or existing one"
                )
            uri = str(path)
        return cls(uri.rstrip("/"), dict(options or {}))

    def exists(self) -> bool:
        return bool(_deltalake().DeltaTable.is_deltatable(self.uri, storage_options=self.delta_options))

    @property
    def delta_options(self) -> dict[str, str]:
        return delta_options(self.options) if is_remote(self.uri) else {}

    def open(self, version: int | None = None) -> DeltaTable:
        """The table at ``version`` (latest when None); one-line errors for a missing table or version."""
        dl = _deltalake()
        if not self.exists():
            raise ConfigError(
                f"{self.uri}: no Delta table there; create one with: "
                f"vatra data ingest FILE --table {self.uri}"
            )
        if version is not None and version < 0:
            raise ConfigError(f"{self.uri}: no version {version}; versions count from 0 (see vatra data log)")
        try:
            dt = dl.DeltaTable(self.uri, storage_options=self.delta_options)
            if version is not None:
                latest = dt.version()
                if version > latest:
                    raise ConfigError(
                        f"{self.uri}: no version {version}; the latest is {latest} "
                        f"(see vatra data log {self.uri})"
                    )
                dt.load_as_version(version)
        except ConfigError:
            raise
        except Exception as err:  # delta-rs raises its own errors (a vacuumed version, a broken log)
            raise TableError(f"{self.uri}: cannot read version {version}: {_one_line(err)}") from None
        return dt

    def latest(self) -> int:
        return int(self.open().version())

    # side files under _vatra/ (fsspec: local folders and s3 alike)
    def _fs(self) -> tuple[Any, str]:
        import fsspec

        opts = {k: v for k, v in self.options.items() if not k.isupper()} if is_remote(self.uri) else {}
        fs, root = fsspec.core.url_to_fs(self.uri, **opts)
        return fs, f"{root}/{META_DIR}"

    def read_meta(self, name: str) -> str | None:
        fs, root = self._fs()
        path = f"{root}/{name}"
        try:
            with fs.open(path, "rb") as f:
                return bytes(f.read()).decode()
        except FileNotFoundError:
            return None

    def write_meta(self, name: str, text: str) -> None:
        """Write ``_vatra/<name>`` whole: a temp name then a rename where the filesystem has one."""
        fs, root = self._fs()
        fs.makedirs(root, exist_ok=True)
        path = f"{root}/{name}"
        if is_remote(self.uri):  # an object store's put is atomic
            fs.pipe_file(path, text.encode())
            return
        atomic_write(path, text, durable=True)

    def log_event(self, kind: str, **fields: Any) -> None:
        """Append one line to ``_vatra/events.jsonl`` (read-modify-write: objects cannot be appended)."""
        line = json.dumps({"time": time.time(), "event": kind, **fields}, default=str)
        old = self.read_meta("events.jsonl") or ""
        self.write_meta("events.jsonl", old + line + "\n")

    def schema(self) -> TableSchema | None:
        """The pinned schema, or None when the table has none yet."""
        text = self.read_meta(SCHEMA_FILE)
        if text is None:
            return None
        from vatra.data.tables.schema import TableSchema  # pandera: only when there is a schema

        return TableSchema.from_yaml(text, source=f"{self.uri}/{META_DIR}/{SCHEMA_FILE}")

    def pin_schema(self, schema: TableSchema) -> None:
        self.write_meta(SCHEMA_FILE, schema.to_yaml())


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text[:300] + ("…" if len(text) > 300 else "")


# ---------------------------------------------------------------- reading a version
def file_order(dt: DeltaTable) -> list[str]:
    """The version's data files (paths relative to the table) in the order they were added."""
    pa = require("pyarrow", "tables", FEATURE)
    actions = pa.table(dt.get_add_actions(flatten=True))
    paths = actions.column("path").to_pylist()
    times = actions.column("modification_time").to_pylist()
    return [p for _, p in sorted(zip(times, paths, strict=True))]


def read_version(
    dt: DeltaTable, columns: Sequence[str] | None = None, only: set[str] | None = None
) -> pa.Table:
    """Every row of the table's loaded version (or of its files in ``only``), files in
    :func:`file_order`, so a version always reads the same rows in the same order."""
    pa = require("pyarrow", "tables", FEATURE)
    import pyarrow.dataset as ds

    dataset = dt.to_pyarrow_dataset()
    order = {p: i for i, p in enumerate(file_order(dt))}
    root = dt.table_uri.split("://", 1)[-1].rstrip("/") + "/"

    def rel(fragment: Any) -> str:
        path = str(fragment.path)
        return path.split(root, 1)[1] if root in path else path

    fragments = [f for f in dataset.get_fragments() if only is None or rel(f) in only]
    fragments.sort(key=lambda f: (order.get(rel(f), len(order)), rel(f)))
    ordered = ds.FileSystemDataset(fragments, dataset.schema, dataset.format, dataset.filesystem)
    try:
        return ordered.to_table(columns=list(columns) if columns is not None else None)
    except (OSError, pa.ArrowInvalid) as err:
        raise TableError(f"{dt.table_uri}: cannot read version {dt.version()}: {_one_line(err)}") from None


def arrow_schema(dt: DeltaTable) -> pa.Schema:
    return dt.to_pyarrow_dataset().schema


def local_files(dt: DeltaTable) -> list[str] | None:
    """The version's Parquet files as local paths in :func:`file_order`, or None when they cannot be
    read as plain Parquet (a remote table, deletion vectors, column mapping)."""
    if is_remote(dt.table_uri) or dt.protocol().reader_features:
        return None
    root = dt.table_uri.removeprefix("file://").rstrip("/")
    return [f"{root}/{p}" for p in file_order(dt)]


# ---------------------------------------------------------------- reading files to ingest
def read_file(path: str) -> pa.Table:
    """One CSV or Parquet file, every column (CSV types inferred by pyarrow)."""
    if Path(path).is_dir():
        raise ConfigError(f"{path} is a folder; name the CSV or Parquet files in it ({path}/*.csv)")
    try:
        return read_table([path], list(read_schema(path).names))
    except ConfigError as err:
        raise ConfigError(_one_line(err).replace("data.path: ", "", 1)) from None


def concat(batches: list[pa.Table]) -> pa.Table:
    pa = require("pyarrow", "tables", FEATURE)
    try:
        return pa.concat_tables(batches, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as err:
        raise ConfigError(f"vatra data ingest: the files' columns do not agree: {_one_line(err)}") from None


def added_rows(table: Table, since: int, version: int | None = None) -> tuple[pa.Table, int]:
    """The rows in ``version`` (latest when None) that were not in ``since``: the files added after
    it. (rows, the version read)."""
    d_new = table.open(version)
    d_old = table.open(since)
    new_files = set(file_order(d_new)) - set(file_order(d_old))
    if not new_files:
        return arrow_schema(d_new).empty_table(), int(d_new.version())
    return read_version(d_new, only=new_files), int(d_new.version())
