"""Optional features: without their extra installed, one line naming the extra (or a note, for the report)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from tests._dist import ROOT

import vatra
from vatra._extras import MissingExtra
from vatra.cli import main
from vatra.config import DataConfig, MonitorConfig
from vatra.data import build_dataset


def _hide(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    """Make ``import module`` fail as if the package were not installed."""
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)


def test_vatra_report_without_matplotlib_names_the_report_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _hide(monkeypatch, "matplotlib")
    with pytest.raises(SystemExit) as exit_:
        main(["report", str(tmp_path)])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "error: vatra report needs the package 'matplotlib', which is not installed: "
        "pip install 'vatra[report]'"
    )


def test_a_finished_run_without_matplotlib_says_the_report_was_not_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _hide(monkeypatch, "matplotlib")
    config = {
        "run": {"progress": "off", "tensorboard": False},
        "train": {"steps": 3, "eval_every": 0},
        "checkpoint": {"enabled": False},
        "monitor": {"fit_in": "thread"},
    }
    result = vatra.fit(config, run_dir=tmp_path / "run")
    assert result.summary["steps"] == 3
    assert "report.html not written: report.html needs the package 'matplotlib'" in capsys.readouterr().out
    assert not (tmp_path / "run" / "report.html").exists()


def test_table_data_without_pyarrow_names_the_tables_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "t.parquet").write_bytes(b"")
    _hide(monkeypatch, "pyarrow", "pyarrow.parquet", "pyarrow.csv", "pyarrow.compute", "pyarrow.dataset")
    cfg = DataConfig(name="table", path=str(tmp_path / "t.parquet"), target="y")
    with pytest.raises(MissingExtra, match=r"needs the package 'pyarrow', .*pip install 'vatra\[tables\]'"):
        build_dataset(cfg, 0)


def test_delta_data_and_commands_without_deltalake_name_the_delta_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _hide(monkeypatch, "deltalake")
    cfg = DataConfig(name="delta", path=str(tmp_path / "t"), target="y")
    with pytest.raises(MissingExtra, match=r"needs the package 'deltalake', .*pip install 'vatra\[delta\]'"):
        build_dataset(cfg, 0)
    with pytest.raises(SystemExit) as exit_:
        main(["data", "log", str(tmp_path / "t")])
    assert exit_.value.code == 2
    assert "pip install 'vatra[delta]'" in capsys.readouterr().err


def test_an_s3_store_without_s3fs_names_the_s3_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from vatra.resilience.fsspec_backend import FsspecBackend

    _hide(monkeypatch, "s3fs")
    with pytest.raises(MissingExtra, match=r"'s3fs'.*pip install 'vatra\[s3\]'"):
        FsspecBackend("s3://bucket/checkpoints")


def test_tracing_without_opentelemetry_names_the_otel_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vatra.monitor import StepTracer

    _hide(monkeypatch, "opentelemetry", "opentelemetry.sdk")
    tracer = StepTracer(MonitorConfig(tracing=True), tmp_path)
    with pytest.raises(MissingExtra, match=r"monitor.tracing needs .*pip install 'vatra\[otel\]'"):
        tracer.on_fit_start(None)  # type: ignore[arg-type]  (fails before it looks at the trainer)


def test_federated_learning_without_grpc_is_one_line_naming_the_fl_extra() -> None:
    # A fresh interpreter: this one has imported vatra.federated already.
    code = (
        "import sys; sys.modules['grpc'] = None\n"
        "from vatra.cli import main\n"
        "main(['federate', 'examples/fl_digits.toml', '--set', 'federated.rounds=1'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: federated learning needs the package 'grpc', which is not installed: pip install 'vatra[fl]'"
    ]


def test_the_learned_balancer_without_stable_baselines3_names_the_balance_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _hide(monkeypatch, "stable_baselines3")
    with pytest.raises(SystemExit) as exit_:
        main(["balance", "train-agent", "--timesteps", "100"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "error: vatra balance train-agent needs the package 'stable_baselines3', which is not installed: "
        "pip install 'vatra[balance]'"
    )
