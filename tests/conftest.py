"""Shared test helpers: small configs and a multi-process runner on gloo with a file rendezvous."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vatra.config import Config, config_from_dict

ROOT = Path(__file__).resolve().parents[1]


def small_config(**sections: dict) -> Config:
    """Digits + small MLP + SGD, quiet: fast enough for unit tests."""
    raw: dict = {
        "run": {"progress": "off", "tensorboard": False},
        "data": {"name": "digits"},
        "model": {"name": "mlp", "hidden": [32]},
        "train": {"steps": 5, "batch_size": 8, "eval_every": 0},
        "optim": {"name": "sgd", "lr": 0.1},
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return config_from_dict(raw)


def run_vatra(*args: str, timeout: float = 240, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """Run the ``vatra`` command in a subprocess, capturing output."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "vatra", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=env,
    )


@pytest.fixture
def root() -> Path:
    return ROOT
