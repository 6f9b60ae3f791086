"""Healing end to end: 2 ranks on gloo, the digits example, an LR spike, the real checkpoint plugin."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import run_vatra

from vatra.rundir import read_jsonl

COMMON = [
    "--nproc", "2",
    "--set", "run.progress=off",
    "--set", "run.tensorboard=false",
    "--set", "train.steps=250",
    "--set", "monitor.report=false",
]  # fmt: skip
SPIKE = ["--set", "chaos.lr_spike_at=[130]", "--set", "chaos.lr_spike_steps=5"]


def _train(run_dir: Path, *sets: str) -> dict:
    result = run_vatra(
        "train", "examples/digits.toml", "--run-dir", str(run_dir), *COMMON, *sets, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads((run_dir / "summary.json").read_text())


def test_lr_spike_diverges_without_healing_and_recovers_with_it(tmp_path: Path) -> None:
    # Prepare / Execute: the same run clean, with the spike and no healing, with the spike and healing
    # (plus a slow rank 1, which healing must name).
    clean = _train(tmp_path / "clean")
    broken = _train(tmp_path / "off", *SPIKE, "--set", "heal.enabled=false")
    healed = _train(tmp_path / "on", *SPIKE, "--set", "chaos.slow_rank=1", "--set", "chaos.slow_rank_s=0.03")
    # Assert: without healing the spike wrecks the model; with it, accuracy is back within 1 point.
    assert broken["val_accuracy"] < clean["val_accuracy"] - 0.10, (broken, clean)
    assert abs(healed["val_accuracy"] - clean["val_accuracy"]) <= 0.01, (healed, clean)
    events = read_jsonl(tmp_path / "on" / "events.jsonl")
    rollbacks = [e for e in events if e.get("action") == "rollback"]
    assert rollbacks and all(e["evidence"]["source"].startswith("checkpoint") for e in rollbacks)
    assert any(e["event"] == "anomaly" for e in events)
    stragglers = [e for e in events if e.get("action") == "straggler"]
    assert stragglers and stragglers[0]["evidence"]["rank"] == 1
    assert clean.get("heal_actions", {}).get("rollback") is None  # no false rollbacks on the clean run
