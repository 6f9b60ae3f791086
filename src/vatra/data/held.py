"""What ``vatra.fit(train=..., val=...)`` takes besides torch datasets: pandas DataFrames, read with
the table's preprocessing (:mod:`vatra.data.tabular`, as ``data.name = "table"`` reads a CSV), and
``(X, y)`` pairs of arrays, read as an ``.npz`` file's arrays (:mod:`vatra.data.npz`)."""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

import numpy as np
import torch

from vatra._extras import require
from vatra.config import DataConfig
from vatra.data._base import DataContext, Datasets
from vatra.data.infer import infer_spec, is_dataset
from vatra.data.npz import array_datasets
from vatra.errors import ConfigError
from vatra.registry import describe

SPLIT = "__vatra_split__"  # the column that marks the val= frame's rows, added to the joined table
TAKES = (
    "a torch Dataset, a pandas DataFrame (data.target names the target column) or an (X, y) pair of arrays"
)


def _is_frame(obj: Any) -> bool:
    pd = sys.modules.get("pandas")  # a DataFrame means pandas is imported already: never import it here
    return pd is not None and isinstance(obj, pd.DataFrame)


def _is_pair(obj: Any) -> bool:
    return (
        isinstance(obj, tuple | list)
        and len(obj) == 2
        and all(isinstance(a, np.ndarray | torch.Tensor) for a in obj)
    )


def given_datasets(train: Any, val: Any, cfg: DataConfig, ctx: DataContext) -> Datasets:
    """``train`` and ``val`` as given to ``vatra.fit``, as datasets with their spec."""
    if _is_frame(train) or _is_frame(val):
        return _frames(train, val, cfg, ctx)
    if _is_pair(train) or _is_pair(val):
        return _pairs(train, val, cfg, ctx)
    for name, ds in (("train", train), ("val", val)):
        if isinstance(ds, np.ndarray | torch.Tensor):
            raise ConfigError(
                f"vatra.fit: {name}= is one array; pass ({name}_X, {name}_y): inputs and targets"
            )
        if isinstance(ds, str | os.PathLike):
            raise ConfigError(
                f"vatra.fit: {name}= is {describe(ds)}; pass {TAKES}, or name a file in the config's "
                "data.path and leave train= out"
            )
        if ds is not None and not is_dataset(ds):
            raise ConfigError(f"vatra.fit: {name}= is {describe(ds)}; pass {TAKES}")
    return Datasets(train, val, infer_spec(train, ctx.task, "the train dataset", "train"))


def _both(train: Any, val: Any, test: Any, kind: str) -> None:
    for name, obj in (("train", train), ("val", val)):
        if not test(obj) and (name == "train" or obj is not None):
            raise ConfigError(
                f"vatra.fit: {name}= is {describe(obj)} but the other is {kind}; pass both as {kind} "
                "(val=None: no evaluation)"
            )


def _frames(train: Any, val: Any, cfg: DataConfig, ctx: DataContext) -> Datasets:
    """A DataFrame's rows through the table pipeline: ``val=``'s rows are the validation rows (else
    ``data.split_column`` marks them, else there are none); the preprocessing is fitted on train rows."""
    from vatra.data.tabular.memory import build_rows
    from vatra.data.tabular.plan import make_plan

    _both(train, val, _is_frame, "pandas DataFrames")
    pa = require("pyarrow", "tables", "vatra.fit with a DataFrame")
    if val is not None and cfg.split_column:
        raise ConfigError(
            f"vatra.fit: val= was given and data.split_column = {cfg.split_column!r} also marks val rows; "
            "use one of them"
        )
    if val is not None and list(val.columns) != list(train.columns):
        raise ConfigError(
            f"vatra.fit: val= has columns {list(map(str, val.columns))} but train= has "
            f"{list(map(str, train.columns))}; give both the same columns"
        )
    tables = []
    for name, frame in (("train", train), ("val", val)):
        if frame is None:
            continue
        try:
            table = pa.Table.from_pandas(frame, preserve_index=False)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as err:  # e.g. numbers and text in one column
            raise ConfigError(f"vatra.fit: {name}= cannot be read as a table: {err}") from None
        tables.append(table if cfg.split_column else table.append_column(SPLIT, pa.repeat(name, len(frame))))
    data = cfg.model_copy(update={"streaming": False})
    columns = (
        tables[0].schema
        if cfg.split_column
        else tables[0].schema.remove(tables[0].schema.get_field_index(SPLIT))
    )
    plan = make_plan(data, ctx, columns)
    table = pa.concat_tables(
        tables, promote_options="permissive"
    )  # an int column in one, floats in the other
    if not cfg.split_column:
        plan = dataclasses.replace(plan, split_column=SPLIT)
        data = data.model_copy(update={"split_column": SPLIT})
    return build_rows(table.select(plan.needed), plan, data, ctx)


def _arrays(pair: Any, name: str) -> tuple[np.ndarray, np.ndarray]:
    x, y = (a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else a for a in pair)
    for what, a in (("X", x), ("y", y)):
        if a.dtype.kind not in "biuf" or a.ndim == 0:
            raise ConfigError(
                f"vatra.fit: {name}= {what} is a {a.dtype} array of shape {a.shape}; {what} must hold "
                "numbers, one row per sample"
            )
    if len(x) != len(y):
        raise ConfigError(
            f"vatra.fit: {name}= X has {len(x)} rows but y has {len(y)}; give one target per row"
        )
    return x, y


def _pairs(train: Any, val: Any, cfg: DataConfig, ctx: DataContext) -> Datasets:
    """``(X, y)`` arrays as an ``.npz``'s x and y (and x_val, y_val): float inputs standardised."""
    _both(train, val, _is_pair, "(X, y) pairs of arrays")
    x, y = _arrays(train, "train")
    x_va, y_va = _arrays(val, "val") if val is not None else (x[:0], y[:0])
    return array_datasets(x, y, x_va, y_va, cfg, ctx, "vatra.fit: train=(X, y)")
