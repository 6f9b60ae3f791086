"""``vatra profile``: the traces, the breakdown, the verdict and the automatic fix."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from tests._dist import needs_netns, run_vatra
from tests.conftest import small_config, vatra_in_process

import vatra
from vatra.config import load_config
from vatra.monitor.profile import PARTS, analyse, format_report, judge, profile_run, rank_breakdown

# A user's dataset whose items take a millisecond each to read (a slow disk, a decoder): a batch
# of 8 waits ~9 ms while the small model computes in about 1 ms.
SLOW = Path(__file__).resolve().parents[1] / "examples" / "slow_loader"  # slowdata.py, slow.toml


def _slow_project(folder: Path) -> Path:
    shutil.copytree(SLOW, folder, dirs_exist_ok=True)
    return folder / "slow.toml"


def _in_process(config: Path) -> Any:
    """The window trained by vatra.fit in this process (one rank), then its traces read."""

    def measure(overrides: list[str], where: Path) -> dict[str, Any]:
        vatra.fit(load_config(config, overrides, run="train"), run_dir=where)
        return analyse(where)

    return measure


def _wait_s(measured: dict[str, Any]) -> float:
    """A profile's (or a tried fix's) mean data wait a step, in seconds."""
    return float(measured["mean"]["data_wait"] * measured["step_s"])


@pytest.mark.slow(20)  # three short runs: as written and the two candidate fixes
def test_a_slow_loader_is_named_data_bound_and_the_fix_cuts_the_data_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: one torch thread (the 2-core machine's second core serves the loader workers)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    config = _slow_project(tmp_path / "project")
    cfg = load_config(config, run="train")
    # Execute
    report = profile_run(
        _in_process(config),
        cfg,
        [],
        (6, 15),
        tmp_path / "run",
        fix=True,
        cuda=False,
        config_path=str(config),
    )
    # Assert: the data wait dominates, is named, and a re-measured fix shrinks it
    rank = report["ranks"][0]
    assert report["verdict"] == "data-bound", format_report(report)
    assert rank["steps"] == 10 and sum(rank["shares"].values()) == pytest.approx(1.0, abs=1e-6)
    assert rank["shares"]["data_wait"] > 0.5
    candidates = report["findings"][0]["fixes"]
    assert [sorted(c) for c in candidates] == [["data.prefetch"], ["data.prefetch_factor", "data.workers"]]
    assert candidates[0]["data.prefetch"] >= 2 and candidates[1]["data.prefetch_factor"] == 4
    fix = report["fix"]
    assert [t["overrides"] for t in fix["tried"]] == candidates
    # the kept fix (the shortest step) cuts the data wait a step; the better reader halves it. In
    # seconds, not as a share: a fix that makes the whole step 4x shorter can leave the wait's share
    # near half on a loaded machine (76 % of 19.3 ms before, 50 % of 4.4 ms after, seen under -n 4)
    kept, was = fix["tried"][fix["kept"]], _wait_s(fix["before"])
    assert _wait_s(kept) < 0.8 * was and kept["step_s"] < fix["before"]["step_s"], format_report(report)
    assert min(_wait_s(t) for t in fix["tried"]) < 0.5 * was, format_report(report)
    assert fix["command"].startswith("vatra train ") and "--set data." in fix["command"]
    # the engine's own clocks agree that the wait is the data's
    engine = report["engine"]
    assert engine["data_time_s"] > 0.5 * engine["step_time_s"]
    saved = json.loads((tmp_path / "run" / "profile.json").read_text())
    assert saved["verdict"] == "data-bound" and saved["fix"]["kept"] == fix["kept"]
    text = format_report(report)
    assert "verdict: data-bound" in text and "rank 0 fix 2" in text and "kept fix" in text


@pytest.mark.parametrize(
    ("steps", "says"),
    [("5:2", "expected A:B with 1 ≤ A ≤ B"), ("3:99", "train.steps = 40"), ("x", "expected A:B")],
)
def test_bad_steps_are_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], steps: str, says: str
) -> None:
    config = _slow_project(tmp_path / "project")
    code, _, err = vatra_in_process(
        capsys, "profile", str(config), "--steps", steps, "--run-dir", str(tmp_path / "r")
    )
    assert code == 2 and err.startswith("error: --steps") and says in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "r").exists()  # nothing started


@pytest.mark.slow(70)
def test_two_ranks_merge_into_one_aligned_trace_and_a_slow_rank_is_named(tmp_path: Path) -> None:
    # Prepare: rank 1 sleeps 60 ms each step (chaos.slow_rank); rank 0 waits for it in the all-reduce
    run = tmp_path / "run"
    # Execute
    done = run_vatra(
        "profile", "examples/digits.toml", "--steps", "3:6", "--nproc", "2", "--run-dir", str(run),
        "--set", "train.steps=8", "--set", "run.progress=off", "--set", "monitor.report=false",
        "--set", "run.tensorboard=false", "--set", "chaos.slow_rank=1", "--set", "chaos.slow_rank_s=0.06",
    )  # fmt: skip
    # Assert
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "verdict: straggler" in done.stdout and "rank 1:" in done.stdout, done.stdout
    merged = json.loads((run / "trace.json").read_text())
    names = {e["pid"]: e["args"]["name"] for e in merged["traceEvents"] if e.get("name") == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    assert {e["pid"] for e in merged["traceEvents"]} == {0, 1}
    spans = {
        (e["pid"], e["name"]): (e["ts"], e["ts"] + e["dur"])
        for e in merged["traceEvents"]
        if e.get("ph") == "X" and e["name"].startswith("vatra.step#")
    }
    assert {name for _, name in spans} == {f"vatra.step#{s}" for s in range(3, 7)}
    for step in range(3, 7):  # the ranks meet in each step's all-reduce: their spans overlap in time
        a, b = spans[(0, f"vatra.step#{step}")], spans[(1, f"vatra.step#{step}")]
        assert min(a[1], b[1]) > max(a[0], b[0]), (step, a, b)
    report = json.loads((run / "profile.json").read_text())
    assert report["verdict"] == "straggler" and [r["rank"] for r in report["ranks"]] == [0, 1]
    assert report["ranks"][0]["shares"]["comm_exposed"] > report["ranks"][1]["shares"]["comm_exposed"]
    assert set(report["ranks"][0]["parts"]) == set(PARTS)


@needs_netns
@pytest.mark.xdist_group("netns")
@pytest.mark.slow(130)
def test_a_shaped_link_is_named_communication_bound(tmp_path: Path) -> None:
    # Prepare: 2 hosts of one rank each joined by a 20 Mbit/s link; a 0.3 M-parameter model
    name = f"p{os.getpid() % 100000}"
    run = tmp_path / "run"
    up = run_vatra("cluster", "up", "--name", name, "--hosts", "2", "--procs-per-host", "1",
                   "--bandwidth", "20mbit")  # fmt: skip
    try:
        assert up.returncode == 0, up.stderr
        # Execute
        done = run_vatra(
            "cluster", "run", "--name", name, "--timeout", "200", "--",
            "vatra", "profile", "examples/digits.toml", "--steps", "3:5", "--run-dir", str(run),
            "--set", "train.steps=6", "--set", "run.progress=off", "--set", "monitor.report=false",
            "--set", "run.tensorboard=false", "--set", "model.hidden=[512,512]",
            "--set", "checkpoint.enabled=false",
        )  # fmt: skip
    finally:
        run_vatra("cluster", "down", "--name", name)
    # Assert
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((run / "profile.json").read_text())
    assert report["world_size"] == 2 and report["verdict"] == "communication-bound", report["findings"]
    assert all(r["shares"]["comm_exposed"] > 0.5 for r in report["ranks"])
    assert report["findings"][0]["fixes"] == [{"dist.bucket_cap_mb": 6.25}]


def _event(name: str, ts: float, dur: float, tid: int = 1, cat: str = "cpu_op") -> dict[str, Any]:
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 7, "cat": cat}


def test_the_breakdown_splits_a_step_and_tells_exposed_from_overlapped_communication() -> None:
    # Prepare: one 100 µs step on thread 1; gloo's all-reduce on thread 2 runs 50-80 µs, under
    # backward's op until 60 µs, then alone while the training thread waits (60-80 µs)
    events = [
        _event("vatra.step#3", 0, 100, cat="user_annotation"),
        _event("vatra.data_wait", 0, 10, cat="user_annotation"),
        _event("vatra.forward", 10, 20, cat="user_annotation"),
        _event("aten::addmm", 12, 15),
        _event("vatra.backward", 30, 50, cat="user_annotation"),
        _event("aten::mm", 32, 28),
        _event("gloo:all_reduce", 50, 30, tid=2, cat="user_annotation"),
        _event("vatra.optimizer", 80, 10, cat="user_annotation"),
        _event("aten::add_", 81, 8),
        _event("aten::norm", 92, 4),  # clipping: an op outside the labels
    ]
    trace = {"traceEvents": events, "vatra": {"rank": 0}}
    # Execute
    b = rank_breakdown(trace)
    # Assert (µs → s)
    parts = {k: round(v * 1e6, 6) for k, v in b["parts"].items()}
    assert parts == {"data_wait": 10, "forward": 20, "backward": 30, "comm_exposed": 20, "optimizer": 10,
                     "checkpoint": 0, "other": 4, "idle": 6}  # fmt: skip
    assert round(b["comm_overlapped"] * 1e6, 6) == 10 and round(b["comm_total"] * 1e6, 6) == 30
    assert b["steps"] == 1 and b["step_s"] == pytest.approx(100e-6)


def _ranks(**shares: float) -> list[dict[str, Any]]:
    parts = dict.fromkeys(PARTS, 0.0)
    parts.update(shares)
    parts["forward"] += 1 - sum(parts.values())
    row = {"rank": 0, "steps": 10, "step_s": 0.1, "shares": parts, "parts": {k: v for k, v in parts.items()},
           "comm_overlapped": 0.0, "comm_total": 0.0, "ops_per_step": 50, "median_op_us": 200.0,
           "op_share_of_compute": 0.9}  # fmt: skip
    return [row]


@pytest.mark.parametrize(
    ("shares", "verdict", "fixes"),
    [
        ({"checkpoint": 0.4}, "checkpoint-stall", [{"checkpoint.every_steps": 200}]),
        ({"checkpoint": 0.2, "data_wait": 0.5}, "checkpoint-stall", [{"checkpoint.every_steps": 200}]),
        ({"data_wait": 0.1}, "compute-bound", []),
    ],
)
def test_the_verdict_rules(shares: dict[str, float], verdict: str, fixes: list[dict[str, Any]]) -> None:
    cfg = small_config(checkpoint={"every_steps": 50})
    found = judge(_ranks(**shares), cfg)
    assert found[0].kind == verdict and found[0].fixes == fixes
    if "data_wait" in shares and shares["data_wait"] >= 0.3:  # every rule that holds is a finding
        assert [f.kind for f in found] == [verdict, "data-bound"]


def test_many_tiny_ops_are_named_overhead_bound() -> None:
    ranks = _ranks()
    ranks[0].update(ops_per_step=900, median_op_us=6.0)
    found = judge(ranks, small_config())
    assert found[0].kind == "overhead-bound" and "900 top-level ops per step" in found[0].evidence[0]


@pytest.mark.parametrize("fix", [{"prefetch": 4}, {"workers": 2, "prefetch_factor": 4}])
def test_a_loader_fix_changes_no_result(tmp_path: Path, fix: dict[str, int]) -> None:
    # The data fixes are safe: the batches come in the sampler's order whoever reads them, so the
    # losses are the same to the bit (one process, same seed).
    quick = {"monitor": {"report": False}, "checkpoint": {"enabled": False}, "train": {"steps": 6}}
    plain = vatra.fit(small_config(**quick), run_dir=tmp_path / "plain")
    fixed = vatra.fit(small_config(**quick, data=fix), run_dir=tmp_path / "fixed")
    losses = [json.loads(line)["loss"] for line in (tmp_path / "plain" / "metrics.jsonl").open()]
    assert [json.loads(line)["loss"] for line in (tmp_path / "fixed" / "metrics.jsonl").open()] == losses
    assert fixed.summary["final_loss"] == plain.summary["final_loss"]


def _rank(rank: int, step_s: float, comm_s: float) -> dict[str, Any]:
    row = _ranks(comm_exposed=comm_s / step_s)[0]
    row.update(rank=rank, step_s=step_s)
    return row


@pytest.mark.parametrize(
    ("ranks", "verdict"),
    [
        # rank 1 works 100 ms a step, rank 0 40 ms and waits 60 ms for it in the all-reduce
        ([_rank(0, 0.1, 0.06), _rank(1, 0.1, 0.0)], "straggler"),
        # a slow link: both wait ~0.9 s; rank 0's 34 ms against rank 1's 21 ms is noise beside it
        ([_rank(0, 1.0, 0.966), _rank(1, 1.0, 0.979)], "communication-bound"),
    ],
)
def test_a_straggler_is_told_from_a_slow_link(ranks: list[dict[str, Any]], verdict: str) -> None:
    found = judge(ranks, small_config())
    assert found[0].kind == verdict, [f.evidence for f in found]
    assert verdict != "straggler" or found[0].evidence[0].startswith("rank 1:")
