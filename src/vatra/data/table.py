"""``data.name = "table"``: CSV or Parquet files read with pyarrow, preprocessed, held in memory.

``build_table`` resolves ``data.path`` (a file, a folder, a glob), plans the columns (a
:class:`Plan`, checked against the schema with errors that name the columns present), splits off the
validation rows (``data.split_column`` or a seeded ``data.val_fraction``), fits the preprocessing
on the training rows only (:mod:`vatra.data.preprocess`) and returns :class:`TableDataset` (one
item a row) or :class:`RankingDataset` (one item a list of rows, ``data.group`` set).
``data.streaming = true`` hands over to :mod:`vatra.data.stream` instead.
"""

from __future__ import annotations

import glob
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vatra.config import DataConfig
from vatra.data._base import Batch, BatchedDataset, DataContext, Datasets, DatasetSpec, TargetSpec
from vatra.data.preprocess import (
    Fields,
    Fitter,
    Preprocess,
    arrow,
    check_missing,
    load_or_fit,
    missing_error,
    on_rank0,
)
from vatra.errors import ConfigError

if TYPE_CHECKING:
    import pyarrow as pa

CSV = (".csv", ".csv.gz", ".tsv")
PARQUET = (".parquet", ".pq")
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


def make_plan(cfg: DataConfig, ctx: DataContext, schema: pa.Schema) -> Plan:
    """The column plan for ``cfg`` on a table with ``schema``; a one-line ConfigError when it does not fit."""
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
    categorical = [c for c in features if c in cfg.categorical]
    numeric = [c for c in features if c not in cfg.categorical]
    for c in numeric:
        if _kind_of(types[c]) not in ("float", "int", "bool"):
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


def split_values(col: Any) -> np.ndarray:
    """``data.split_column`` as a bool mask of validation rows; ConfigError on any other value."""
    pa = arrow()
    import pyarrow.compute as pc

    try:
        strings = pc.cast(col, pa.string())
    except pa.ArrowException as err:  # bytes that are not UTF-8 text, a type with no text form
        raise ConfigError(f"data.split_column: values must be the text 'train' or 'val' ({err})") from None
    found = [v for v in pc.unique(strings).to_pylist() if v not in ("train", "val")]
    if found:
        raise ConfigError(
            f"data.split_column: values must be 'train' or 'val'; found {sorted(map(str, found))[:5]}"
        )
    return np.asarray(pc.equal(strings, "val").to_numpy(zero_copy_only=False), dtype=bool)


def random_val(n: int, fraction: float, seed: int) -> np.ndarray:
    """A seeded random ``fraction`` of ``n`` items (at least one each side) as a bool mask."""
    if n < 2:
        raise ConfigError(f"data.val_fraction: {n} rows (or lists) cannot be split into train and val")
    n_val = min(max(round(n * fraction), 1), n - 1)
    mask = np.zeros(n, dtype=bool)
    mask[np.random.default_rng(seed).permutation(n)[:n_val]] = True
    return mask


def table_spec(pre: Preprocess) -> DatasetSpec:
    """The DatasetSpec of a fitted table: output width by task, heads, categories, feature names."""
    names = tuple(pre.feature_names)
    categorical = pre.cardinality if pre.encoding == "embedding" else {}
    heads: dict[str, TargetSpec] = {}
    if pre.task == "multitask":
        for t, kind in pre.kinds.items():
            if kind != "float":
                heads[t] = TargetSpec(kind, len(pre.classes[t]) if kind == "classification" else 1)  # type: ignore[arg-type]
        width = 0
    elif pre.task == "classification":
        width = len(pre.classes[pre.target[0]])
    elif pre.task == "ranking":
        width = 1
    else:
        width = len(pre.target)
    return DatasetSpec(
        pre.task,  # type: ignore[arg-type]
        (len(names),),
        width,
        heads=heads,
        categorical=categorical,
        feature_names=names,
    )


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


def check_table(cfg: DataConfig, ctx: DataContext) -> None:
    """The config's columns against the files' schema (files found, columns present, numeric or
    declared categorical), reading no rows: a launcher checks this once before workers start."""
    make_plan(cfg, ctx, same_columns(table_files(cfg)))


def build_table(cfg: DataConfig, ctx: DataContext) -> Datasets:
    """Train and val datasets of a CSV/Parquet table (streamed from Parquet with ``data.streaming``)."""
    files = table_files(cfg)
    plan = make_plan(cfg, ctx, same_columns(files))
    if cfg.streaming:
        from vatra.data.stream import build_stream

        return build_stream(cfg, ctx, files, plan)
    return build_rows(read_table(files, plan.needed), plan, cfg, ctx)


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
