"""A tiny digits study for the ``vatra tune`` tests: its search space, config file and opened study."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tomli_w

from vatra.config import load_config

SPACE: dict[str, Any] = {
    "optim.lr": {"type": "float", "low": 1e-3, "high": 0.1, "log": True},
    "optim.name": {"type": "categorical", "choices": ["sgd", "adam"]},
    "optim.momentum": {"type": "float", "low": 0.0, "high": 0.9, "when": {"optim.name": "sgd"}},
}


def write_config(tmp_path: Path, tune: dict[str, Any] | None = None, **sections: dict[str, Any]) -> Path:
    """A tiny digits study: trials of a few steps, runs under tmp_path."""
    raw: dict[str, Any] = {
        "run": {"name": "st", "out_dir": str(tmp_path / "runs")},
        "data": {"name": "digits"},
        "model": {"name": "mlp", "hidden": [16]},
        "train": {"steps": 20, "batch_size": 16, "eval_every": 5},
        "optim": {"name": "adam", "lr": 0.01},
        "tune": {"trials": 3, "sampler": "random", "space": SPACE, **(tune or {})},
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    path = tmp_path / "study.toml"
    path.write_text(tomli_w.dumps(raw))
    return path


def study_of(path: Path, *sets: str) -> Any:
    """The study a config describes, opened (created) as ``vatra tune`` does, and its runner."""
    from vatra.cli.tune import trial_overrides
    from vatra.tune.study import Study

    cfg = load_config(path, [*sets, *trial_overrides(path)])
    run = Study(cfg, 1)
    return cfg, run, run.open()
