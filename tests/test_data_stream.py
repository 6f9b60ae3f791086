"""Streaming Parquet: each (rank, loader worker) reads its own row groups, resumes exactly, and
applies the same fitted preprocessing as the in-memory table."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import DataLoader

from vatra.config import DataConfig
from vatra.data import DataContext, ParquetStream
from vatra.data.loader import split_rows
from vatra.data.tabular import build_table
from vatra.errors import ConfigError

GROUPS, GROUP_ROWS = 16, 10
WORLD, WORKERS = 2, 2


def _write(path: Path, n_groups: int = GROUPS, split: bool = True) -> pa.Table:
    """Rows with an id (the regression target, read back unscaled); every 5th row is val."""
    n = n_groups * GROUP_ROWS
    rng = np.random.default_rng(0)
    cols: dict[str, Any] = {
        "id": np.arange(n, dtype=np.float64),
        "a": rng.normal(5.0, 3.0, n),
        "b": rng.integers(0, 100, n),
        "color": rng.choice(["red", "green", "blue"], n),
    }
    if split:
        cols["split"] = np.where(np.arange(n) % 5 == 0, "val", "train")
    table = pa.table(cols)
    pq.write_table(table, path, row_group_size=GROUP_ROWS)
    return table


def _cfg(path: Path, **kw: Any) -> DataConfig:
    base: dict[str, Any] = {
        "target": "id",
        "features": ["a", "b", "color"],
        "categorical": ["color"],
        "split_column": "split",
    }
    return DataConfig(name="table", path=str(path), streaming=True, **{**base, **kw})


def _streams(cfg: DataConfig, rank: int, **conf: Any) -> tuple[ParquetStream, ParquetStream]:
    train, val, _ = build_table(cfg, DataContext(seed=3, rank=rank, world_size=WORLD))
    assert isinstance(train, ParquetStream) and isinstance(val, ParquetStream)
    settings = {"rank": rank, "world_size": WORLD, "workers": WORKERS, "batch_size": 8, "seed": 3}
    settings.update(conf)
    train.configure(**settings, shuffle=True, endless=True)
    val.configure(**{**settings, "workers": 1, "batch_size": 7}, shuffle=False, endless=False)
    return train, val


def _batches(items: Any) -> Any:
    """The batches of a stream's items (blocks of one or more batches), each with its position."""
    for x, y, positions in items:
        parts = len(positions)
        rows = -(-len(y) // parts)  # these tests' blocks hold full batches (or one batch)
        yield from zip(split_rows(x, parts, rows), split_rows(y, parts, rows), positions, strict=True)


def _take(stream: ParquetStream, n: int) -> list[tuple[torch.Tensor, torch.Tensor, dict[str, Any]]]:
    """The first ``n`` batches through a real DataLoader with WORKERS worker processes."""
    loader = DataLoader(stream, batch_size=None, num_workers=WORKERS)
    out = []
    for item in _batches(loader):
        out.append(item)
        if len(out) == n:
            break
    return out


def test_each_training_row_once_per_epoch_across_ranks_and_workers(tmp_path: Path) -> None:
    # Prepare: 16 row groups of 8 training rows; 4 readers own 4 each: 4 batches of 8 per reader
    _write(tmp_path / "t.parquet")
    cfg = _cfg(tmp_path / "t.parquet")
    ranks = [_streams(cfg, r)[0] for r in range(WORLD)]
    per_rank = [s.rows_per_epoch() for s in ranks]

    # Execute: one epoch's worth of batches per rank, and the next epoch's
    epochs = [_take(s, 2 * s.rows_per_epoch() // 8) for s in ranks]

    # Assert
    assert per_rank == [64, 64]
    train_ids = {i for i in range(GROUPS * GROUP_ROWS) if i % 5}
    for half in (0, 1):
        seen = [
            int(v) for batches in epochs for _, y, _ in batches[half * 8 : (half + 1) * 8] for v in y.tolist()
        ]
        assert sorted(seen) == sorted(train_ids)  # every training row once, no val row
    first = [y.tolist() for _, y, _ in epochs[0][:8]]
    second = [y.tolist() for _, y, _ in epochs[0][8:]]
    assert first != second  # a new epoch is a new order
    assert all(p["slot"] == i % WORKERS for i, (_, _, p) in enumerate(epochs[0]))  # round-robin


def test_hashed_split_train_and_val_streams_partition_the_rows(tmp_path: Path) -> None:
    # Prepare: no split column: a row is val by a seeded hash of its index
    _write(tmp_path / "t.parquet", split=False)
    cfg = _cfg(tmp_path / "t.parquet", split_column="", val_fraction=0.25)
    seen: dict[str, list[int]] = {"train": [], "val": []}
    counted = {"train": 0, "val": 0}

    # Execute: finite passes over every reader of every rank
    for rank in range(WORLD):
        train, val = _streams(cfg, rank, workers=1)
        train.configure(
            rank=rank, world_size=WORLD, workers=1, batch_size=8, seed=3, shuffle=True, endless=False
        )
        for name, stream in (("train", train), ("val", val)):
            counted[name] += stream.rows_per_epoch()
            seen[name] += [int(v) for _, y, _ in _batches(stream) for v in y.tolist()]

    # Assert
    n = GROUPS * GROUP_ROWS
    assert sorted(seen["train"] + seen["val"]) == list(range(n))
    assert not set(seen["train"]) & set(seen["val"])
    assert counted == {"train": len(seen["train"]), "val": len(seen["val"])}
    assert 0.1 < len(seen["val"]) / n < 0.4


def test_resume_continues_batch_for_batch(tmp_path: Path) -> None:
    # Prepare: batches of 6 span row groups (8 rows) and, past 32 rows a reader, epochs
    _write(tmp_path / "t.parquet")
    cfg = _cfg(tmp_path / "t.parquet")
    total, k = 14, 5
    reference = _take(_streams(cfg, 1, batch_size=6)[0], total)

    # Execute: stop after k batches, keep the newest position per slot and the next slot to serve
    first = _take(_streams(cfg, 1, batch_size=6)[0], k)
    positions = {p["slot"]: p for _, _, p in first}
    next_slot = k % WORKERS  # the loader serves workers round-robin; this run started at slot 0
    resumed = _streams(cfg, 1, batch_size=6)[0]
    resumed.resume(positions, rotate=next_slot)
    rest = _take(resumed, total - k)

    # Assert: no repeat, no gap: the same batches, in the same order
    joined = first + rest
    assert [p for _, _, p in joined] == [p for _, _, p in reference]
    for (x, y, _), (x_ref, y_ref, _) in zip(joined, reference, strict=True):
        torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
        torch.testing.assert_close(x, x_ref, rtol=0, atol=0)
    assert all(set(p) == {"slot", "epoch", "index", "row", "left"} for _, _, p in joined)
    assert max(p["epoch"] for _, _, p in joined) == 1


def test_stream_applies_the_in_memory_tables_preprocessing(tmp_path: Path) -> None:
    # Prepare
    _write(tmp_path / "t.parquet")
    cfg = _cfg(tmp_path / "t.parquet")
    table = build_table(cfg.model_copy(update={"streaming": False}), DataContext(seed=3))
    train, _ = _streams(cfg, 0, workers=0)

    # Execute: both train sets, ordered by id
    x_mem, y_mem = table.train.get_batch(np.arange(len(table.train)))
    train.configure(rank=0, world_size=1, workers=0, batch_size=16, seed=3, shuffle=True, endless=False)
    batches = list(train)
    x_str = torch.cat([x for x, _, _ in batches])
    y_str = torch.cat([y for _, y, _ in batches])

    # Assert: the same fitted statistics (one pass per row group vs one chunk; float64 sums) and rows
    pre_mem, pre_str = table.train.preprocess, train.preprocess
    np.testing.assert_allclose(pre_str.mean, pre_mem.mean, rtol=1e-12)
    np.testing.assert_allclose(pre_str.std, pre_mem.std, rtol=1e-12)
    assert pre_str.vocab == pre_mem.vocab and pre_str.feature_names == pre_mem.feature_names
    assert table.spec == build_table(cfg, DataContext(seed=3)).spec
    torch.testing.assert_close(y_str.sort().values, y_mem.sort().values, rtol=0, atol=0)
    torch.testing.assert_close(x_str[y_str.argsort()], x_mem[y_mem.argsort()], rtol=1e-6, atol=1e-6)


def test_evaluation_stream_visits_each_val_row_once_and_stops(tmp_path: Path) -> None:
    # Prepare
    _write(tmp_path / "t.parquet")
    cfg = _cfg(tmp_path / "t.parquet")
    vals = [_streams(cfg, r)[1] for r in range(WORLD)]

    # Execute
    batches = [list(_batches(v)) for v in vals]

    # Assert: 16 val rows per rank in batches of 7: 7, 7, 2 (in file order, unshuffled)
    assert [[len(y) for _, y, _ in b] for b in batches] == [[7, 7, 2], [7, 7, 2]]
    ids = sorted(int(i) for b in batches for _, y, _ in b for i in y.tolist())
    assert ids == list(range(0, GROUPS * GROUP_ROWS, 5))
    assert all(v.rows_per_epoch() == 16 for v in vals)


def test_stream_is_picklable_and_saves_preprocessing_once(tmp_path: Path) -> None:
    # Prepare
    _write(tmp_path / "t.parquet")
    run_dir = tmp_path / "run"

    # Execute
    train, _, _ = build_table(_cfg(tmp_path / "t.parquet"), DataContext(run_dir=run_dir))
    copy = pickle.loads(pickle.dumps(train))
    assert isinstance(copy, ParquetStream)
    _write(tmp_path / "t.parquet")  # a resumed run reuses the saved fit and only counts rows
    again, _, _ = build_table(_cfg(tmp_path / "t.parquet"), DataContext(run_dir=run_dir))

    # Assert
    assert (run_dir / "data" / "preprocess.json").exists()
    assert copy.preprocess == train.preprocess == again.preprocess
    np.testing.assert_array_equal(again.counts, train.counts)


def test_only_rank_zero_fits_the_others_receive_its_broadcast(tmp_path: Path, monkeypatch: Any) -> None:
    # Prepare: count the passes over the data; rank 0's broadcast payload is handed to rank 1
    import vatra.data.tabular.stream as stream_module

    _write(tmp_path / "t.parquet")
    passes: list[int] = []
    scan = stream_module._scan

    def counted_scan(*args: Any) -> Any:
        passes.append(1)
        return scan(*args)

    monkeypatch.setattr(stream_module, "_scan", counted_scan)
    sent: list[object] = []

    def rank0_broadcast(obj: object) -> object:
        sent.append(obj)
        return obj

    # Execute
    train0, _, _ = build_table(_cfg(tmp_path / "t.parquet"), DataContext(broadcast=rank0_broadcast))
    ctx1 = DataContext(rank=1, world_size=2, broadcast=lambda obj: sent[0])
    train1, _, _ = build_table(_cfg(tmp_path / "t.parquet"), ctx1)

    # Assert: one pass (rank 0's), the same preprocessing and row counts on both ranks
    assert len(passes) == 1
    assert isinstance(train0, ParquetStream) and isinstance(train1, ParquetStream)
    assert train1.preprocess == train0.preprocess
    np.testing.assert_array_equal(train1.counts, train0.counts)


def test_reading_in_process_serves_the_slots_like_the_loader(tmp_path: Path) -> None:
    # Prepare
    _write(tmp_path / "t.parquet")
    cfg = _cfg(tmp_path / "t.parquet")

    # Execute: data.workers = 2 read by the DataLoader's workers, and in this process
    through_loader = _take(_streams(cfg, 0)[0], 10)
    in_process = []
    for item in _batches(_streams(cfg, 0)[0]):
        in_process.append(item)
        if len(in_process) == 10:
            break

    # Assert
    assert [p for _, _, p in in_process] == [p for _, _, p in through_loader]
    for (_, y, _), (_, y_ref, _) in zip(in_process, through_loader, strict=True):
        torch.testing.assert_close(y, y_ref, rtol=0, atol=0)


def test_missing_values_are_dropped_or_refused(tmp_path: Path) -> None:
    # Prepare: feature 'a' missing in every 7th row
    table = _write(tmp_path / "t.parquet")
    a = table.column("a").to_numpy().copy()
    a[::7] = np.nan
    pq.write_table(table.set_column(1, "a", pa.array(a)), tmp_path / "t.parquet", row_group_size=GROUP_ROWS)

    # Execute
    with pytest.raises(ConfigError, match="'a' \\(23 of 160 rows\\)"):
        build_table(_cfg(tmp_path / "t.parquet"), DataContext())
    train, val, _ = build_table(_cfg(tmp_path / "t.parquet", nan="drop"), DataContext())
    ids = []
    for stream in (train, val):
        assert isinstance(stream, ParquetStream)
        stream.configure(rank=0, world_size=1, workers=0, batch_size=16, seed=0, shuffle=True, endless=False)
        ids += [int(i) for _, y, _ in _batches(stream) for i in y.tolist()]

    # Assert
    assert sorted(ids) == [i for i in range(GROUPS * GROUP_ROWS) if i % 7]
    assert train.rows_per_epoch() + val.rows_per_epoch() == len(ids)


@pytest.mark.parametrize(
    ("make", "kw", "match"),
    [
        ("few", {}, "4 Parquet row groups cannot feed 8 readers \\(2 ranks × 4 loader workers\\)"),
        ("csv", {}, "reads Parquet only.*convert it to Parquet"),
        ("parquet", {"group": "b", "categorical": [], "features": ["a"]}, "ranking lists"),
    ],
)
def test_stream_errors(tmp_path: Path, make: str, kw: dict[str, Any], match: str) -> None:
    # Prepare
    table = _write(tmp_path / "t.parquet", n_groups=4 if make == "few" else GROUPS)
    path = tmp_path / "t.parquet"
    if make == "csv":
        path = tmp_path / "t.csv"
        pcsv.write_csv(table, path)

    # Execute
    with pytest.raises(ConfigError, match=match) as err:
        train, _, _ = build_table(_cfg(path, **kw), DataContext())
        assert isinstance(train, ParquetStream)
        train.configure(rank=0, world_size=2, workers=4, batch_size=8, seed=0, shuffle=True, endless=True)

    # Assert
    assert "\n" not in str(err.value)
