"""Fitted preprocessing of tables, shared by the in-memory table and the Parquet stream.

Given the column :class:`~vatra.data.tabular.plan.Plan`, a :class:`Fitter` sees the table chunk by chunk
(the whole table, or one Parquet row group at a time) and fits a :class:`Preprocess`:
standardisation statistics, NaN fill values and vocabularies from training rows only, class names
from every row. ``Preprocess.encode`` turns a chunk into row arrays column by column, filling and
scaling each numeric column on its contiguous values (vectorised, no per-row Python);
``Preprocess.batch`` gathers rows of encoded chunks into the batch fields, and ``Preprocess.pack``
shapes those as ``(inputs, target)``.

The fitted state is saved to ``<run_dir>/data/preprocess.json`` by rank 0 and reused on resume
(:func:`load_or_fit`); :func:`~vatra.data._base.on_rank0` fits on rank 0 only and broadcasts the result.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vatra._io import atomic_write
from vatra.config import DataConfig
from vatra.data._base import Batch, DataContext, DatasetSpec, TargetSpec, preprocess_path
from vatra.data.tabular.files import arrow
from vatra.errors import ConfigError

if TYPE_CHECKING:
    import pyarrow as pa

    from vatra.data.tabular.plan import Plan

# Named row arrays: a chunk's encoding ("num", "ids", "y/<column>") or batch fields ("x", "ids", "y"...)
Fields = dict[str, np.ndarray]
_FORMAT = 1
_FIT_ROWS = 1 << 15  # rows per block of the float64 moment computation


def _compute() -> Any:
    arrow()
    import pyarrow.compute as pc

    return pc


# --- missing values ---------------------------------------------------------------------------


def missing_masks(table: pa.Table, columns: Sequence[str]) -> dict[str, np.ndarray]:
    """Per column with any missing value (null or NaN): a bool mask of its missing rows."""
    pa, pc = arrow(), _compute()
    out = {}
    for c in columns:
        col = table.column(c)
        if col.null_count == 0:
            if not pa.types.is_floating(col.type):
                continue
            if not np.isnan(np.sum(col.to_numpy())):  # NaN propagates through a sum: one cheap pass
                continue
        mask = np.asarray(pc.is_null(col, nan_is_null=True).to_numpy(zero_copy_only=False), dtype=bool)
        if mask.any():
            out[c] = mask
    return out


def missing_error(counts: Mapping[str, int], rows: int, plan: Plan, nan: str) -> ConfigError:
    """The one-line error for missing values: columns, row counts and the fix."""
    shown = ", ".join(f"{c!r} ({n} of {rows} rows)" for c, n in counts.items())
    if nan == "mean":
        return ConfigError(
            f"data.nan: missing target values in {shown}; targets are never filled: set data.nan = 'drop' "
            "to drop those rows"
        )
    return ConfigError(
        f"data.nan: missing values in {shown}; set data.nan = 'drop' to drop those rows or "
        "'mean' to fill features with the training mean"
    )


def check_missing(table: pa.Table, plan: Plan, nan: str) -> tuple[np.ndarray | None, dict[str, int]]:
    """(rows to drop under ``data.nan``, or None; missing values per column that are an error).

    Targets (and the group) are never filled: under ``mean`` their missing values are an error while
    missing numeric features are filled later and a missing category reads as unseen.
    """
    strict = [*plan.target, plan.group] if plan.group else list(plan.target)
    masks = missing_masks(table, strict if nan == "mean" else plan.inputs + strict)
    if not masks:
        return None, {}
    if nan != "drop":
        return None, {c: int(m.sum()) for c, m in masks.items()}
    return np.logical_or.reduce(list(masks.values())), {}


# --- the fitted state ---------------------------------------------------------------------------


def float32_column(col: Any) -> np.ndarray:
    """A numeric arrow column as a float32 numpy array (nulls are NaN)."""
    pa, pc = arrow(), _compute()
    if col.type != pa.float32():  # float32 holds integers exactly up to 2^24: larger ones are rounded
        col = pc.cast(col, pa.float32(), safe=False)
    return np.asarray(col.to_numpy(), dtype=np.float32)


def numeric_matrix(
    table: pa.Table,
    columns: Sequence[str],
    fill: np.ndarray | None = None,
    mean: np.ndarray | None = None,
    scale: np.ndarray | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """(n, F) float32, row-major, NaN where missing, or with missing values set to ``fill`` and
    then ``(x - mean) * scale`` when those are given. Column by column: each column's arithmetic
    runs on its contiguous values, and the one strided write per column is the transposition."""
    if out is None:
        out = np.empty((table.num_rows, len(columns)), dtype=np.float32)
    tmp = np.empty(table.num_rows, dtype=np.float32)
    for j, c in enumerate(columns):
        col = float32_column(table.column(c))
        if fill is not None and len(fill):
            np.copyto(tmp, col)
            np.copyto(tmp, fill[j], where=np.isnan(tmp))
            col = tmp
        if mean is not None and scale is not None and len(mean):
            np.subtract(col, mean[j], out=tmp)
            np.multiply(tmp, scale[j], out=tmp)
            col = tmp
        out[:, j] = col
    return out


def _strings(col: Any) -> Any:
    pa, pc = arrow(), _compute()
    if pa.types.is_string(col.type):
        return col
    try:
        return pc.cast(col, pa.string())
    except pa.ArrowException as err:  # a CSV column of bytes that are not UTF-8 is read as binary
        raise ConfigError(f"data.path: a text column holds values that are not UTF-8 text ({err})") from None


@dataclass
class Preprocess:
    """Everything fitted on the data: how a chunk of the table becomes ``(inputs, target)``."""

    task: str
    target: list[str]
    kinds: dict[str, str]
    features: list[str]
    categorical: list[str]
    encoding: str
    standardize: bool
    mean: list[float] = field(default_factory=list)  # per numeric feature; [] = no scaling
    std: list[float] = field(default_factory=list)
    fill: list[float] = field(default_factory=list)  # per numeric feature NaN fill (data.nan = 'mean')
    vocab: dict[str, list[str]] = field(default_factory=dict)  # categorical column -> training values
    classes: dict[str, list[Any]] = field(default_factory=dict)  # classification target -> class values

    @property
    def feature_names(self) -> list[str]:
        """The columns of ``inputs`` (of ``inputs['x']`` with embeddings)."""
        if self.encoding == "embedding":
            return list(self.features)
        return self.features + [f"{c}={v}" for c in self.categorical for v in self.vocab[c]]

    @property
    def cardinality(self) -> dict[str, int]:
        """Ids per categorical column: the training vocabulary plus id 0 for unseen values."""
        return {c: len(self.vocab[c]) + 1 for c in self.categorical}

    def check(self, plan: Plan, cfg: DataConfig, path: Path) -> None:
        """A saved preprocessing must describe the same columns as the config."""
        want = {
            "target": plan.target,
            "features": plan.features,
            "categorical": plan.categorical,
            "encoding": cfg.categorical_encoding,
            "standardize": cfg.standardize,
        }
        have = {k: getattr(self, k) for k in want}
        for key, value in want.items():
            if have[key] != value:
                raise ConfigError(
                    f"data: {path} was fitted for {key} = {have[key]!r} but the config gives {value!r}; "
                    "use a new run folder or restore the config it was fitted for"
                )

    # -- transform ---------------------------------------------------------------------------

    def __post_init__(self) -> None:
        # float32 copies of the fitted values, used on every batch (not saved: derived)
        self._mean = np.asarray(self.mean, dtype=np.float32)
        self._scale = (1.0 / np.asarray(self.std, dtype=np.float64)).astype(np.float32)
        self._fill = np.asarray(self.fill, dtype=np.float32)
        sizes = [len(self.vocab[c]) for c in self.categorical]
        self._onehot_at = np.cumsum([0, *sizes[:-1]]).astype(np.int64) - 1  # (K,): id 1 -> first column

    def encode(self, table: pa.Table, num_out: np.ndarray | None = None, *, targets: bool = True) -> Fields:
        """A chunk's rows: ``num`` (n, F) float32 (missing values filled with ``data.nan = "mean"``,
        else NaN; standardised when fitted), ``ids`` (n, K) int64 (0 = unseen), ``y/<column>`` the
        encoded targets (class ids or float32). Column-wise, vectorised; ``num_out`` (n, F) float32
        receives ``num`` when given. ``targets=False``: new rows to score, without target columns."""
        pa = arrow()
        # fill and scale here, on contiguous columns; batch() then only gathers rows
        num = numeric_matrix(table, self.features, self._fill, self._mean, self._scale, out=num_out)
        out: Fields = {"num": num}
        ids = np.empty((table.num_rows, len(self.categorical)), dtype=np.int64)  # (n, K)
        for k, c in enumerate(self.categorical):
            ids[:, k] = self._category_ids(table.column(c), pa.array(self.vocab[c], pa.string()))
        out["ids"] = ids
        for t in self.target if targets else ():
            col = table.column(t)
            out["y/" + t] = (
                self._class_ids(t, col) if self.kinds[t] == "classification" else float32_column(col)
            )
        return out

    @staticmethod
    def _category_ids(col: Any, vocab: Any) -> np.ndarray:
        """Ids 1..K of a column's values in the vocabulary, 0 for unseen and missing values. A
        dictionary column (Parquet strings read as such) looks up its few distinct values only."""
        pa, pc = arrow(), _compute()

        def lookup(values: Any) -> np.ndarray:
            return np.asarray(pc.fill_null(pc.index_in(_strings(values), value_set=vocab), -1), np.int64) + 1

        if not pa.types.is_dictionary(col.type):
            return lookup(col)
        parts = []
        for chunk in col.chunks:
            ids = np.append(lookup(chunk.dictionary), 0)  # a missing value's index points past the end
            parts.append(ids[np.asarray(pc.fill_null(chunk.indices, len(chunk.dictionary)), np.int64)])
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def _class_ids(self, name: str, col: Any) -> np.ndarray:
        pa, pc = arrow(), _compute()
        classes = self.classes[name]
        if pa.types.is_integer(col.type) and not col.null_count and classes == list(range(len(classes))):
            ids = np.asarray(col.to_numpy(), dtype=np.int64)  # integer classes 0..C-1 are their own ids
            if not len(ids) or (ids.min() >= 0 and ids.max() < len(classes)):
                return ids
        values = pa.array(classes)
        try:
            idx = pc.index_in(pc.cast(col, values.type), value_set=values)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as err:
            raise ConfigError(f"data.target: column {name!r} cannot be read as its classes: {err}") from None
        if idx.null_count:
            unknown = pc.filter(col, pc.is_null(idx)).to_pylist()[:3]
            raise ConfigError(
                f"data.target: column {name!r} holds {unknown}, outside the fitted classes "
                f"{self.classes[name]}"
            )
        return np.asarray(idx.to_numpy(), dtype=np.int64)

    def batch(
        self,
        pieces: Sequence[tuple[Fields, np.ndarray]],
        alloc: Callable[[tuple[int, ...], np.dtype[Any]], np.ndarray] | None = None,
        *,
        targets: bool = True,
    ) -> Fields:
        """Batch fields of rows taken from encoded chunks (``(encoded fields, row indices)`` pieces),
        each a fresh contiguous array: ``x`` (n, F) float32 (scaled numeric, then one-hot columns),
        ``ids`` (n, K) int64 with embeddings, ``y`` ((n,), or (n, K) for several columns) or
        ``y/<column>`` (multitask). ``alloc(shape, dtype)`` gives the arrays the rows are gathered
        into (recycled buffers) when there is one piece. ``targets=False``: the inputs only (pieces
        encoded without targets)."""

        def take(key: str) -> np.ndarray:
            if alloc is not None and len(pieces) == 1:
                src, rows = pieces[0][0][key], pieces[0][1]
                return np.take(src, rows, axis=0, out=alloc((len(rows), *src.shape[1:]), src.dtype))
            parts = [np.take(f[key], rows, axis=0) for f, rows in pieces]
            return parts[0] if len(parts) == 1 else np.concatenate(parts)

        x = take("num")  # (n, F), filled and scaled by encode()
        out: Fields = {}
        if self.categorical:
            ids = take("ids")  # (n, K)
            if self.encoding == "embedding":
                out["ids"] = ids
            else:
                x = self._onehot(x, ids)
        out["x"] = x
        if not targets:
            return out
        ys = {t: take("y/" + t) for t in self.target}
        if self.task == "multitask":
            out.update({"y/" + t: v for t, v in ys.items()})
        elif self.task == "multilabel" or len(self.target) > 1:
            out["y"] = np.stack([ys[t] for t in self.target], axis=1)  # (n, K)
        else:
            out["y"] = ys[self.target[0]]  # (n,)
        return out

    def _onehot(self, num: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """(n, F + sum K) float32: ``num`` then each category's 0/1 columns (unseen: all zeros)."""
        n, f = num.shape
        width = f + sum(len(self.vocab[c]) for c in self.categorical)
        x = np.zeros((n, width), dtype=np.float32)
        x[:, :f] = num
        hot = np.arange(n)[:, None] * width + (f + self._onehot_at) + ids  # (n, K) flat positions
        seen = ids > 0
        x.reshape(-1)[hot.reshape(-1) if seen.all() else hot[seen]] = 1.0
        return x

    def pack(self, fields: Mapping[str, torch.Tensor]) -> Batch:
        """``(inputs, target)`` from batch fields (tensors)."""
        inputs: Any = {"x": fields["x"], "ids": fields["ids"]} if "ids" in fields else fields["x"]
        if self.task == "multitask":
            return inputs, {t: fields["y/" + t] for t in self.target}
        return inputs, fields["y"]

    # -- persistence -------------------------------------------------------------------------

    def save(self, path: Path) -> None:
        """Write atomically: a reader never sees a half-written file."""
        path.parent.mkdir(parents=True, exist_ok=True)
        saved = {"format": _FORMAT, **asdict(self), "feature_names": self.feature_names}  # names: for readers
        atomic_write(path, json.dumps(saved, indent=1), durable=True)  # a resume reads it

    @classmethod
    def load(cls, path: Path) -> Preprocess:
        try:
            raw = json.loads(path.read_text())
            raw.pop("format")
            raw.pop("feature_names", None)  # derived from the rest
            return cls(**raw)
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ConfigError(f"data: cannot read the fitted preprocessing {path}: {err}") from None


class Fitter:
    """Fits a :class:`Preprocess` chunk by chunk: moments in float64 (Chan's merge), vocabularies
    from training rows, class names and 0/1-ness of targets from every row."""

    def __init__(self, plan: Plan, cfg: DataConfig) -> None:
        self.plan, self.cfg = plan, cfg
        f = len(plan.features)
        self.n, self.mean, self.m2 = np.zeros(f), np.zeros(f), np.zeros(f)
        self.vocab: dict[str, set[str]] = {c: set() for c in plan.categorical}
        self.classes: dict[str, set[Any]] = {t: set() for t, k in plan.kinds.items() if k == "classification"}
        self.binary = dict.fromkeys(plan.target, True)

    def update(self, table: pa.Table, train: np.ndarray) -> None:
        """One chunk (after dropped rows are removed); ``train`` marks its training rows."""
        pa, pc = arrow(), _compute()
        rows = np.flatnonzero(train)
        if len(rows) and self.plan.features:
            x = numeric_matrix(table, self.plan.features)  # (n, F) float32
            for start in range(0, len(rows), _FIT_ROWS):  # float64 copies of cache-sized blocks
                self._moments(np.take(x, rows[start : start + _FIT_ROWS], axis=0).astype(np.float64))
        picked = pa.array(rows, pa.int64())
        for c in self.plan.categorical:
            values = pc.unique(_strings(table.column(c)).take(picked)).to_pylist()
            self.vocab[c].update(v for v in values if v is not None)
        for t in self.classes:
            self.classes[t].update(v for v in pc.unique(table.column(t)).to_pylist() if v is not None)
        if self.plan.task == "auto-multi":
            for t in self.plan.target:
                mm = pc.min_max(table.column(t)).as_py()
                if mm["min"] is not None and (mm["min"] < 0 or mm["max"] > 1):
                    self.binary[t] = False

    def _moments(self, x: np.ndarray) -> None:
        """Merge one block's per-feature count, mean and squared deviations (NaN ignored)."""
        missing = np.isnan(x)
        if missing.any():
            n_b = (~missing).sum(axis=0).astype(np.float64)
            mean_b = np.where(missing, 0.0, x).sum(axis=0) / np.maximum(n_b, 1.0)
            m2_b = (np.where(missing, 0.0, x - mean_b) ** 2).sum(axis=0)
        else:
            n_b = np.full(x.shape[1], float(len(x)))
            mean_b = x.mean(axis=0)
            m2_b = ((x - mean_b) ** 2).sum(axis=0)
        n = self.n + n_b
        delta = mean_b - self.mean
        safe = np.maximum(n, 1.0)
        self.mean = self.mean + delta * n_b / safe
        self.m2 = self.m2 + m2_b + delta**2 * self.n * n_b / safe
        self.n = n

    def result(self) -> Preprocess:
        plan, cfg = self.plan, self.cfg
        task, kinds = plan.task, dict(plan.kinds)
        if task == "auto-multi":
            task = "multilabel" if all(self.binary.values()) else "regression"
            kinds = dict.fromkeys(plan.target, task)
        std = np.sqrt(self.m2 / np.maximum(self.n, 1.0))
        std = np.where(std > 0, std, 1.0)
        mean = [float(v) for v in self.mean]
        return Preprocess(
            task=task,
            target=list(plan.target),
            kinds=kinds,
            features=list(plan.features),
            categorical=list(plan.categorical),
            encoding=cfg.categorical_encoding,
            standardize=cfg.standardize,
            mean=mean if cfg.standardize else [],
            std=[float(v) for v in std] if cfg.standardize else [],
            fill=mean if cfg.nan == "mean" else [],
            vocab={c: sorted(v) for c, v in self.vocab.items()},
            classes={t: sorted(v) for t, v in self.classes.items()},
        )


# --- fitted once, shared ------------------------------------------------------------------------


def load_or_fit(
    ctx: DataContext, plan: Plan, cfg: DataConfig, fit: Callable[[], Preprocess]
) -> tuple[Preprocess, bool]:
    """(the saved preprocessing of a resumed run, True), or (a fresh fit, False) saved by rank 0."""
    path = preprocess_path(ctx)
    if path is not None and path.exists():
        pre = Preprocess.load(path)
        pre.check(plan, cfg, path)
        return pre, True
    pre = fit()
    if path is not None and ctx.rank == 0:
        pre.save(path)
    return pre, False


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
