"""The run report after training: it draws a run resumed on another world size, and its failure
never fails the run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import vatra
from vatra.monitor.report import _per_rank, write_report
from vatra.rundir import read_jsonl

pytest.importorskip("matplotlib")


def _write_run(folder: Path, world_sizes: list[tuple[int, int]]) -> None:
    """metrics.jsonl as the monitor logs it: a row per step, per-rank lists every 10 steps (and at
    the last), from steps 1..end for each (end, world size) in turn (a resume changes the size)."""
    rows, start = [], 1
    for end, world in world_sizes:
        for step in range(start, end + 1):
            row: dict[str, object] = {"step": step, "loss": 2.0 / step, "step_time_s": 0.01, "lr": 1e-3}
            if step % 10 == 1 or step == end:
                row["rank_step_time_s"] = [0.01 * (r + 1) for r in range(world)]
                row["rank_compute_time_s"] = [0.008 * (r + 1) for r in range(world)]
                row["straggler_ratio"] = 1.0
            rows.append(row)
        start = end + 1
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "events.jsonl").write_text(json.dumps({"time": 0, "event": "resumed", "step": 60}) + "\n")


def test_per_rank_panels_draw_a_run_resumed_on_fewer_ranks(tmp_path: Path) -> None:
    # Prepare: 60 steps on 4 ranks, then resumed to 100 on 2 (what `vatra train --nproc 4` then
    # `--nproc 2` on one run folder logs), and the same 100 steps on 4 ranks throughout.
    _write_run(tmp_path / "resized", [(60, 4), (100, 2)])
    _write_run(tmp_path / "same", [(100, 4)])
    # Execute
    resized = write_report(tmp_path / "resized").read_text()
    same = write_report(tmp_path / "same").read_text()
    # Assert: both pages have every panel; the per-rank view keeps four ranks, ranks 2-3 absent
    # (NaN: a gap in their lines) after the resume and ranks 0-1 drawn throughout.
    assert resized.count("<img") == same.count("<img")
    xs, mat = _per_rank(read_jsonl(tmp_path / "resized" / "metrics.jsonl"), "step", "rank_step_time_s")
    assert xs.tolist() == [1, 11, 21, 31, 41, 51, 60, 61, 71, 81, 91, 100]
    assert mat.shape == (12, 4)
    assert np.isfinite(mat[:7]).all() and np.isfinite(mat[7:, :2]).all() and np.isnan(mat[7:, 2:]).all()
    np.testing.assert_allclose(mat[-1, :2], [0.01, 0.02])


def test_per_rank_values_that_are_not_numbers_are_gaps(tmp_path: Path) -> None:
    rows = [{"step": 1, "rank_step_time_s": [0.1, None, "x"]}, {"step": 2, "rank_step_time_s": []}]
    xs, mat = _per_rank(rows, "step", "rank_step_time_s")
    assert xs.tolist() == [1, 2] and mat.shape == (2, 3)
    assert mat[0, 0] == 0.1 and np.isnan(mat[0, 1:]).all() and np.isnan(mat[1]).all()


def test_a_report_that_fails_does_not_fail_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare: a report that raises, as the per-rank panel did on a resized run.
    def broken(*args: object, **kwargs: object) -> Path:
        raise ValueError("inhomogeneous shape")

    monkeypatch.setattr("vatra.monitor.report.write_report", broken)
    cfg = {
        "run": {"progress": "off", "tensorboard": False},
        "data": {"name": "digits"},
        "model": {"name": "mlp", "hidden": [16]},
        "train": {"steps": 4, "batch_size": 8, "eval_every": 0},
        "monitor": {"report": True},
        "checkpoint": {"enabled": False},
    }
    # Execute: the run ends normally (no exception: a launched worker would exit 0).
    result = vatra.fit(cfg, run_dir=tmp_path / "run")
    # Assert: the summary is written, the failure is an event and one warning line.
    assert result.summary["steps"] == 4
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 4
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    failed = [e for e in events if e["event"] == "report_failed"]
    assert [e["error"] for e in failed] == ["ValueError: inhomogeneous shape"]
    assert not any(e["event"] == "failure" for e in events)
    warnings = [line for line in capsys.readouterr().out.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "report failed: ValueError: inhomogeneous shape" in warnings[0]
    assert not (tmp_path / "run" / "report.html").exists()


def test_an_exporter_that_fails_to_stop_does_not_fail_the_run(capsys: pytest.CaptureFixture[str]) -> None:
    from types import SimpleNamespace

    from vatra.config import MonitorConfig
    from vatra.monitor.exporters import PrometheusExporter

    class StuckServer:
        def shutdown(self) -> None:
            raise OSError("socket already closed")

    events: list[tuple[str, dict[str, object]]] = []
    exporter = PrometheusExporter(MonitorConfig())
    exporter.server = StuckServer()
    trainer = SimpleNamespace(log_event=lambda kind, **fields: events.append((kind, fields)))
    exporter.on_fit_end(trainer, {})
    assert events == [("exporter_failed", {"error": "OSError: socket already closed"})]
    assert capsys.readouterr().out.count("vatra: warning: exporter failed") == 1


def test_a_first_report_on_a_loaded_machine_leaves_the_console_to_the_run(tmp_path: Path) -> None:
    # Prepare: a run folder, and a new user's matplotlib: no font cache yet. Building it takes long
    # enough on a loaded machine that matplotlib says so (after 5 s): here its timer fires at once.
    import os
    import subprocess
    import sys

    _write_run(tmp_path / "run", [(30, 2)])
    slow_machine = (
        "import threading\n"
        "timer = threading.Timer\n"
        "threading.Timer = lambda interval, fn, *a, **k: timer(0, fn, *a, **k)\n"
        "from vatra.monitor.report import write_report\n"
        f"write_report({str(tmp_path / 'run')!r})\n"
    )
    env = {**os.environ, "MPLCONFIGDIR": str(tmp_path / "mpl"), "PYTHONPATH": os.pathsep.join(sys.path)}
    # Execute
    done = subprocess.run([sys.executable, "-c", slow_machine], env=env, capture_output=True, text=True)
    # Assert: the page is written and nothing of matplotlib's reached the console
    assert done.returncode == 0, done.stderr[-2000:]
    assert any((tmp_path / "mpl").glob("fontlist*"))  # the cache was built here, first
    assert done.stderr == "" and done.stdout == "", done.stderr
    assert (tmp_path / "run" / "report.html").is_file()
