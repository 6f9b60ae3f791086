"""Run-folder writers: metrics.jsonl every step, TensorBoard's per-step scalars every N steps."""

from __future__ import annotations

import json
from contextlib import suppress
from pathlib import Path
from types import SimpleNamespace

import pytest
from tests.conftest import small_config, small_disk

from vatra.engine import Trainer
from vatra.errors import DiskFull
from vatra.monitor import JsonlWriter, TensorBoardWriter
from vatra.rundir import RunDir, append_jsonl, read_jsonl


def test_tensorboard_every_n_steps_keeps_sparse_metrics(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = RunDir(tmp_path / "run").create()
    cfg = small_config(train={"steps": 25, "eval_every": 7})
    plugins = [TensorBoardWriter(run_dir, every=10), JsonlWriter(run_dir)]
    Trainer.from_config(cfg, plugins=plugins, run_dir=run_dir).fit()
    acc = EventAccumulator(str(run_dir.tb))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [10, 20, 25]  # every 10th and the last
    # sparse: when present, and the final evaluation at the last step
    assert [e.step for e in acc.Scalars("val/val_accuracy")] == [7, 14, 21, 25]
    lines = [json.loads(x) for x in run_dir.metrics.read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(1, 26))  # metrics.jsonl: every step
    assert json.loads(run_dir.summary.read_text())["steps"] == 25


def _fill(disk: Path) -> None:
    """Take every free byte of ``disk`` (the file is removed to free the space again)."""
    with (disk / "ballast").open("wb", buffering=0) as f, suppress(OSError):
        while True:
            f.write(b"\0" * 4096)


def test_a_full_disk_leaves_whole_lines_and_one_error_line(tmp_path: Path) -> None:
    """events.jsonl and metrics.jsonl on a disk that fills: the failed write is undone, the error
    names the folder and the fix, and once space is freed the same files go on."""
    with small_disk(tmp_path / "disk", "64k") as disk:
        run_dir = RunDir(disk / "run").create()
        run_dir.log_event("first", note="x" * 100)
        _fill(disk)
        with pytest.raises(
            DiskFull, match=r"no space left on the device holding .*events\.jsonl; free space"
        ):
            run_dir.log_event("second", note="y" * 5000)
        writer = JsonlWriter(run_dir)
        trainer = SimpleNamespace(dist=SimpleNamespace(is_main=True))
        with pytest.raises(DiskFull, match=r"metrics\.jsonl"):
            for step in range(100):  # the page cache may take a few before the disk refuses
                writer.on_step_end(trainer, {"step": step, "pad": "z" * 2000})  # type: ignore[arg-type]
        (disk / "ballast").unlink()
        run_dir.log_event("third")
        writer.on_step_end(trainer, {"step": 100})  # type: ignore[arg-type]
        writer.on_failure(trainer, RuntimeError())  # type: ignore[arg-type]
        events = read_jsonl(run_dir.events)  # every line whole: a half line would raise here
        assert [e["event"] for e in events] == ["first", "third"]
        steps = [m["step"] for m in read_jsonl(run_dir.metrics)]
        assert steps[-1] == 100 and steps == sorted(steps)


def test_a_torn_last_line_is_cut_before_the_next_append(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_bytes(b'{"a": 1}\n{"b": 2')  # a writer killed mid-line
    append_jsonl(path, {"c": 3})
    assert read_jsonl(path) == [{"a": 1}, {"c": 3}]
    path.write_bytes(b'{"a": 1}\n{"b": 2}')  # a whole record that only lacks its newline
    append_jsonl(path, {"c": 3})
    assert read_jsonl(path) == [{"a": 1}, {"b": 2}, {"c": 3}]
