"""The column plan of a table: which columns are features (numeric or categorical), targets, the
split column and the ranking group, checked against the files' schema with errors that name the
columns present, and the task each target column resolves to."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vatra.config import DataConfig
from vatra.data._base import DataContext
from vatra.data.tabular.files import arrow
from vatra.errors import ConfigError

if TYPE_CHECKING:
    import pyarrow as pa

HEAD_TASKS = ("classification", "multilabel", "regression")


def _kind_of(t: pa.DataType) -> str:
    """'float', 'int', 'bool', 'string' (strings and dictionaries) or 'other'."""
    pa = arrow()
    if pa.types.is_floating(t) or pa.types.is_decimal(t) or pa.types.is_null(t):
        return "float"
    if pa.types.is_integer(t):
        return "int"
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_dictionary(t):
        return "string"
    return "other"


@dataclass(frozen=True)
class Plan:
    """Which columns feed what, and what each target column becomes.

    ``kinds`` maps each target column to classification / multilabel / regression, or ``float``
    (a multitask target that is no head, passed through). ``task`` is the resolved task, or
    ``"auto-multi"`` while several integer/bool targets wait for the fit to tell multilabel (all 0/1)
    from multi-output regression.
    """

    target: list[str]
    features: list[str]  # numeric feature columns, in input order
    categorical: list[str]  # categorical feature columns, in column order
    task: str
    kinds: dict[str, str]
    split_column: str = ""
    group: str = ""
    keep: tuple[str, ...] = ()  # columns read but used as neither feature nor target (DataContext.keep)

    @property
    def inputs(self) -> list[str]:
        return self.features + self.categorical

    @property
    def needed(self) -> list[str]:
        """Every column a chunk must hold (what is read from the files)."""
        extra = [c for c in (self.split_column, self.group, *self.keep) if c]
        return list(dict.fromkeys(self.inputs + self.target + extra))


def make_plan(
    cfg: DataConfig, ctx: DataContext, schema: pa.Schema, stray: Callable[[str], str | None] | None = None
) -> Plan:
    """The column plan for ``cfg`` on a table with ``schema``; a one-line ConfigError when it does not fit.

    ``stray(column)``, when given, says where a numeric feature read as text holds a cell that is no
    number (a typo among numbers), so the error names that cell instead of suggesting categories.
    """
    names = list(schema.names)
    types = {n: schema.field(n).type for n in names}
    present = ", ".join(names)
    multitask = ctx.task == "multitask" or bool(ctx.head_tasks)
    target = [cfg.target] if isinstance(cfg.target, str) else list(cfg.target)
    target = [t for t in target if t] or (list(ctx.head_tasks) if multitask else [])
    if not target:
        raise ConfigError(f"data.target: name the target column(s); the table has columns: {present}")
    for key, cols in (("data.target", target), ("data.features", cfg.features)):
        missing = [c for c in cols if c not in types]
        if missing:
            raise ConfigError(
                f"{key}: no column {', '.join(map(repr, missing))}; the table has columns: {present}"
            )
    named = [("data.split_column", cfg.split_column), ("data.group", cfg.group)]
    for key, col in [*named, *(("federated.partition.column", c) for c in ctx.keep)]:
        if col and col not in types:
            raise ConfigError(f"{key}: no column {col!r}; the table has columns: {present}")
    reserved = {*target, cfg.split_column, cfg.group, *ctx.keep}
    features = list(cfg.features) or [c for c in names if c not in reserved]
    # A multitask target that is no head (context for a penalty) may also be an input, if listed.
    context = {t for t in target if multitask and t not in ctx.head_tasks} if cfg.features else set()
    clash = [c for c in features if c in reserved - context]
    if clash:
        raise ConfigError(
            f"data.features: {', '.join(map(repr, clash))} is a target, split or group column"
            + ("; only a multitask target that is not a head may also be a feature" if multitask else "")
        )
    outside = [c for c in cfg.categorical if c not in features]
    if outside:
        raise ConfigError(
            f"data.categorical: {', '.join(map(repr, outside))} is not a feature column; "
            f"the features are: {', '.join(features)}"
        )
    pinned = [c for c in cfg.categories if c not in target]  # a pinned feature is read as categories
    outside = [c for c in pinned if c not in features]
    if outside:
        raise ConfigError(
            f"data.categories: {', '.join(map(repr, outside))} is neither a feature nor a target column; "
            f"the features are: {', '.join(features)}"
        )
    declared = {*cfg.categorical, *pinned}
    categorical = [c for c in features if c in declared]
    numeric = [c for c in features if c not in declared]
    for c in numeric:
        if _kind_of(types[c]) not in ("float", "int", "bool"):
            where = stray(c) if stray is not None else None
            if where:
                raise ConfigError(
                    f"data.features: column {c!r} holds text among its numbers: {where}; correct the "
                    f"cell, or empty it to mark it missing (data.nan), or add {c!r} to data.categorical"
                )
            raise ConfigError(
                f"data.features: column {c!r} is {types[c]}, not numeric; add it to data.categorical "
                "to read it as categories"
            )
    if not features:
        raise ConfigError(f"data.features: no feature columns left; the table has columns: {present}")
    task, kinds = _target_kinds(cfg, ctx, target, {t: _kind_of(types[t]) for t in target}, multitask)
    return Plan(target, numeric, categorical, task, kinds, cfg.split_column, cfg.group, tuple(ctx.keep))


def _target_kinds(
    cfg: DataConfig, ctx: DataContext, target: list[str], types: dict[str, str], multitask: bool
) -> tuple[str, dict[str, str]]:
    """(task, kind per target column) from train.task, the heads and the target columns' types."""

    def numeric(cols: Sequence[str], why: str) -> None:
        bad = [c for c in cols if types[c] not in ("float", "int", "bool")]
        if bad:
            raise ConfigError(f"data.target: column {bad[0]!r} is not numeric; {why}")

    if cfg.group:
        if ctx.task not in ("auto", "ranking"):
            raise ConfigError(
                f"data.group is set (ranking lists) but train.task = {ctx.task!r}; use 'ranking'"
            )
        if len(target) != 1:
            raise ConfigError(f"data.target: ranking takes one relevance column, not {target}")
        numeric(target, "a ranking target is a numeric relevance")
        return "ranking", {target[0]: "regression"}
    if ctx.task == "ranking":
        raise ConfigError("train.task = 'ranking' needs data.group: the column that groups rows into lists")
    if multitask:
        heads = {k: v for k, v in ctx.head_tasks.items() if k}
        missing = [h for h in heads if h not in target]
        if missing:
            raise ConfigError(
                f"train.multitask.heads: head {missing[0]!r} has no target column; data.target lists {target}"
            )
        kinds = {c: heads.get(c, "float") for c in target}
        numeric(
            [c for c, k in kinds.items() if k != "classification"], "only classification heads take labels"
        )
        return "multitask", kinds
    if ctx.task in HEAD_TASKS:
        if ctx.task == "classification" and len(target) != 1:
            raise ConfigError(f"data.target: classification takes one target column, not {target}")
        if ctx.task != "classification":
            numeric(target, f"train.task = {ctx.task!r} needs numbers")
        return ctx.task, dict.fromkeys(target, ctx.task)
    if ctx.task != "auto":
        raise ConfigError(f"train.task = {ctx.task!r} cannot be learned from a table")
    if len(target) == 1:
        kind = types[target[0]]
        if kind == "other":
            raise ConfigError(f"data.target: column {target[0]!r} is neither numbers nor labels")
        task = "regression" if kind == "float" else "classification"
        return task, {target[0]: task}
    numeric(target, "several target columns are multilabel (0/1) or regression outputs")
    if all(types[c] in ("int", "bool") for c in target):
        return "auto-multi", dict.fromkeys(target, "multilabel")
    return "regression", dict.fromkeys(target, "regression")
