"""The plugin table's dispatch order, whoever assembles the run."""

from __future__ import annotations

from pathlib import Path

from conftest import small_config
from vatra.assembly import build_plugins
from vatra.engine import Plugin
from vatra.rundir import RunDir


class Marker(Plugin):
    """A caller's plugin."""


def test_faults_first_the_callers_before_the_display_and_writers_last(tmp_path: Path) -> None:
    # Prepare: a config that asks for fault injection, monitoring and checkpoints
    cfg = small_config(chaos={"inject_nan_at": [3]}, checkpoint={"enabled": True}, run={"tensorboard": False})
    rd = RunDir(tmp_path).create()
    mine, link = Marker(), Marker()
    # Execute: a synchronous run's plugins, and an asynchronous worker's with its link to the servers
    names = [type(p).__name__ for p in build_plugins(cfg, rd, [mine])]
    with_link = build_plugins(cfg, rd, [mine], mode=link)
    # Assert
    assert names[:2] == ["TrainingFaults", "CommPlugin"]
    assert names[-3:] == ["Marker", "ProgressDisplay", "JsonlWriter"]
    assert names.index("Monitor") < names.index("CheckpointPlugin") < names.index("Marker")
    assert with_link[1] is link and with_link[-3] is mine
