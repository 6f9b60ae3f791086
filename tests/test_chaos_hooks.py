"""The fault hooks that feature packages call with plain values: a parameter server's kill and
secure aggregation's client drop-out."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

import vatra.resilience.chaos.kill as kill_module
from vatra.resilience.chaos import ClientDropout, StepKill
from vatra.rundir import RunDir, read_jsonl


def test_a_counted_kill_fires_once_per_run_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: kills asked at 5 and 9; the one at 5 fired in an earlier incarnation
    rd = RunDir(tmp_path).create()
    rd.log_event("chaos_kill", rank=2, step=5, signal="SIGKILL")
    killed: list[int] = []
    monkeypatch.setattr(kill_module.os, "kill", lambda pid, sig: killed.append(sig))
    hook = StepKill([5, 9], rd, rank=2)
    # Act
    hook.skip_fired()
    for step in range(1, 12):
        hook.at(step)
    # Assert: only step 9 fires, logged before the signal, naming the rank
    assert killed == [signal.SIGKILL]
    fired = [e for e in read_jsonl(rd.events) if e["event"] == "chaos_kill"]
    assert [(e["rank"], e["step"]) for e in fired] == [(2, 5), (2, 9)]


def test_the_highest_ids_asked_at_the_rounds_start_drop_at_the_chosen_stage() -> None:
    hook = ClientDropout(round=2, stage="masked_input", count=2)
    hook.round_start(1, [0, 1, 2, 3, 4])
    assert hook.vanish("masked_input", 1) == set()  # another round
    hook.round_start(2, [4, 0, 3, 1])  # client 2 was not asked
    assert hook.vanish("share_keys", 2) == set()  # another stage
    assert hook.vanish("masked_input", 2) == {3, 4}
