"""Mixed precision: FP32 master weights and optimizer state, and fp16 overflow skips that healing and
the monitor leave alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tests.conftest import small_config

from vatra.assembly import build_plugins
from vatra.engine import Trainer
from vatra.rundir import RunDir


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_weights_and_optimizer_state_stay_fp32(precision: str) -> None:
    cfg = small_config(train={"steps": 5, "precision": precision}, optim={"name": "adamw", "lr": 1e-3})
    trainer = Trainer.from_config(cfg)
    trainer.fit()
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    states = [t for s in trainer.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    assert states and all(t.dtype == torch.float32 for t in states if t.is_floating_point())


def test_fp16_overflow_skips_are_not_anomalies(tmp_path: Path) -> None:
    """A loss scale far too large overflows the fp16 backward for the first steps: the scaler skips
    them and halves its scale; healing takes no action, the monitor raises no alarm, training goes on."""
    cfg = small_config(
        train={"steps": 60, "precision": "fp16", "batch_size": 32},
        optim={"name": "adamw", "lr": 3e-3},
        monitor={"enabled": True, "report": False},
        heal={"enabled": True},
        checkpoint={"enabled": False},
    )
    run_dir = RunDir(tmp_path / "run")
    run_dir.create()
    trainer = Trainer.from_config(cfg, plugins=build_plugins(cfg, run_dir), run_dir=run_dir)
    trainer.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    trainer.fit()
    rows = [json.loads(line) for line in run_dir.metrics.read_text().splitlines()]
    overflows = [r["step"] for r in rows if r.get("amp_overflow")]
    assert len(overflows) >= 3, "the test needs the scale to overflow"
    assert rows[-1]["loss_scale"] < 2.0**40
    lines = run_dir.events.read_text().splitlines() if run_dir.events.exists() else []
    events = [json.loads(line) for line in lines]
    assert not [e for e in events if e["event"] in ("heal", "anomaly")], events
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert rows[-1]["loss"] < rows[overflows[-1]]["loss"]
