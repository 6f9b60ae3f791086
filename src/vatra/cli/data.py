"""``vatra data``: ingest files into a versioned Delta table with a pinned schema, read its history,
compare versions, evolve the schema, and look for drift and unit changes."""

from __future__ import annotations

import datetime as dt
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table as RichTable

from vatra._extras import require
from vatra.cli.app import app
from vatra.config import DataConfig, load_config
from vatra.errors import ConfigError

if TYPE_CHECKING:
    from vatra.data.tables.delta import Table

data_app = typer.Typer(
    rich_markup_mode=None,
    help="Versioned training tables (Delta Lake): ingest, log, show, diff, schema, drift.",
    no_args_is_help=True,
)
schema_app = typer.Typer(
    rich_markup_mode=None, help="The schema pinned beside a table.", no_args_is_help=True
)
data_app.add_typer(schema_app, name="schema")
app.add_typer(data_app, name="data")

TableArg = Annotated[str, typer.Argument(help="The Delta table: a folder or s3://bucket/prefix.")]
ConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config",
        help="A vatra config whose data.storage_options (or store.options) reach an s3:// table, "
        "and whose [data.drift] and data.source_column set how drift is measured.",
    ),
]
OptionOpt = Annotated[
    list[str], typer.Option("--option", help="A storage option key=value for s3:// (repeatable).")
]


def _data_config(config: Path | None) -> DataConfig:
    if config is None:
        return DataConfig()
    cfg = load_config(config)
    data = cfg.data
    if not data.storage_options and cfg.store.options:
        data = data.model_copy(update={"storage_options": dict(cfg.store.options)})
    return data


def _table(uri: str, config: Path | None, options: list[str]) -> Table:
    require("deltalake", "delta", "vatra data")
    from vatra.data.tables.delta import Table

    opts: dict[str, Any] = dict(_data_config(config).storage_options)
    for item in options:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(
                f"--option {item!r}: expected key=value, e.g. endpoint_url=http://127.0.0.1:9000"
            )
        opts[key.strip()] = value.strip()
    return Table.at(uri, opts)


def _beside(target: Table, name: str) -> Path:
    """A side file's default place: the folder holding a local table, the current folder for s3://."""
    from vatra.data.tables.delta import is_remote

    return Path(name) if is_remote(target.uri) else Path(target.uri).parent / name


def _when(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def _console() -> Console:
    return Console(width=160)


@data_app.command("ingest")
def ingest(
    files: Annotated[list[Path], typer.Argument(help="CSV or Parquet files to append.")],
    table: Annotated[str, typer.Option("--table", help="The Delta table (created by the first ingest).")],
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Accept files that break the pinned schema (recorded); a value the table's type "
            "cannot hold is stored as null (counted).",
        ),
    ] = False,
    max_categories: Annotated[
        int,
        typer.Option(
            "--max-categories", help="First ingest: text columns with ≤ N values become categories."
        ),
    ] = 50,
    range_margin: Annotated[
        float,
        typer.Option("--range-margin", help="First ingest: widen each value range by this share of it."),
    ] = 0.25,
    config: ConfigOpt = None,
    option: OptionOpt = [],  # noqa: B006  (typer reads the default; it is never mutated)
) -> None:
    """Append files to a table as one version, validated against its pinned schema.

    The first ingest infers the schema (types, nulls, value ranges, categories) and pins it at
    <table>/_vatra/schema.yaml, a pandera schema you may edit. A later file that breaks it is
    refused (every failing column listed, nothing written) unless --force. Every value is stored
    exactly or the ingest is refused; after `vatra data schema update` widened a column, the ingest
    widens the table's column too (its earlier rows rewritten in the wider type).
    """
    from vatra.data.tables.delta import SchemaRefused
    from vatra.data.tables.writer import ingest

    target = _table(table, config, option)
    try:
        done = ingest(
            target,
            [str(f) for f in files],
            force=force,
            max_categories=max_categories,
            range_margin=range_margin,
        )
    except SchemaRefused as err:
        for line in err.lines:
            print(f"  {line}", file=sys.stderr)
        raise
    what = "created with a pinned schema" if done.schema_created else "appended"
    print(f"{target.uri}: version {done.version}: {done.rows} rows from {len(done.files)} file(s) {what}")
    print(f"schema {done.schema_hash[:12]}")
    if done.forced:
        print(f"forced past {len(done.violations)} schema violation(s), recorded in the commit and events:")
        for line in done.violations:
            print(f"  {line}")
    for column, change in done.widened.items():
        print(f"  column {column}: the table's type widened ({change}), its earlier rows rewritten as such")
    for column, n in done.nulled.items():
        print(f"  column {column}: {n} value(s) that the table's type cannot hold were stored as null")


@data_app.command("log")
def log(table: TableArg, config: ConfigOpt = None, option: OptionOpt = []) -> None:  # noqa: B006
    """Every version: when, how many rows, and what made it (files, forced ingests)."""
    from vatra.data.tables.versions import history

    out = RichTable("version", "time (UTC)", "operation", "rows added", "rows", "files", "schema", "forced")
    for v in history(_table(table, config, option)):
        rec = v.ingest or {}
        files = ", ".join(f["name"] for f in rec.get("files", [])) or "-"
        out.add_row(
            str(v.version),
            _when(v.time),
            v.operation,
            "-" if v.rows_added is None else str(v.rows_added),
            "-" if v.rows is None else str(v.rows),
            files,
            str(rec.get("schema_hash", "-"))[:12],
            f"yes ({len(rec.get('violations', []))})" if rec.get("forced") else "",
        )
    _console().print(out)


@data_app.command("show")
def show(
    table: TableArg,
    version: Annotated[int | None, typer.Option("--version", help="The version (default: latest).")] = None,
    rows: Annotated[int, typer.Option("--rows", help="How many rows to print.")] = 10,
    config: ConfigOpt = None,
    option: OptionOpt = [],  # noqa: B006
) -> None:
    """One version: its row count, columns and types, schema hash, and its first rows."""
    from vatra.data.tables.versions import show as snapshot

    snap = snapshot(_table(table, config, option), version, max(rows, 0))
    print(f"version {snap.version}: {snap.rows} rows, {len(snap.schema)} columns")
    print(f"pinned schema: {snap.schema_hash or 'none'}")
    out = RichTable(*[f"{f.name}\n{f.type}" for f in snap.schema])
    for row in snap.head.to_pylist():
        out.add_row(*["" if v is None else str(v) for v in row.values()])
    _console().print(out)


@data_app.command("diff")
def diff(
    table: TableArg,
    v1: Annotated[int, typer.Argument(help="The older version.")],
    v2: Annotated[int, typer.Argument(help="The newer version.")],
    config: ConfigOpt = None,
    option: OptionOpt = [],  # noqa: B006
) -> None:
    """Rows added and removed between two versions, and how each column's summary changed."""
    from vatra.data.tables.versions import diff as compare

    d = compare(_table(table, config, option), v1, v2)
    print(f"version {d.v1} → {d.v2}: {d.rows_v1} → {d.rows_v2} rows; +{d.added} added, -{d.removed} removed")
    if d.columns_added:
        print(f"columns added: {', '.join(d.columns_added)}")
    if d.columns_removed:
        print(f"columns removed: {', '.join(d.columns_removed)}")
    out = RichTable("column", "statistic", f"v{d.v1}", f"v{d.v2}", "change")
    for ch in d.changes:
        for key in ch.after:
            before, after = ch.before.get(key), ch.after[key]
            if before == after and key != "rows":
                continue
            delta = ""
            if isinstance(before, int | float) and isinstance(after, int | float):
                delta = f"{after - before:+.4g}"
            out.add_row(ch.column, key, _fmt(before), _fmt(after), delta)
    _console().print(out)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list):
        return ", ".join(map(str, v))
    return "-" if v is None else str(v)


@schema_app.command("show")
def schema_show(table: TableArg, config: ConfigOpt = None, option: OptionOpt = []) -> None:  # noqa: B006
    """Print the pinned schema (pandera YAML) and its hash."""
    target = _table(table, config, option)
    pinned = target.schema()
    if pinned is None:
        raise ConfigError(f"{target.uri}: no pinned schema; the first vatra data ingest pins one")
    print(f"# hash {pinned.hash}")
    print(pinned.to_yaml(), end="")


@schema_app.command("update")
def schema_update(
    table: TableArg,
    files: Annotated[
        list[Path] | None,
        typer.Option("--from", help="Files the schema must accept (repeatable); default: the table's rows."),
    ] = None,
    version: Annotated[
        int | None, typer.Option("--version", help="Accept this version's rows (default: latest).")
    ] = None,
    add_columns: Annotated[bool, typer.Option(help="Add columns the schema does not have.")] = True,
    widen: Annotated[bool, typer.Option(help="Widen value ranges to take the new values.")] = True,
    categories: Annotated[bool, typer.Option(help="Add new categories.")] = True,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the changes, write nothing.")] = False,
    config: ConfigOpt = None,
    option: OptionOpt = [],  # noqa: B006
) -> None:
    """Evolve the pinned schema explicitly so that it accepts the given files (or a version's rows).

    Every change is printed and recorded in <table>/_vatra/events.jsonl with the old and new hash.
    A table without a pinned schema gets one inferred from its rows.
    """
    from vatra.data.tables.delta import read_file, read_version
    from vatra.data.tables.schema import TableSchema

    target = _table(table, config, option)
    if files:
        from vatra.data.tables.delta import concat

        rows = concat([read_file(str(f)) for f in files])
        what = ", ".join(f.name for f in files)
    else:
        rows = read_version(target.open(version))
        what = f"version {version if version is not None else target.latest()}"
    old = target.schema()
    if old is None:
        new, changes = TableSchema.infer(rows), [f"schema inferred from {what}"]
    else:
        new, changes = old.updated(rows, add_columns=add_columns, widen=widen, categories=categories)
    if old is not None and new.hash == old.hash:
        print(f"the pinned schema already accepts {what}; nothing to change")
        return
    for line in changes:
        print(f"  {line}")
    if dry_run:
        print("dry run: nothing written")
        return
    target.pin_schema(new)
    target.log_event(
        "schema_updated", old_hash=old.hash if old else None, new_hash=new.hash, changes=changes, source=what
    )
    print(f"schema {old.hash[:12] if old else 'none'} → {new.hash[:12]}")


@data_app.command("drift")
def drift(
    table: TableArg,
    against: Annotated[
        int, typer.Option("--against", help="The reference version (what a model was trained on).")
    ],
    version: Annotated[
        int | None,
        typer.Option("--version", help="Compare the rows added up to this version (default: latest)."),
    ] = None,
    files: Annotated[
        list[Path] | None, typer.Option("--file", help="Compare these files instead (before ingesting them).")
    ] = None,
    source_column: Annotated[
        str | None, typer.Option("--source-column", help="Also compare per source (a supplier, a site).")
    ] = None,
    html: Annotated[
        Path | None,
        typer.Option(
            "--html",
            help="The HTML page (default: drift-v<N>-<what>.html beside a local table, "
            "in the current folder for s3://).",
        ),
    ] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the report as JSON.")] = None,
    config: ConfigOpt = None,
    option: OptionOpt = [],  # noqa: B006
) -> None:
    """Per column drift (PSI, KS, Wasserstein; chi², Jensen–Shannon) and unit changes between the
    reference version and the rows added since (or new files). Exit 1 when anything drifted."""
    from vatra.data.tables.delta import added_rows, concat, read_file, read_version
    from vatra.data.tables.drift import compare
    from vatra.data.tables.drift_html import write_html

    settings = _data_config(config)
    target = _table(table, config, option)
    reference = read_version(target.open(against))
    if files:
        current = concat([read_file(str(f)) for f in files])
        what = "files" if len(files) > 1 else files[0].stem
        label = ", ".join(f.name for f in files)
    else:
        current, read = added_rows(target, against, version)
        what, label = f"v{read}", f"the rows added in versions {against + 1}..{read}"
        if current.num_rows == 0:
            raise ConfigError(f"{target.uri}: no rows were added after version {against}; nothing to compare")
    src = settings.source_column if source_column is None else source_column
    report = compare(reference, current, settings.drift, source_column=src)
    out = RichTable(
        "column", "kind", "psi", "ks", "wasserstein", "chi²", "js", "decided by", "drifted", "unit change"
    )

    def stat(c: Any, key: str) -> str:
        v = c.stats.get(key)
        return "-" if v is None else f"{v:.3g}"

    for c in report.columns:
        unit = "-"
        if c.unit is not None:
            unit = f"{c.unit.name}, {c.unit.fraction:.1%} of rows"
            unit += f" ({c.unit.source})" if c.unit.source else ""
        out.add_row(
            c.column,
            c.kind,
            stat(c, "psi"),
            stat(c, "ks"),
            stat(c, "wasserstein"),
            stat(c, "chi2_pvalue"),
            stat(c, "jensen_shannon"),
            c.method,
            "yes" if c.drifted else "",
            unit,
        )
    print(
        f"reference version {against} ({reference.num_rows} rows) against {label} ({current.num_rows} rows)"
    )
    _console().print(out)
    for column, why in report.skipped.items():
        print(f"  skipped {column}: {why}")
    page = html or _beside(target, f"drift-v{against}-{what}.html")
    write_html(report, reference, current, page, title=f"{target.uri}: v{against} against {label}")
    if json_out is not None:
        try:
            json_out.write_text(json.dumps(report.to_json(), indent=2))
        except OSError as err:
            raise ConfigError(f"--json {json_out}: cannot write it ({err.strerror}); name a file") from None
    print(report.summary_line())
    print(f"report: {page}")
    if report.drifted:
        raise typer.Exit(1)
