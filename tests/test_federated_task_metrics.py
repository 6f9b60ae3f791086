"""A federated run reports its task's metrics: regression's R²/RMSE/MAE on the console, in the
summary, the report and ``rounds_to_target``, and keeps its main metric under secure aggregation."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tests.conftest import small_config

from vatra.config import Config
from vatra.errors import ConfigError
from vatra.federated.headline import Headline
from vatra.federated.privacy import filter_eval_metrics
from vatra.federated.simulation import simulate
from vatra.rundir import RunDir, read_jsonl


def _write_regression_csv(path: Path, rows: int = 240) -> None:
    """y = 2a − b + 0.5c + small noise: a target a small MLP learns within a few rounds."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 3))
    y = 2 * x[:, 0] - x[:, 1] + 0.5 * x[:, 2] + rng.normal(scale=0.1, size=rows)
    lines = ["a,b,c,y", *(f"{a:.5f},{b:.5f},{c:.5f},{t:.5f}" for (a, b, c), t in zip(x, y, strict=True))]
    path.write_text("\n".join(lines) + "\n")


def _cfg(tmp_path: Path, **federated: Any) -> Config:
    _write_regression_csv(tmp_path / "data.csv")
    return small_config(
        data={"name": "table", "path": str(tmp_path / "data.csv"), "target": "y"},
        model={"name": "mlp", "hidden": [16]},
        train={"batch_size": 16},
        optim={"name": "sgd", "lr": 0.05},
        federated={
            "clients": 3,
            "rounds": 4,
            "local_steps": 8,
            "selection": "all",
            "workers": 1,
            "partition": {"method": "iid"},
            **federated,
        },
    )


def test_regression_run_reports_r2_on_console_summary_and_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare: rounds_to_target on the task's main metric (auto: r2) at R² ≥ 0.9
    cfg = _cfg(tmp_path, target_value=0.9)

    # Execute
    summary = simulate(cfg, RunDir(tmp_path / "run"), progress=True)

    # Assert: every round line and the last line lead with R², never an accuracy of "-"
    out = capsys.readouterr().out
    rounds = [line for line in out.splitlines() if line.startswith("round ")]
    assert len(rounds) == 4 and all(re.search(r" global_r2 -?\d\.\d{4} worst -?\d", line) for line in rounds)
    assert "global_acc" not in out and "accuracy" not in out
    assert "done: 4 rounds, global r2 " in out and "rounds to r2 >= 0.9: " in out
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert all(isinstance(r["global_r2"], float) and r["global_r2"] == r["server_r2"] for r in rows)
    # summary.json: the task's figures, and the target reached where metrics.jsonl says it was
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert saved["main_metric"] == "r2" and saved["target_metric"] == "r2" and saved["target"] == 0.9
    for key in ("global_r2", "server_r2", "server_rmse", "server_mae", "client_r2", "worst_client_r2"):
        assert isinstance(saved[key], float), key
    assert saved["best_global_r2"] == max(r["global_r2"] for r in rows)
    assert saved["global_r2"] > 0.5  # the model learned the linear target
    first = next(r["round"] for r in rows if r["global_r2"] >= 0.9)
    assert saved["rounds_to_target"] == first == summary["rounds_to_target"]
    assert f"rounds to r2 >= 0.9: {first}" in out
    assert not any("accuracy" in k for k in saved)
    # report.html: a panel per task metric and the main figure as its card
    page = (tmp_path / "run" / "report.html").read_text()
    assert "global r2<b>" in page and "<th>global_r2</th>" in page
    assert "<th>global_accuracy</th>" not in page


def test_target_metric_picks_the_figure_and_its_direction(tmp_path: Path) -> None:
    # Prepare: rmse falls, so the target is reached at or below the threshold
    cfg = _cfg(tmp_path, target_metric="rmse", target_value=0.5)
    names = ["loss", "mae", "rmse", "r2"]
    rows = [
        {"round": 1, "global_r2": 0.1, "global_rmse": 0.9},
        {"round": 2, "global_r2": 0.6, "global_rmse": 0.5},
        {"round": 3, "global_r2": 0.4, "global_rmse": 0.6},
    ]

    # Execute
    summary = Headline(cfg, names, multitask=False).summary(rows)

    # Assert
    assert summary["target_metric"] == "rmse" and summary["rounds_to_target"] == 2
    assert summary["global_rmse"] == 0.6 and summary["best_global_r2"] == 0.6
    with pytest.raises(ConfigError, match=r"target_metric: 'accuracy' .* one of: loss, mae, rmse, r2"):
        Headline(_cfg(tmp_path, target_metric="accuracy"), names, multitask=False)


def test_multitask_leads_with_each_heads_main_metric(tmp_path: Path) -> None:
    heads = {"kind": {"task": "classification"}, "price": {"task": "regression"}}
    cfg = small_config(train={"multitask": {"heads": heads}})
    names = ["loss", "kind_loss", "kind_accuracy", "kind_macro_f1", "price_loss", "price_mae", "price_r2"]

    line = Headline(cfg, names, multitask=True).round_figures(
        {"global_loss": 0.5, "global_kind_accuracy": 0.75, "global_price_r2": 0.25}
    )

    assert line == "global_loss 0.5000 global_kind_accuracy 0.7500 global_price_r2 0.2500 worst -"


def test_privacy_whitelist_keeps_the_main_metric_never_a_loss() -> None:
    regression = {"loss": 0.3, "mae": 0.4, "rmse": 0.5, "r2": 0.6}
    multitask = {"loss": 1.0, "kind_loss": 0.5, "kind_accuracy": 0.7, "price_loss": 0.2, "price_r2": 0.3}

    assert filter_eval_metrics(regression) == {"r2": 0.6}
    assert filter_eval_metrics(regression, target="rmse") == {"r2": 0.6, "rmse": 0.5}
    assert filter_eval_metrics(multitask, heads=["kind", "price"]) == {"kind_accuracy": 0.7, "price_r2": 0.3}
    assert filter_eval_metrics({"ndcg@5": 0.8, "loss": 2.0}) == {"ndcg@5": 0.8}


def test_secure_aggregation_regression_run_keeps_clients_r2(tmp_path: Path) -> None:
    # Prepare: clients' replies pass the privacy whitelist; the summary still has their R²
    cfg = _cfg(tmp_path, rounds=2, secure_aggregation={"enabled": True})

    # Execute (a matplotlib warning, such as an empty panel's legend, fails the report)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        summary = simulate(cfg, RunDir(tmp_path / "run"), progress=False)

    # Assert: the clients' R² (and only the main metric) arrived; the report draws no empty panel
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert all(isinstance(r["client_r2"], float) for r in rows)
    assert not any(k in r for r in rows for k in ("client_loss", "client_rmse", "client_mae"))
    assert isinstance(summary["client_r2"], float) and isinstance(summary["worst_client_r2"], float)
    assert "client_loss" not in summary
    assert not [e for e in read_jsonl(tmp_path / "run" / "events.jsonl") if e["event"] == "report_failed"]
