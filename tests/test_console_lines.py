"""The console's one line per event (``vatra.monitor.narrate``) for what a short in-process run
cannot show: a resume on another world size, a recovery whose worker exited by itself."""

from __future__ import annotations

from vatra.monitor.narrate import describe


def test_a_resume_on_fewer_ranks_says_so() -> None:
    # Prepare: the resume event a 2-rank checkpoint restored on 1 rank logs
    fields = {"step": 120, "version": "s0000120-a0", "resumed_step": 120, "steps_lost": 0}
    fields |= {"world_size": 1, "saved_world_size": 2, "failures": []}
    # Execute / Assert
    line = describe("resume", fields)
    assert line == "resumed from checkpoint version s0000120-a0 at step 120 (world size 2 → 1)"
    same = describe("resume", {**fields, "world_size": 2})
    assert same == "resumed from checkpoint version s0000120-a0 at step 120"


def test_a_recovery_names_the_rank_and_how_it_ended() -> None:
    failure = {"rank": 3, "exit_code": 1, "signal": None, "step": 131}
    fields = {"step": 125, "version": "s0000125-a1", "resumed_step": 125, "steps_lost": 6}
    fields |= {"world_size": 3, "saved_world_size": 4, "failures": [failure]}
    assert describe("resume", fields) == (
        "recovering: rank 3 exit code 1 at step 131; resumed from checkpoint version s0000125-a1 at "
        "step 125 (6 steps lost; world size 4 → 3)"
    )


def test_events_the_console_does_not_tell() -> None:
    assert describe("checkpoint_saved", {"step": 10}) is None
    assert describe("heal", {"step": 10, "action": "straggler", "reason": "rank 1 slow"}) is None
