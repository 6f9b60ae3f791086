"""``data.name = "table"``: CSV or Parquet files, held in memory (:mod:`.memory`) or, with
``data.streaming = true``, streamed row group by row group (:mod:`.stream`)."""

from __future__ import annotations

from vatra.config import DataConfig
from vatra.data._base import DataContext, Datasets
from vatra.data.tabular.cells import outside_pins, stray_text
from vatra.data.tabular.files import read_table, same_columns, table_files
from vatra.data.tabular.memory import build_rows
from vatra.data.tabular.plan import Plan, make_plan
from vatra.data.tabular.stream import build_stream
from vatra.errors import ConfigError


def check_table(cfg: DataConfig, ctx: DataContext) -> None:
    """The config's columns against the files' schema (files found, columns present, numeric or
    declared categorical) and the values of pinned columns (reading those columns only): a
    launcher checks this once before workers start."""
    files = table_files(cfg)
    plan = make_plan(cfg, ctx, same_columns(files), lambda column: stray_text(files, column))
    check_pins(cfg, plan, files)


def build_table(cfg: DataConfig, ctx: DataContext) -> Datasets:
    """Train and val datasets of a CSV/Parquet table (streamed from Parquet with ``data.streaming``)."""
    files = table_files(cfg)
    plan = make_plan(cfg, ctx, same_columns(files), lambda column: stray_text(files, column))
    check_pins(cfg, plan, files)
    if cfg.streaming:
        return build_stream(cfg, ctx, files, plan)
    return build_rows(read_table(files, plan.needed), plan, cfg, ctx)


def check_pins(cfg: DataConfig, plan: Plan, files: list[str]) -> None:
    """Every value of a column pinned by data.categories is one of its categories: else one line
    naming the column, the value and its row (reads only the pinned columns)."""
    for column, pinned in cfg.categories.items():
        if column not in plan.needed:
            continue
        found = outside_pins(files, column, [str(v) for v in pinned])
        if found:
            where, more = found
            also = f" ({more} more cell(s) too)" if more else ""
            raise ConfigError(
                f"data.categories: column {column!r} holds {where}, outside its categories "
                f"{[str(v) for v in pinned]}{also}; map it to one of them or add it to "
                f"data.categories.{column}"
            )
