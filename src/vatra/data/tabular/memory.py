"""A table held in memory: rows read whole, the missing values handled, the validation rows split
off (``data.split_column`` or a seeded ``data.val_fraction``), the preprocessing fitted on the
training rows only (:mod:`vatra.data.tabular.preprocess`), and the encoded rows as
:class:`TableDataset` (one item a row) or :class:`RankingDataset` (one item a list of rows,
``data.group`` set)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from vatra.config import DataConfig
from vatra.data._base import Batch, BatchedDataset, DataContext, Datasets, on_rank0
from vatra.data.tabular.files import arrow
from vatra.data.tabular.plan import Plan
from vatra.data.tabular.preprocess import (
    Fields,
    Fitter,
    Preprocess,
    check_missing,
    load_or_fit,
    missing_error,
    table_spec,
)
from vatra.data.tabular.split import random_val, split_values
from vatra.errors import ConfigError

if TYPE_CHECKING:
    import pyarrow as pa


class TableDataset(BatchedDataset):
    """Rows of a preprocessed table held as tensors: ``get_batch`` is one indexing op per field."""

    columns: dict[str, np.ndarray]  # DataContext.keep columns of these rows, e.g. an owner id

    def __init__(self, fields: dict[str, torch.Tensor], preprocess: Preprocess) -> None:
        self.columns = {}
        self.fields = fields  # "x": (N, F), "ids": (N, K), "y" or "y/<column>"
        self.preprocess = preprocess

    def __len__(self) -> int:
        return int(self.fields["x"].shape[0])

    def get_batch(self, idx: np.ndarray) -> Batch:
        idx_t = torch.as_tensor(idx, dtype=torch.int64)
        return self.preprocess.pack({k: v[idx_t] for k, v in self.fields.items()})

    @property
    def labels(self) -> np.ndarray | None:
        y = self.fields.get("y")
        if self.preprocess.task != "classification" or y is None:
            return None
        return y.numpy()


class RankingDataset(BatchedDataset):
    """Lists of rows (one per query): item i is ``(inputs (L, F), relevance (L,))``; a batch pads the
    lists to the longest: inputs with zeros, relevance with −1."""

    def __init__(
        self, fields: dict[str, torch.Tensor], offsets: torch.Tensor, preprocess: Preprocess
    ) -> None:
        self.fields = fields  # rows grouped by list: "x": (R, F), "ids": (R, K), "y": (R,)
        self.offsets = offsets  # (N + 1,): list i is rows offsets[i] .. offsets[i + 1] - 1
        self.preprocess = preprocess

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def get_batch(self, idx: np.ndarray) -> Batch:
        idx_t = torch.as_tensor(idx, dtype=torch.int64)
        start = self.offsets[idx_t]  # (B,)
        length = self.offsets[idx_t + 1] - start  # (B,)
        pos = torch.arange(int(length.max()) if len(idx_t) else 0)  # (Lmax,)
        pad = pos[None, :] >= length[:, None]  # (B, Lmax)
        rows = (start[:, None] + pos[None, :]).clamp_max(len(self.fields["y"]) - 1)  # (B, Lmax)
        out = {}
        for k, v in self.fields.items():
            value = -1 if k == "y" else 0
            taken = v[rows]  # (B, Lmax, ...)
            out[k] = taken.masked_fill(pad.view(*pad.shape, *([1] * (taken.dim() - 2))), value)
        return self.preprocess.pack(out)


def _ranking(table: pa.Table, plan: Plan, cfg: DataConfig, ctx: DataContext) -> tuple[np.ndarray, ...]:
    """Rows grouped into lists, in order of first appearance: (row order, list sizes, val mask of lists)."""
    import pyarrow.compute as pc

    col = table.column(plan.group)
    codes = np.asarray(pc.index_in(col, value_set=pc.unique(col)).to_numpy(), dtype=np.int64)  # (R,)
    order = np.argsort(codes, kind="stable")
    sizes = np.bincount(codes)  # (N,)
    if not plan.split_column:
        return order, sizes, random_val(len(sizes), cfg.val_fraction, ctx.seed)
    row_val = split_values(table.column(plan.split_column))[order]
    val_rows = np.add.reduceat(row_val.astype(np.int64), np.cumsum(sizes) - sizes)  # (N,) val rows per list
    mixed = np.flatnonzero((val_rows > 0) & (val_rows < sizes))
    if len(mixed):
        first = int(order[(np.cumsum(sizes) - sizes)[mixed[0]]])
        raise ConfigError(
            f"data.split_column: the list {plan.group} = {col[first].as_py()!r} has both train and val rows"
        )
    return order, sizes, val_rows > 0


def _part(
    encoded: Fields, rows: np.ndarray, pre: Preprocess, sizes: np.ndarray | None
) -> BatchedDataset | None:
    """The dataset of ``rows`` (None when empty): rows, or lists of ``sizes`` consecutive rows."""
    if not len(rows):
        return None
    part = {k: torch.from_numpy(v) for k, v in pre.batch([(encoded, rows)]).items()}
    if sizes is None:
        return TableDataset(part, pre)
    return RankingDataset(part, torch.from_numpy(np.concatenate([[0], np.cumsum(sizes)])), pre)


def build_rows(table: pa.Table, plan: Plan, cfg: DataConfig, ctx: DataContext) -> Datasets:
    """Train and val datasets of rows already read (``plan.needed`` columns): missing values, the
    split, the preprocessing fitted on the training rows, the encoded parts."""
    drop, missing = check_missing(table, plan, cfg.nan)
    if missing:
        raise missing_error(missing, table.num_rows, plan, cfg.nan)
    if drop is not None:
        table = table.filter(arrow().array(~drop))
    list_sizes: np.ndarray | None = None
    if plan.group:
        order, list_sizes, list_val = _ranking(table, plan, cfg, ctx)
        table = table.take(arrow().array(order))
        row_val = np.repeat(list_val, list_sizes)
    elif plan.split_column:
        row_val = split_values(table.column(plan.split_column))
    else:
        row_val = random_val(table.num_rows, cfg.val_fraction, ctx.seed)

    def fit() -> Preprocess:
        fitter = Fitter(plan, cfg)
        fitter.update(table, ~row_val)
        return fitter.result()

    pre, _ = on_rank0(ctx, lambda: load_or_fit(ctx, plan, cfg, fit))
    encoded = pre.encode(table)
    train, val = (
        _part(
            encoded,
            np.flatnonzero(row_val == is_val),
            pre,
            None if list_sizes is None else list_sizes[list_val == is_val],
        )
        for is_val in (False, True)
    )
    if train is None:
        raise ConfigError("data.split_column: no training rows; mark some rows 'train'")
    for part, is_val in ((train, False), (val, True)):
        if isinstance(part, TableDataset) and plan.keep:
            rows = np.flatnonzero(row_val == is_val)
            part.columns = {c: table.column(c).to_numpy(zero_copy_only=False)[rows] for c in plan.keep}
    return Datasets(train, val, table_spec(pre))
