"""Live recovery (resilience.live): a SIGKILLed replica group heals from its live peer while the
survivor keeps its process, and the config refuses the modes it cannot run with."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import tomli_w
import torch

from conftest import vatra_in_process
from vatra.config import load_config
from vatra.errors import ConfigError

pytest.importorskip("torchft")

ROOT = Path(__file__).resolve().parents[1]

LIVE = {
    "run": {"name": "live", "progress": "off"},
    "data": {"name": "digits"},
    "model": {"name": "mlp", "hidden": [32]},
    "train": {"steps": 400, "batch_size": 16, "eval_every": 0},
    "optim": {"name": "adamw", "lr": 0.003},
    "dist": {"nproc": 2},
    "checkpoint": {"every_steps": 100},
    "monitor": {"report": False},
    "chaos": {"slow_rank": 0, "slow_rank_s": 0.01},  # ≥ 4 s of steps: time to kill mid-run
    "resilience": {"live": True, "live_heartbeat_ms": 500},
}


def _progress(run_dir: Path, group: int) -> dict[str, Any] | None:
    try:
        return dict(json.loads((run_dir / ".ranks" / f"rank{group}.json").read_text()))
    except (OSError, ValueError):
        return None


@pytest.mark.slow(50)
def test_a_killed_group_heals_from_the_survivor_which_keeps_its_process(tmp_path: Path) -> None:
    # Prepare: two replica groups of one process each
    config, run_dir = tmp_path / "live.toml", tmp_path / "run"
    config.write_text(tomli_w.dumps(LIVE))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    log = (tmp_path / "out.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vatra", "train", str(config), "--run-dir", str(run_dir)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    # Execute: SIGKILL group 1 once it is a quarter through; watch group 0's pid to the end
    survivor_pids: set[int] = set()
    killed: dict[str, Any] | None = None
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        first, second = _progress(run_dir, 0), _progress(run_dir, 1)
        if first is not None:
            survivor_pids.add(int(first["pid"]))
        if killed is None and second is not None and second["step"] >= 100:
            os.kill(int(second["pid"]), signal.SIGKILL)
            killed = second
        time.sleep(0.02)
    proc.wait(timeout=60)
    log.close()
    # Assert: the run finished; group 0 never changed process; group 1 died, came back and healed
    assert proc.returncode == 0, (tmp_path / "out.log").read_text()[-2000:]
    assert killed is not None and killed["step"] < 400
    last = _progress(run_dir, 0)
    assert last is not None and last["step"] == 400
    survivor_pids.add(int(last["pid"]))
    assert len(survivor_pids) == 1
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    failed = [e for e in events if e["event"] == "worker_failed"]
    assert [(e["group"], e["signal"], e["pid"]) for e in failed] == [(1, "SIGKILL", killed["pid"])]
    healed = [e for e in events if e["event"] == "recovered"]
    assert len(healed) == 1 and healed[0]["group"] == 1 and healed[0]["source"] == "live peer"
    assert healed[0]["step"] >= killed["step"]
    stalls = [e for e in events if e["event"] == "quorum_changed" and e["group"] == 0]
    assert stalls and all(e["stall_s"] < 30 for e in stalls)
    # the rejoined group's final weights are the survivor's, bit for bit
    done = {e["group"]: e["weights_sha256"] for e in events if e["event"] == "live_done"}
    assert set(done) == {0, 1} and done[0] == done[1]
    # periodic checkpoints still came from group 0 while group 1 was away
    saved = [e["step"] for e in events if e["event"] == "checkpoint_saved"]
    assert saved[:4] == [100, 200, 300, 400]


class _Quorums:
    """What LiveSync reads of torchft's Manager: the quorum's size and id (a new id when its members
    change)."""

    def __init__(self) -> None:
        self.size, self._quorum_id, self._min_replica_size = 2, 0, 1

    def start_quorum(self) -> None:
        pass

    def num_participants(self) -> int:
        return self.size


def test_a_peer_replaced_between_two_quorums_is_a_change_though_the_count_holds() -> None:
    from vatra.config import ResilienceConfig
    from vatra.live.sync import LiveSync

    # Prepare: the survivor of 2 groups, 2 committed steps in the same quorum
    sync = LiveSync(ResilienceConfig(live=True), group=0, groups=2, lighthouse="-", attempt=0)
    events: list[tuple[str, dict[str, Any]]] = []
    sync.manager = quorums = _Quorums()
    sync.trainer = SimpleNamespace(sampler=None, log_event=lambda kind, **f: events.append((kind, f)))

    def step() -> None:
        sync.attempt_start = time.perf_counter()
        sync.begin()
        sync.end(True, 0.01)

    step()
    step()
    # Execute: group 1 dies and its restart is in the next quorum (seen in a CI run: the survivor was
    # saving its checkpoint meanwhile), then it dies for good
    quorums._quorum_id = 1
    step()
    step()
    quorums._quorum_id, quorums.size = 2, 1
    step()

    # Assert: one change each, the first with the count unchanged
    changes = [f for kind, f in events if kind == "quorum_changed"]
    assert [(f["cause"], f["replicas"], f["previous"]) for f in changes] == [
        ("peer_replaced", 2, 2),
        ("peer_lost", 1, 2),
    ]
    assert all(0.0 <= f["stall_s"] < 1.0 for f in changes)


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("dist.mode=diloco", "dist.mode = 'diloco'"),
        ("dist.mode=async", "dist.mode = 'async'"),
        ("parallel.fsdp=2", "[parallel]"),
        ("heal.policies=['rollback']", "heal.policies"),
    ],
)
def test_live_with_a_mode_it_cannot_run_is_one_error_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, override: str, named: str
) -> None:
    config = tmp_path / "live.toml"
    config.write_text(tomli_w.dumps(LIVE))
    code, _, err = vatra_in_process(capsys, "train", str(config), "--set", override)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("error: ") and "resilience.live" in lines[0] and named in lines[0]


def test_a_federated_run_refuses_live() -> None:
    with pytest.raises(ConfigError, match=r"resilience\.live = true: a federated run"):
        load_config(None, ["resilience.live=true"], run="federated")


def test_live_keeps_only_the_healing_every_group_decides_alike() -> None:
    cfg = load_config(None, ["resilience.live=true"])
    assert cfg.heal.policies == ["skip_spike"]
    assert load_config(None).heal.policies[0] == "skip_spike"


def test_live_needs_two_groups(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = tmp_path / "live.toml"
    config.write_text(tomli_w.dumps(LIVE))
    code, _, err = vatra_in_process(
        capsys, "train", str(config), "--nproc", "1", "--run-dir", str(tmp_path / "r")
    )
    assert code == 2 and err.strip().splitlines()[-1].startswith(
        "error: resilience.live = true needs at least 2"
    )


def test_a_group_reads_its_shards_batches_of_the_step_whatever_came_before() -> None:
    import numpy as np

    from vatra.data import ShardSampler
    from vatra.live.sync import seek

    # Prepare: a group's sampler over its shard of 50 samples, 2 micro-batches of 8 a step
    def group(step: int) -> SimpleNamespace:
        sampler = ShardSampler(np.arange(100, 150), 8, seed=3)
        return SimpleNamespace(
            sampler=sampler,
            state=SimpleNamespace(step=step),
            cfg=SimpleNamespace(train=SimpleNamespace(grad_accum=2)),
        )

    reference = group(0)
    batches = [reference.sampler.next_batch() for _ in range(20)]  # steps 0-9, no fault
    # Execute: a step tried again after it read its batches; a group that healed to step 7
    retried = group(3)
    seek(retried)  # type: ignore[arg-type]
    first = [retried.sampler.next_batch() for _ in range(2)]
    seek(retried)  # type: ignore[arg-type]
    again = [retried.sampler.next_batch() for _ in range(2)]
    healed = group(7)
    seek(healed)  # type: ignore[arg-type]
    # Assert: the step's own batches each time (none lost or repeated), across an epoch boundary
    assert all(np.array_equal(a, b) for a, b in zip(first + again, batches[6:8] * 2, strict=True))
    assert np.array_equal(healed.sampler.next_batch(), batches[14])
    assert (healed.sampler.epoch, healed.sampler.position) == (
        2,
        20,
    )  # 14 batches of 8 = 112 = 2·50 + 12, then 8 more


def test_live_without_torchft_names_the_extra(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    found = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else found(name, *a)
    )
    config = tmp_path / "live.toml"
    config.write_text(tomli_w.dumps(LIVE))
    code, _, err = vatra_in_process(capsys, "train", str(config), "--run-dir", str(tmp_path / "r"))
    assert code == 2 and err.strip().splitlines() == [
        "error: resilience.live = true needs the package 'torchft', which is not installed: "
        "pip install 'vatra[ft]'"
    ]


class _Halving:
    """``Manager.allreduce`` as seen by a group whose one peer sent zeros: the sum is this group's
    own tensor, divided by the 2 participants when the work completes."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def allreduce(self, flat: torch.Tensor) -> SimpleNamespace:
        self.sizes.append(flat.numel())
        return SimpleNamespace(wait=lambda: flat.div_(2))


def test_gradients_travel_in_one_allreduce_per_bucket_and_come_back_averaged() -> None:
    # Prepare: 5 float32 tensors of 1,000 elements (4,000 bytes each) and one float64
    from vatra.live.sync import average_gradients

    grads = [torch.full((10, 100), float(i)) for i in range(5)] + [torch.ones(3, dtype=torch.float64)]
    manager = _Halving()
    # Execute: buckets of 8,000 bytes hold two of the float32 tensors
    average_gradients(manager, grads, 8_000)
    # Assert: 3 float32 buckets and 1 float64 one (not 6 calls), every value averaged in place
    assert sorted(manager.sizes) == [3, 1000, 2000, 2000]
    for i, g in enumerate(grads[:5]):
        assert torch.equal(g, torch.full((10, 100), i / 2))
    assert torch.equal(grads[5], torch.full((3,), 0.5, dtype=torch.float64))
