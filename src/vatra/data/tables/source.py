"""``data.name = "delta"``: train on one version of a Delta table, pinned, and checked for drift.

A run reads ``data.path`` at ``data.version``. Left unset, the version is the latest when the run
starts and :func:`pin` writes it into the config before the run folder's ``config.toml`` is
written, so rerunning that config (or resuming the run) reads exactly the same rows after new
ingests. The table's URI, version, schema hash and row count go into ``summary.json`` (``data``)
and ``events.jsonl`` (``data_table``).

With ``data.drift_check`` the rows added since ``data.drift_reference`` (default: the version
before ``data.version``) are compared with that reference (:mod:`vatra.data.tables.drift`) before
training; a drifted column or a unit change stops the run with one line naming them (exit 2),
unless ``data.allow_drift``. Every alarm is an event either way.

Everything else (columns, target, split, preprocessing, streaming) is ``data.name = "table"``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vatra.config import Config, DataConfig
from vatra.data._base import DataContext, Datasets
from vatra.data.tables.delta import Table, arrow_schema, is_remote, local_files, read_version
from vatra.data.tabular.memory import build_rows
from vatra.data.tabular.plan import make_plan
from vatra.data.tabular.stream import build_stream
from vatra.errors import ConfigError

if TYPE_CHECKING:
    from vatra.data.tables.drift import DriftReport


class DriftRefused(ConfigError):
    """``data.drift_check`` found drift and ``data.allow_drift`` is off."""


def table_of(cfg: DataConfig) -> Table:
    return Table.at(cfg.path, cfg.storage_options)


def pin(cfg: Config) -> Config:
    """``cfg`` with ``data.version`` set to the table's latest version when unset (and, on s3, the
    store's options as the table's when it has none); its columns checked against the table's
    schema, no rows read. Other data sources pass unchanged."""
    if cfg.data.name != "delta":
        return cfg
    update: dict[str, Any] = {}
    if is_remote(cfg.data.path) and not cfg.data.storage_options and cfg.store.options:
        update["storage_options"] = dict(cfg.store.options)
    data = cfg.data.model_copy(update=update) if update else cfg.data
    table = table_of(data)
    if data.version is None:
        data = data.model_copy(update={"version": table.latest()})
    heads = {name: h.task for name, h in cfg.train.multitask.heads.items()}
    ctx = DataContext(seed=cfg.run.seed, task=cfg.train.task, head_tasks=heads)
    make_plan(data, ctx, arrow_schema(table.open(data.version)))
    return cfg.model_copy(update={"data": data})


def build_delta(cfg: DataConfig, ctx: DataContext) -> Datasets:
    """Train and val datasets of the table at ``data.version`` (rank 0's latest when unset)."""
    table = table_of(cfg)
    version = cfg.version
    if version is None:
        got = ctx.broadcast(table.latest() if ctx.rank == 0 else None)
        version = int(got) if got is not None else table.latest()  # type: ignore[call-overload]
    dt = table.open(version)
    plan = make_plan(cfg, ctx, arrow_schema(dt))
    pinned = table.schema()
    if cfg.streaming:
        files = local_files(dt)
        if files is None:
            raise ConfigError(
                "data.streaming: a remote Delta table (or one with deletion vectors or column mapping) "
                "is read whole; set data.streaming = false"
            )
        out = build_stream(cfg, ctx, files, plan)
        rows = None
    else:
        data = read_version(dt, plan.needed)
        out = build_rows(data, plan, cfg, ctx)
        rows = data.num_rows
    out.train.provenance = {  # type: ignore[attr-defined]
        "table": table.uri,
        "version": int(dt.version()),
        "schema_hash": pinned.hash if pinned is not None else None,
        "rows": rows,
    }
    return out


def drift_report(cfg: DataConfig) -> tuple[DriftReport | None, int, int]:
    """(report, reference version, rows compared) of the rows added since the reference; no report
    when the run reads the reference itself or nothing was added."""
    from vatra.data.tables.delta import added_rows
    from vatra.data.tables.drift import compare

    table = table_of(cfg)
    version = cfg.version if cfg.version is not None else table.latest()
    reference = cfg.drift_reference if cfg.drift_reference is not None else version - 1
    if reference < 0 or reference >= version:
        if cfg.drift_reference is not None and reference > version:
            raise ConfigError(
                f"data.drift_reference: version {reference} is newer than the version read ({version}); "
                "the reference is the version a model was trained on"
            )
        return None, reference, 0
    new, _ = added_rows(table, reference, version)
    if new.num_rows == 0:
        return None, reference, 0
    old = read_version(table.open(reference))
    return compare(old, new, cfg.drift, source_column=cfg.source_column), reference, new.num_rows


def check_drift(cfg: DataConfig, log_event: Callable[..., None]) -> None:
    """``data.drift_check``: log every alarm; refuse (:class:`DriftRefused`) unless ``data.allow_drift``."""
    if not cfg.drift_check:
        return
    report, reference, rows = drift_report(cfg)
    if report is None:
        log_event("drift_checked", reference=reference, rows=rows, drifted=[], refused=False)
        return
    for col in report.columns:
        if col.drifted or col.unit is not None:
            unit = None
            if col.unit is not None:
                unit = {"factor": col.unit.factor, "name": col.unit.name, "fraction": col.unit.fraction}
                unit["source"] = col.unit.source
            log_event(
                "drift_alarm",
                column=col.column,
                method=col.method,
                stats=col.stats,
                unit=unit,
                reference=reference,
                allowed=cfg.allow_drift,
            )
    refused = bool(report.drifted) and not cfg.allow_drift
    log_event("drift_checked", reference=reference, rows=rows, drifted=report.drifted, refused=refused)
    if refused:
        raise DriftRefused(
            f"data.drift_check: the {rows} rows added since version {reference} drifted: "
            f"{report.summary_line()}; see vatra data drift {cfg.path} --against {reference}, "
            f"train anyway with data.allow_drift = true, or pin data.version = {reference}"
        )
