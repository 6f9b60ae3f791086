"""Exporters and the report: Prometheus while live, TensorBoard scalars, trace spans, `vatra report`."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.conftest import small_config, vatra_in_process

from vatra.engine import Plugin, Trainer
from vatra.launch import free_port
from vatra.monitor import (
    JsonlWriter,
    Monitor,
    PrometheusExporter,
    StepTracer,
    TensorBoardWriter,
)
from vatra.resilience.chaos import TrainingFaults
from vatra.resilience.heal import Healer
from vatra.rundir import RunDir, read_jsonl


class Scrape(Plugin):
    """Reads the /metrics page at one step, while the run is live."""

    def __init__(self, url: str, at: int) -> None:
        self.url, self.at, self.page = url, at, ""

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        if metrics["step"] == self.at:
            with urllib.request.urlopen(self.url, timeout=10) as resp:
                self.page = resp.read().decode()


def _run(tmp_path: Path, plugins: list[Plugin], **sections: Any) -> RunDir:
    torch.set_num_threads(1)
    cfg = small_config(**{"train": {"steps": 40, "batch_size": 16}, **sections})
    run_dir = RunDir(tmp_path / "run").create()
    Trainer.from_config(cfg, plugins=[*plugins, JsonlWriter(run_dir)], run_dir=run_dir).fit()
    return run_dir


def test_prometheus_serves_metrics_while_the_run_is_live(tmp_path: Path) -> None:
    port = free_port()
    cfg = small_config(monitor={"prometheus_port": port, "gather_every": 5})
    scrape = Scrape(f"http://127.0.0.1:{port}/metrics", at=20)
    _run(tmp_path, [Monitor(cfg), PrometheusExporter(cfg.monitor), scrape])
    assert "vatra_step 20.0" in scrape.page
    assert "vatra_loss " in scrape.page and "vatra_grad_norm " in scrape.page
    assert 'vatra_step_phase_seconds{phase="forward_backward"}' in scrape.page
    assert 'vatra_rank_step_seconds{kind="compute",rank="0"}' in scrape.page


def test_tensorboard_files_hold_the_scalars(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = small_config(monitor={"system_every": 5, "module_grad_norms": True})
    run_dir = RunDir(tmp_path / "run").create()
    _run(tmp_path, [Monitor(cfg), TensorBoardWriter(run_dir)])
    acc = EventAccumulator(str(run_dir.tb))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/grad_norm", "train/compute_time_s", "train/cpu_percent"} <= tags
    assert {"train/grad_norm/trunk", "train/grad_norm/head"} <= tags  # the MLP's trunk and head
    assert len(acc.Scalars("train/loss")) == 40


def test_trace_spans_cover_each_step_phase(tmp_path: Path) -> None:
    cfg = small_config(monitor={"tracing": True})
    run_dir = _run(tmp_path, [StepTracer(cfg.monitor, tmp_path / "run")])
    spans = [json.loads(line) for line in (run_dir.path / "traces" / "rank0.jsonl").read_text().splitlines()]
    steps = [s for s in spans if s["name"] == "train_step"]
    assert len(steps) == 40
    children = [s for s in spans if s["parent_id"] == steps[0]["context"]["span_id"]]
    assert sorted(c["name"] for c in children) == ["data_wait", "forward_backward", "optimizer"]


def test_report_command_writes_a_self_contained_page(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = small_config(
        train={"steps": 150, "batch_size": 32},
        monitor={"warmup_steps": 30},
        chaos={"inject_nan_at": [120]},
    )
    run_dir = _run(tmp_path, [TrainingFaults(cfg.chaos), Monitor(cfg), Healer(cfg)], **cfg.model_dump())
    kinds = {e.get("action") or e["event"] for e in read_jsonl(run_dir.events)}
    assert {"chaos", "anomaly", "skip_update", "rollback"} <= kinds
    code, _, err = vatra_in_process(capsys, "report", str(run_dir.path))
    assert code == 0, err
    page = (run_dir.path / "report.html").read_text()
    assert page.count("<img") >= 6 and page.count("data:image/png;base64,") == page.count("<img")
    assert "src='http" not in page and 'src="http' not in page  # opens offline
    assert "rollback" in page and "non-finite gradient norm" in page


def test_report_on_a_folder_that_is_not_a_run_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = vatra_in_process(capsys, "report", str(tmp_path))
    assert code == 2
    assert err.startswith("error:") and "not a run folder" in err
    assert "Traceback" not in err
