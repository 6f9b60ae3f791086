"""Streaming Parquet (``data.streaming = true``): batches read row group by row group, never the whole table.

Units are Parquet row groups, numbered across all files in sorted file order. Of the
``readers = world_size × max(workers, 1)`` readers, reader ``r`` owns the row groups ``g`` with
``g % readers == r``. In epoch ``e`` a reader visits its row groups in the order
``default_rng([seed, e, r]).permutation`` and the rows of row group ``g`` in the order
``default_rng([seed, e, g]).permutation`` (file order without shuffling), and fills every batch
across row-group (and, for endless streams, epoch) boundaries.

A reader's position is ``{"slot": s, "epoch": e, "index": i, "row": j, "left": b}``: the next row
it reads is row ``j`` (in that row group's visiting order, among the rows of this split) of the
``i``-th row group of epoch ``e``'s order, and ``b`` batches of the block it was sending are still
due. Positions are always settled: ``j`` is inside the row group, and an endless stream's position
past its last row group is the start of the next epoch.

Validation rows are ``data.split_column == "val"`` or those whose splitmix64 hash of
``(seed, global row index)`` falls below ``data.val_fraction``; the preprocessing is fitted by one
pass over the training rows on rank 0 (:mod:`vatra.data.tabular.preprocess`), broadcast, and saved.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
from collections import deque
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

from vatra.config import DataConfig
from vatra.data._base import DataContext, Datasets, StreamDataset, on_rank0
from vatra.data.tabular.files import PARQUET, arrow, row_groups
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
from vatra.data.tabular.split import SplitRule
from vatra.errors import ConfigError

if TYPE_CHECKING:
    import pyarrow as pa


# Row groups read and preprocessed ahead, each by its own thread: preprocessing costs about as much
# CPU as pyarrow's decoding, so overlapping them helps where a core is free. Loader workers share
# the cores among themselves, so each runs fewer threads.
def _ahead() -> int:
    cores, info = os.cpu_count() or 2, get_worker_info()
    if info is None:
        return max(2, min(4, cores // 2))
    return max(1, min(4, cores // (2 * info.num_workers)))


def _is_string(t: pa.DataType) -> bool:
    pa = arrow()
    return bool(pa.types.is_string(t) or pa.types.is_large_string(t))


class ParquetStream(StreamDataset):
    """Batches of one split (train or val) of Parquet files, read row group by row group.

    Picklable: the Parquet files are opened inside ``__iter__`` (in the loader worker), never here.
    """

    def __init__(
        self,
        files: list[str],
        groups: np.ndarray,
        counts: np.ndarray,
        preprocess: Preprocess,
        plan: Plan,
        *,
        split: str,
        rule: SplitRule,
        nan: str,
    ) -> None:
        self.files = files
        self.groups = groups  # (G, 4): file, row group, rows, first global row
        self.counts = counts  # (G,): rows of this split in each row group
        self.preprocess = preprocess
        self.plan = plan
        self.split = split
        self.rule = rule
        self.nan = nan
        self._setup: dict[str, Any] | None = None
        self._rows_of: dict[int, np.ndarray] = {}  # row group -> its rows of this split (computed once)
        self._positions: dict[int, tuple[int, int, int]] = {}
        self._rotate = 0

    # -- the StreamDataset protocol ----------------------------------------------------------

    def configure(
        self,
        *,
        rank: int,
        world_size: int,
        workers: int,
        batch_size: int,
        seed: int,
        shuffle: bool,
        endless: bool,
    ) -> None:
        slots = max(workers, 1)
        readers = world_size * slots
        if len(self.groups) < readers:
            raise ConfigError(
                f"data.streaming: {len(self.groups)} Parquet row groups cannot feed {readers} readers "
                f"({world_size} ranks × {slots} loader workers); write smaller row groups or use fewer "
                "ranks or data.workers"
            )
        self._setup = {
            "rank": rank,
            "slots": slots,
            "readers": readers,
            "batch_size": batch_size,
            "seed": seed,
            "shuffle": shuffle,
            "endless": endless,
        }
        self._positions, self._rotate = {}, 0
        if endless:
            empty = [s for s in range(slots) if not self.counts[self._owned(s)].sum()]
            if empty:
                raise ConfigError(
                    f"data.streaming: rank {rank}'s reader {empty[0]} has no {self.split} rows in its row "
                    "groups; write smaller row groups or use fewer ranks or data.workers"
                )

    def resume(self, positions: Mapping[int, dict[str, Any]], rotate: int) -> None:
        self._positions = {
            int(s): (int(p["epoch"]), int(p["index"]), int(p["row"])) for s, p in positions.items()
        }
        self._rotate = int(rotate)

    def rows_per_epoch(self) -> int:
        setup = self._configured()
        return int(sum(self.counts[self._owned(s)].sum() for s in range(setup["slots"])))

    def __iter__(self) -> Iterator[tuple[Any, Any, list[dict[str, Any]]]]:
        setup = self._configured()
        info = get_worker_info()
        if info is not None and info.num_workers != setup["slots"]:
            raise ConfigError(
                f"data.workers: the stream was configured for {setup['slots']} loader workers but the "
                f"DataLoader runs {info.num_workers}"
            )
        if info is None:
            return self._round_robin(setup["slots"])
        return self._read((info.id + self._rotate) % setup["slots"])

    # -- reading -----------------------------------------------------------------------------

    def _round_robin(self, slots: int) -> Iterator[tuple[Any, Any, list[dict[str, Any]]]]:
        """Read in the trainer's process: every slot, served in turn the way the DataLoader serves
        its workers (a finished slot drops out)."""
        readers = [self._read((p + self._rotate) % slots) for p in range(slots)]
        while readers:
            for reader in list(readers):
                try:
                    yield next(reader)
                except StopIteration:
                    readers.remove(reader)

    def _configured(self) -> dict[str, Any]:
        if self._setup is None:
            raise RuntimeError("ParquetStream: call configure() before reading or counting")
        return self._setup

    def _owned(self, slot: int) -> np.ndarray:
        """The row groups of this rank's logical ``slot``."""
        setup = self._configured()
        return np.arange(setup["rank"] * setup["slots"] + slot, len(self.groups), setup["readers"])

    def _order(self, slot: int, epoch: int) -> np.ndarray:
        setup, owned = self._configured(), self._owned(slot)
        if not setup["shuffle"]:
            return owned
        reader = setup["rank"] * setup["slots"] + slot
        return np.random.default_rng([setup["seed"], epoch, reader]).permutation(owned)

    def _settle(
        self, slot: int, at: tuple[int, int, int], order: np.ndarray
    ) -> tuple[tuple[int, int, int], np.ndarray]:
        """The position ``at`` moved past exhausted row groups; an endless stream rolls into the next
        epoch (and its order). Past the end of a finite stream, ``index == len(order)``."""
        epoch, index, row = at
        while True:
            while index < len(order) and row >= self.counts[order[index]]:
                index, row = index + 1, 0
            if index < len(order) or not self._configured()["endless"]:
                return (epoch, index, row), order
            epoch, index, row = epoch + 1, 0, 0
            order = self._order(slot, epoch)

    def _upcoming(self, slot: int, at: tuple[int, int, int]) -> Iterator[tuple[int, int]]:
        """(epoch, row group) of every row group still to visit from position ``at``, in order."""
        (epoch, index, _), order = self._settle(slot, at, self._order(slot, at[0]))
        while index < len(order):
            yield epoch, int(order[index])
            (epoch, index, _), order = self._settle(slot, (epoch, index + 1, 0), order)

    def _read(self, slot: int) -> Iterator[tuple[Any, Any, list[dict[str, Any]]]]:
        """This slot's batches as blocks: per row group, the batch that began in earlier row groups
        and ends in this one (a block of its own), then every batch that lies inside it (one
        block, views of the row group's rows: no copy). A block is thus a function of the data
        position alone, so a resumed slot cuts the same blocks; and each item crossing to the
        trainer's process from a loader worker costs about a millisecond however small it is."""
        for fields, ends in self._blocks(slot):
            inputs, target = self.preprocess.pack({k: torch.from_numpy(v) for k, v in fields.items()})
            positions = [
                {"slot": slot, "epoch": e, "index": i, "row": r, "left": len(ends) - 1 - n}
                for n, (e, i, r) in enumerate(ends)
            ]
            yield inputs, target, positions

    def _blocks(self, slot: int) -> Iterator[tuple[Fields, list[tuple[int, int, int]]]]:
        """(numpy fields of one or more whole batches, the position after each batch)."""
        setup = self._configured()
        size = setup["batch_size"]
        at = self._positions.get(slot, (0, 0, 0))
        at, order = self._settle(slot, at, self._order(slot, at[0]))
        # Threads read, shuffle and preprocess the next row groups (pyarrow and numpy release the
        # GIL); this generator only slices batches out of finished ones. Each thread opens its own
        # files.
        threads = _ahead()
        pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="vatra-parquet")
        local = threading.local()
        buffers = _Buffers()
        upcoming = self._upcoming(slot, at)
        ahead: deque[tuple[tuple[int, int], Future[Fields]]] = deque()
        carry: list[Fields] = []  # rows of a batch begun in earlier row groups
        carried = 0
        try:
            while at[1] < len(order):
                epoch, index, row = at
                g = int(order[index])
                for key in itertools.islice(upcoming, threads - len(ahead)):
                    ahead.append((key, pool.submit(self._load, key[1], key[0], local, buffers)))
                key, job = ahead.popleft()
                assert key == (epoch, g), (key, epoch, g)
                group, n = job.result(), int(self.counts[g])
                if carried:  # finish the batch that began in earlier row groups
                    take = min(size - carried, n - row)
                    carry.append({k: v[row : row + take] for k, v in group.items()})
                    carried, row = carried + take, row + take
                    if carried == size:
                        done = {k: np.concatenate([c[k] for c in carry]) for k in group}
                        at, order = self._settle(slot, (epoch, index, row), order)
                        yield self._checked(done, slot, epoch), [at]
                        carry, carried = [], 0
                full = (n - row) // size
                if full:
                    ends = []
                    for j in range(1, full + 1):
                        end, order = self._settle(slot, (epoch, index, row + j * size), order)
                        ends.append(end)
                    block = {k: v[row : row + full * size] for k, v in group.items()}
                    yield self._checked(block, slot, epoch), ends
                    row += full * size
                if row < n:
                    carry.append({k: v[row:n] for k, v in group.items()})
                    carried += n - row
                at, order = self._settle(slot, (epoch, index, n), order)
            if carried:  # the end of a finite stream: one short batch
                yield (
                    self._checked({k: np.concatenate([c[k] for c in carry]) for k in carry[0]}, slot, at[0]),
                    [at],
                )
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    @staticmethod
    def _checked(fields: Fields, slot: int, epoch: int) -> Fields:
        for v in fields.values():  # NaN propagates through max: one cheap pass per field
            if v.dtype.kind == "f" and v.size and np.isnan(v.max()):
                raise ConfigError(
                    f"data.nan: reader {slot} met missing values (NaN) in epoch {epoch} that the fitted "
                    "preprocessing did not see (has the data changed?); set data.nan = 'drop' or 'mean'"
                )
        return fields

    def _rows(self, table: pa.Table, g: int) -> np.ndarray:
        """Rows of row group ``g`` in this split (missing values dropped or refused), in file order;
        worked out on the first visit and kept (the file must not change during a run)."""
        if g in self._rows_of:
            return self._rows_of[g]
        n = int(self.groups[g, 2])
        keep = self.rule.val_rows(table, int(self.groups[g, 3]), n) == (self.split == "val")
        if self.nan == "drop":
            drop, _ = check_missing(table, self.plan, self.nan)
            if drop is not None:
                keep &= ~drop
        elif any(col.null_count for col in table.columns):  # O(1) per column; NaN is found in _load
            _, missing = check_missing(table, self.plan, self.nan)
            if missing:
                raise missing_error(missing, n, self.plan, self.nan)
        rows = np.flatnonzero(keep)  # intp: np.take converts any other index type on every call
        if len(rows) == self.counts[g]:  # a mismatch is reported by the caller on every visit
            self._rows_of[g] = rows
        return rows

    def _load(self, g: int, epoch: int, local: threading.local, buffers: _Buffers) -> Fields:
        """The batch fields of row group ``g``'s rows of this split, in epoch ``epoch``'s visiting
        order, in recycled arrays (batches are views of them: see :class:`_Buffers`)."""
        import pyarrow.parquet as pq

        f, rg = int(self.groups[g, 0]), int(self.groups[g, 1])
        opened = local.__dict__.setdefault("files", {})
        if f not in opened:
            # string categories read as dictionaries: ids are looked up per distinct value
            schema = pq.read_schema(self.files[f])
            strings = [c for c in self.plan.categorical if _is_string(schema.field(c).type)]
            opened[f] = pq.ParquetFile(self.files[f], read_dictionary=strings)
        table = opened[f].read_row_group(rg, columns=self.plan.needed)
        rows = self._rows(table, g)
        if len(rows) != self.counts[g]:
            raise ConfigError(
                f"data.path: {self.files[f]} changed while training: row group {rg} has {len(rows)} "
                f"{self.split} rows, {self.counts[g]} when the stream was built"
            )
        setup = self._configured()
        if setup["shuffle"]:
            rows = np.take(rows, np.random.default_rng([setup["seed"], epoch, g]).permutation(len(rows)))
        num = buffers.get((table.num_rows, len(self.preprocess.features)), np.dtype(np.float32))
        encoded = self.preprocess.encode(table, num_out=num)
        return self.preprocess.batch([(encoded, rows)], alloc=buffers.get)  # batches are views of it


class _Buffers:
    """Recycled arrays for row groups' fields, shared by a reader's threads: a fresh multi-MB array
    per row group costs more in page faults than the work done in it.

    ``get`` hands out an array no one refers to any more: batches are views of the gathered rows
    (numpy views, and the tensors made from them, hold a reference to their base array), so an
    array is free again once every batch cut from it is gone, whoever held on to them.
    """

    def __init__(self) -> None:
        self.arrays: list[np.ndarray] = []
        self.lock = threading.Lock()

    def get(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        with self.lock:
            for buf in self.arrays:
                fits = buf.shape[0] >= shape[0] and buf.shape[1:] == shape[1:] and buf.dtype == dtype
                # referred to by self.arrays, this loop and getrefcount's argument only: unused
                if fits and sys.getrefcount(buf) <= 3:
                    return buf[: shape[0]]
            buf = np.empty(shape, dtype=dtype)
            self.arrays.append(buf)
            return buf


def _scan(
    files: list[str], groups: np.ndarray, plan: Plan, cfg: DataConfig, rule: SplitRule, fitter: Fitter | None
) -> np.ndarray:
    """One pass over the row groups: (G, 2) rows of train and val in each; feeds ``fitter`` the
    training rows when given. Reads only the columns the split and ``data.nan`` need when not fitting."""
    import pyarrow.parquet as pq

    counts = np.zeros((len(groups), 2), dtype=np.int64)
    if fitter is None:
        columns = list(
            dict.fromkeys([rule.column] * bool(rule.column) + (plan.needed if cfg.nan == "drop" else []))
        )
    else:
        columns = plan.needed
    missing: dict[str, int] = {}
    opened: dict[int, Any] = {}
    for g, (f, rg, n, start) in enumerate(groups.tolist()):
        table = None
        if columns:
            if f not in opened:
                opened[f] = pq.ParquetFile(files[f])
            table = opened[f].read_row_group(rg, columns=columns)
        val = rule.val_rows(table, start, n)
        if fitter is not None or cfg.nan == "drop":
            assert table is not None
            drop, bad = check_missing(table, plan, cfg.nan)
            for c, k in bad.items():
                missing[c] = missing.get(c, 0) + k
            if drop is not None:
                table, val = table.filter(arrow().array(~drop)), val[~drop]
            if fitter is not None and not missing:
                fitter.update(table, ~val)
        counts[g] = (int((~val).sum()), int(val.sum()))
    if missing:
        raise missing_error(missing, int(groups[:, 2].sum()), plan, cfg.nan)
    return counts


def build_stream(cfg: DataConfig, ctx: DataContext, files: list[str], plan: Plan) -> Datasets:
    """Train and val :class:`ParquetStream` of the Parquet ``files`` (one fitting pass on rank 0)."""
    if plan.group:
        raise ConfigError(
            "data.streaming: ranking lists (data.group) cannot be streamed; set data.streaming = false"
        )
    csv = [f for f in files if not f.lower().endswith(PARQUET)]
    if csv:
        raise ConfigError(
            f"data.streaming reads Parquet only, and {csv[0]} is CSV; convert it to Parquet "
            "(pyarrow.parquet.write_table(pyarrow.csv.read_csv(path), out, row_group_size=...))"
        )
    groups = row_groups(files)
    rule = SplitRule(cfg.split_column, cfg.val_fraction, ctx.seed)

    def fit_and_count() -> tuple[Preprocess, np.ndarray]:
        scanned: list[np.ndarray] = []

        def fit() -> Preprocess:
            fitter = Fitter(plan, cfg)
            scanned.append(_scan(files, groups, plan, cfg, rule, fitter))
            return fitter.result()

        pre, reused = load_or_fit(ctx, plan, cfg, fit)
        return pre, _scan(files, groups, plan, cfg, rule, None) if reused else scanned[0]

    pre, counts = on_rank0(ctx, fit_and_count)
    if not counts[:, 0].sum():
        raise ConfigError(f"data.path: no training rows in {len(files)} Parquet file(s)")
    streams = [
        ParquetStream(files, groups, counts[:, i].copy(), pre, plan, split=split, rule=rule, nan=cfg.nan)
        for i, split in enumerate(("train", "val"))
    ]
    return Datasets(streams[0], streams[1] if counts[:, 1].sum() else None, table_spec(pre))
