"""A child process's failure reaches its parent through one channel (``vatra._child``): the
launcher's workers and the roles an asynchronous process supervises."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.conftest import small_config

from vatra._child import take_errors, write_error
from vatra.asyncrun import supervise
from vatra.errors import ConfigError
from vatra.rundir import RunDir


def test_a_childs_error_reaches_its_parent_once_and_a_lost_peer_is_not_the_reason(tmp_path: Path) -> None:
    # Prepare: two children fail, a third only because another went away
    write_error(tmp_path, "rank00001", "error: bad data in train.csv", 2)
    write_error(tmp_path, "rank00000", "error: no such column 'y'", 2)
    write_error(tmp_path, "rank00002", "lost a peer: connection closed", 1, peer_lost=True)
    # Act
    first, again = take_errors(tmp_path), take_errors(tmp_path)
    # Assert: in name order, each once, without the lost peer; nothing is left behind
    assert [(r["message"], r["exit_code"]) for r in first] == [
        ("error: no such column 'y'", 2),
        ("error: bad data in train.csv", 2),
    ]
    assert again == [] and list(tmp_path.iterdir()) == []


def test_an_async_roles_config_error_ends_its_supervisor_with_the_same_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: no job around the role (no MASTER_ADDR): the child raises a ConfigError (exit 2)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    cfg = small_config(dist={"mode": "async", "timeout_s": 5}, **{"async": {"restarts": 2}})
    rd = RunDir(tmp_path / "run").create()
    # Act / Assert: the supervisor raises the child's line and does not restart it
    with pytest.raises(ConfigError, match="needs a job of several processes"):
        supervise(cfg, "worker", 0, 1, rd, (None, None, None, None, ()))
    assert not rd.events.exists() or "async_restart" not in rd.events.read_text()
