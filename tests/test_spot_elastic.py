"""Under ``--nnodes MIN:MAX``, a node that gets a preemption notice leaves and the job goes on without it."""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import pytest
import torch
from tests._dist import events, final_weights, rewind, start_vatra, train_ranks
from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException

from vatra.launch import free_port
from vatra.launch.elastic import PreemptionAgent
from vatra.resilience.checkpoint.preemption import mark_node_leaving
from vatra.rundir import ERRORS_ENV, read_jsonl

STEPS = 80
COMMON = ["train", "examples/digits.toml", "--nproc", "1", "--nnodes", "1:2"]
SETS = [f"train.steps={STEPS}", "checkpoint.every_steps=0", "run.tensorboard=false", "run.progress=plain"]


def _args(*sets: str) -> list[str]:
    return [a for s in (*SETS, *sets) for a in ("--set", s)]


@pytest.mark.parametrize(
    "source",
    [pytest.param("file", marks=pytest.mark.slow(68)), pytest.param("sigterm", marks=pytest.mark.slow(30))],
)
def test_a_preempted_node_leaves_and_the_other_finishes_alone_with_exact_weights(
    tmp_path: Path, source: str
) -> None:
    # Prepare: two "nodes" (one process each, a run folder each, one shared store) at a c10d rendezvous;
    # node 0 hosts it (an on-demand machine); node 1 watches a notice file, or its launcher gets a
    # SIGTERM (which its agent forwards to its worker). Rank 0 sleeps 50 ms a step so that the notice
    # lands mid-run; a short last call lets the node left re-form at once.
    runs, store, flag = [tmp_path / "node0", tmp_path / "node1"], tmp_path / "store", tmp_path / "preempt"
    rdzv = ["--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-conf", "last_call_timeout=3"]
    shared = ["monitor.report=false", f"store.url='{store}'", "chaos.slow_rank=0", "spot.poll_s=0.05"]
    node1 = start_vatra(
        *COMMON, *rdzv, "--node-rank", "1", "--max-restarts", "1", "--run-dir", str(runs[1]),
        *_args(*shared, f"spot.notice_file='{flag}'"),
    )  # fmt: skip
    node0 = start_vatra(
        *COMMON, *rdzv, "--node-rank", "0", "--max-restarts", "0", "--run-dir", str(runs[0]), *_args(*shared)
    )
    at = random.randint(8, 40)  # metrics lines (steps) written before the notice
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and max(len(read_jsonl(r / "metrics.jsonl")) for r in runs) < at:
        time.sleep(0.05)
    # Execute: node 1's machine is about to be taken back
    if source == "file":
        flag.touch()
    else:
        node1.send_signal(signal.SIGTERM)
    _, err1 = node1.communicate(timeout=120)
    _, err0 = node0.communicate(timeout=120)
    # Assert: node 1 saved inside the window and left (143, its workers not restarted though it
    # could); node 0 (no restarts allowed) re-formed the group alone and finished the run
    assert node1.returncode == 143, err1[-2000:]
    assert ("preemption notice" if source == "file" else "SIGTERM at step") in err1
    assert "within its 120 s window" in err1
    assert node0.returncode == 0, err0[-2000:]
    (saved,) = [e for r in runs for e in events(r, "preemption_checkpoint")]
    assert saved["fit"] is True and saved["source"] == source and saved["seconds"] < saved["window_s"]
    (resume,) = events(runs[0], "resume")
    assert (resume["resumed_step"], resume["saved_world_size"], resume["world_size"]) == (saved["step"], 2, 1)
    assert resume["steps_lost"] == 0
    # Assert: the weights are the uninterrupted run's that switches from 2 ranks to 1 at that step
    # (a 2-rank run saving at that step, resumed there on 1 rank): bit for bit (checked for one
    # source: the resume does not depend on where the notice came from)
    if source != "file":
        return
    step = int(saved["step"])
    ref = tmp_path / "ref"
    # every version kept: at an early step (12 of 80) the default keep_last = 5 had dropped that save
    keep = (f"checkpoint.every_steps={step}", "checkpoint.keep_last=0")
    train_ranks(ref, *SETS, *keep)
    rewind(ref, tmp_path / "ref_1", step)
    train_ranks(tmp_path / "ref_1", *SETS, *keep, world=1)
    got, want = final_weights(runs[0], tmp_path, STEPS), final_weights(tmp_path / "ref_1", tmp_path, STEPS)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


def test_a_node_whose_workers_saw_the_notice_leaves_instead_of_rejoining_a_reforming_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: the agent's view of the race behind a preempted node saving twice: the other nodes'
    # workers exit 75 and re-form while this node's workers (143 to come) are still saving, so
    # torch's loop sees a healthy group with a node waiting and restarts it (a membership change)
    monkeypatch.setenv(ERRORS_ENV, str(tmp_path / "errors"))
    agent = PreemptionAgent.__new__(PreemptionAgent)  # only the restart decision is exercised
    group = type("Group", (), {"spec": type("Spec", (), {"monitor_interval": 0.01})()})()
    states = iter([WorkerState.HEALTHY, WorkerState.HEALTHY, WorkerState.SUCCEEDED])
    monkeypatch.setattr(PreemptionAgent, "_monitor_workers", lambda self, g: RunResult(state=next(states)))
    restarted: list[object] = []
    monkeypatch.setattr(LocalElasticAgent, "_restart_workers", lambda self, g: restarted.append(g))
    # Execute / Assert: without a notice on this node, a membership change restarts as torch does
    agent._restart_workers(group)  # type: ignore[arg-type]
    assert restarted == [group]
    # once a worker here saw the notice, the agent waits for its workers to end and leaves
    mark_node_leaving()
    with pytest.raises(SignalException):
        agent._restart_workers(group)  # type: ignore[arg-type]
    assert restarted == [group] and next(states, None) is None
