"""The trainer's loader: streams over ranks × loader workers, exact resume, map-style order and prefetch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from vatra.config import DataConfig
from vatra.data import DataContext, ShardSampler, Split, build_dataset
from vatra.data.loader import MapBatches, StreamBatches

CPU = torch.device("cpu")
WORLD, WORKERS, BATCH = 2, 2, 8
# 16 row groups of 40 rows, every 5th row held out: each of the 4 readers (2 ranks × 2 workers) owns
# 4 row groups = 128 training rows = 16 batches per epoch, sent in blocks of 4 batches (32 rows).
GROUPS, GROUP_ROWS = 16, 40


def _table(path: Path) -> None:
    n = GROUPS * GROUP_ROWS
    rng = np.random.default_rng(0)
    table = pa.table(
        {
            "id": np.arange(n, dtype=np.float64),
            "a": rng.normal(size=n),
            "b": rng.normal(size=n),
            "split": np.where(np.arange(n) % 5 == 0, "val", "train"),
        }
    )
    pq.write_table(table, path, row_group_size=GROUP_ROWS)


def _batches(path: Path, rank: int, run_dir: Path) -> StreamBatches:
    cfg = DataConfig(
        name="table", path=str(path), target="id", features=["a", "b"], split_column="split", streaming=True
    )
    train, _, _ = build_dataset(cfg, DataContext(seed=5, rank=rank, world_size=WORLD, run_dir=run_dir))
    return StreamBatches(
        train,
        rank=rank,
        world_size=WORLD,
        batch_size=BATCH,
        seed=5,
        workers=WORKERS,
        prefetch_factor=2,
        device=CPU,
    )


def _ids(batches: StreamBatches, n: int) -> list[list[int]]:
    return [batches.next()[1].long().tolist() for _ in range(n)]


def test_stream_over_2_ranks_x_2_workers_reads_every_row_once_per_epoch(tmp_path: Path) -> None:
    # Prepare
    _table(tmp_path / "t.parquet")
    ranks = [_batches(tmp_path / "t.parquet", r, tmp_path / "run") for r in range(WORLD)]
    assert [b.stream.rows_per_epoch() for b in ranks] == [256, 256]

    # Execute: one epoch (32 batches) on each rank, then the next epoch's first half
    epochs = [[i for batch in _ids(b, 32) for i in batch] for b in ranks]
    following = [[i for batch in _ids(b, 16) for i in batch] for b in ranks]
    for b in ranks:
        b.close()

    # Assert: every training row exactly once across ranks per epoch, no validation row, a new order
    seen = epochs[0] + epochs[1]
    assert sorted(seen) == [i for i in range(GROUPS * GROUP_ROWS) if i % 5]
    assert len(set(following[0] + following[1])) == 256
    assert following[0] != epochs[0][:128]


def test_stream_resumes_mid_block_without_repeats_or_gaps(tmp_path: Path) -> None:
    # Prepare: an uninterrupted reference of 23 batches (blocks of 4 per worker, round-robin)
    _table(tmp_path / "t.parquet")
    ref = _batches(tmp_path / "t.parquet", 1, tmp_path / "run")
    reference = _ids(ref, 23)
    ref.close()

    # Execute: stop after 7 batches (3 of worker 1's first block), save, resume in a new loader
    first = _batches(tmp_path / "t.parquet", 1, tmp_path / "run")
    head = _ids(first, 7)
    state = first.state_dict()
    first.close()
    resumed = _batches(tmp_path / "t.parquet", 1, tmp_path / "run")
    resumed.load_state_dict(state)
    tail = _ids(resumed, 16)
    resumed.close()

    # Assert: batch for batch the uninterrupted sequence
    assert state["positions"][1]["left"] == 1 and state["next_slot"] == 1
    assert head + tail == reference


def test_stream_state_refuses_another_worker_count(tmp_path: Path) -> None:
    _table(tmp_path / "t.parquet")
    b = _batches(tmp_path / "t.parquet", 0, tmp_path / "run")
    b.next()
    state = b.state_dict()
    b.close()
    cfg = DataConfig(
        name="table", path=str(tmp_path / "t.parquet"), target="id", split_column="split", streaming=True
    )
    train, _, _ = build_dataset(cfg, DataContext(seed=5, rank=0, world_size=WORLD, run_dir=tmp_path / "run"))
    other = StreamBatches(
        train, rank=0, world_size=WORLD, batch_size=BATCH, seed=5, workers=0, prefetch_factor=2, device=CPU
    )
    try:
        other.load_state_dict(state)
    except ValueError as err:
        assert "data.workers = 2" in str(err) and "data.workers = 0" in str(err)
    else:
        raise AssertionError("a stream saved with 2 workers resumed with 0")


class _Items(torch.utils.data.Dataset):
    """A map-style dataset a user would write: item i = (x_i, i), collated by the DataLoader."""

    def __init__(self, n: int) -> None:
        self.x = torch.randn(n, 3)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, Any]:
        return self.x[i], i


def _map(ds: Any, workers: int, depth: int = 0) -> MapBatches:
    sampler = ShardSampler(np.arange(len(ds)), 16, seed=3)
    batches = MapBatches(ds, sampler, workers=workers, prefetch_factor=2, device=CPU)
    if depth:
        batches.prefetch(depth)
    return batches


def test_map_style_batches_are_the_samplers_order_with_workers_prefetch_and_after_a_jump() -> None:
    # Prepare: the same sampler order read in process, by 2 loader workers, and by prefetch threads
    ds = _Items(200)
    reference = ShardSampler(np.arange(200), 16, seed=3)
    want = [reference.next_batch().tolist() for _ in range(30)]
    readers = [_map(ds, 0), _map(ds, 2), _map(ds, 0, depth=3)]

    # Execute and Assert: identical batches; the saved position is the consumed one
    for batches in readers:
        got = [batches.next()[1].tolist() for _ in range(20)]
        assert got == want[:20]
        assert batches.state_dict()["position"] == (20 * 16) % 200 and batches.state_dict()["epoch"] == 1
        batches.load_state_dict({**batches.state_dict(), "epoch": 0, "position": 0})  # a rollback
        assert batches.next()[1].tolist() == want[0]
        batches.close()


def test_a_batched_dataset_is_fetched_once_per_batch() -> None:
    calls: list[int] = []
    split = Split(torch.randn(64, 2), torch.arange(64))
    fetch = split.get_batch

    def counted(idx: Any) -> Any:
        calls.append(len(idx))
        return fetch(idx)

    split.get_batch = counted  # type: ignore[method-assign]
    batches = _map(split, 0)
    for _ in range(5):
        batches.next()
    assert calls == [16] * 5
