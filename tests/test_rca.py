"""Root-cause analysis: every injected fault kind classified from the evidence of a real short run."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tests._dist import spawn
from tests.conftest import small_config, small_disk

import vatra
from vatra.config import dump_toml
from vatra.engine import Plugin, Trainer
from vatra.launch import free_port
from vatra.monitor.rca import KINDS, Evidence, classify, diagnosis
from vatra.monitor.rca_evidence import worker_failure_cause
from vatra.resilience.store import CheckpointStore
from vatra.rundir import ERRORS_ENV, read_jsonl

EXPECTED = {  # injected fault kind -> the cause the run's evidence must name
    "kill9": "dead_node",
    "sigterm": "preemption",
    "corrupt_object": "corrupt_checkpoint",
    "truncate_manifest": "corrupt_checkpoint",
    "lost_node": "dead_node",
    "disk_full": "disk_full",
    "nan_burst": "nan",
    "lr_spike": "nan",
    "oom": "oom",
    "comm_timeout": "comm_timeout",
    "slow_node": "slow_node",
    "data_error": "data_error",
    "user_error": "user_error",
}


def _fit(run: Path, steps: int, *plugins: Plugin, **sections: Any) -> BaseException | None:
    """A short in-process run of the digits MLP; the exception that stopped it, if any."""
    fit_args = sections.pop("fit", {})
    raw = {"train": {"steps": steps}, "monitor": {"report": False}, "checkpoint": {"every_steps": 4}}
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    try:
        vatra.fit(small_config(**raw), run_dir=run, plugins=plugins, **fit_args)
    except BaseException as exc:  # the run's failure is the evidence under test
        return exc
    return None


def _events(run: Path) -> list[dict[str, Any]]:
    return read_jsonl(run / "events.jsonl")


def _killed(run: Path, rank: int = 1) -> dict[str, Any]:
    """What the launcher records when the elastic agent reports rank ``rank`` SIGKILLed."""
    cause = worker_failure_cause(run, rank, -9, "SIGKILL", None, "restarting the worker group")
    return {"event": "worker_failed", "rank": rank, "cause": cause}


class Signal(Plugin):
    """Sends this process a signal at one step (a spot machine's SIGTERM)."""

    def __init__(self, step: int, sig: signal.Signals) -> None:
        self.step, self.sig = step, sig

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        if trainer.state.step == self.step:
            os.kill(os.getpid(), self.sig)


class BadRows(torch.utils.data.Dataset):
    """A user's dataset with one malformed record."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if i == 17:
            raise ValueError("malformed record at row 17: could not convert 'x7' to float")
        return torch.full((4,), float(i % 3)), i % 3


def user_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    weights = {"a": 1.0}
    return torch.nn.functional.cross_entropy(output, target) * weights["b"]  # the user's bug


# ----------------------------------------------------------------- one run per kind
def kill9(tmp: Path) -> list[dict[str, Any]]:
    _fit(tmp / "run", 6)
    return [*_events(tmp / "run"), _killed(tmp / "run")]


def damaged(tmp: Path, how: Callable[[Path, dict[str, Any]], None], **sections: Any) -> list[dict[str, Any]]:
    """Versions at steps 4 and 8, the latest damaged behind the run's back, a rank killed, a resume."""
    run = tmp / "run"
    _fit(run, 8, **sections)
    tag = (run / "checkpoints" / "tags" / "latest").read_text().split()[0]
    how(run, json.loads((run / "checkpoints" / "versions" / f"{tag}.json").read_text()))
    dead = _killed(run)
    _fit(run, 10, **sections)
    return [*_events(run), dead]


def flip_object(run: Path, manifest: dict[str, Any]) -> None:
    name = max(manifest["files"], key=lambda n: manifest["files"][n]["size"])  # the model's data file
    path = run / "checkpoints" / CheckpointStore.object_key(manifest["files"][name]["sha256"])
    data = bytearray(path.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 16] = bytes(
        b ^ 0xFF for b in data[len(data) // 2 : len(data) // 2 + 16]
    )
    path.write_bytes(bytes(data))


def truncate_manifest(run: Path, manifest: dict[str, Any]) -> None:
    path = run / "checkpoints" / "versions" / f"{manifest['version']}.json"
    os.truncate(path, path.stat().st_size // 2)


def lost_node(tmp: Path) -> list[dict[str, Any]]:
    nodes = [str(tmp / f"node{i}") for i in range(3)]
    erasure = {"erasure": {"k": 2, "m": 3, "nodes": nodes}}
    run = tmp / "run"
    _fit(run, 8, store=erasure)
    for path in sorted((tmp / "node1").rglob("*"), reverse=True):  # a storage node lost for good
        path.unlink() if path.is_file() else path.rmdir()
    dead = _killed(run)
    _fit(run, 10, store=erasure)
    return [*_events(run), dead]


def sigterm(tmp: Path) -> list[dict[str, Any]]:
    _fit(tmp / "run", 20, Signal(3, signal.SIGTERM))
    return _events(tmp / "run")


def disk_full(tmp: Path) -> list[dict[str, Any]]:
    """The worker entry on a 1 MiB disk that a 2-layer MLP's first checkpoint fills; the launcher's view."""
    from vatra.worker import main

    with small_disk(tmp / "mnt", "1m") as disk:
        run, errors = disk / "run", tmp / "errors"
        cfg = small_config(model={"hidden": [512, 512]}, train={"steps": 6}, checkpoint={"every_steps": 2})
        run.mkdir()
        (tmp / "config.toml").write_text(dump_toml(cfg))
        before = os.environ.get(ERRORS_ENV)
        os.environ[ERRORS_ENV] = str(errors)
        try:
            code = main([str(tmp / "config.toml"), "--run-dir", str(run)])
        finally:
            os.environ.pop(ERRORS_ENV) if before is None else os.environ.update({ERRORS_ENV: before})
        assert code != 0
        cause = worker_failure_cause(run, 0, code, None, errors)
        return [*_events(run), {"event": "worker_failed", "rank": 0, "cause": cause}]


def nan_burst(tmp: Path) -> list[dict[str, Any]]:
    _fit(
        tmp / "run", 30, chaos={"inject_nan_at": [15, 16, 17]}, monitor={"warmup_steps": 10, "report": False}
    )
    return _events(tmp / "run")


def lr_spike(tmp: Path) -> list[dict[str, Any]]:
    _fit(tmp / "run", 40, chaos={"lr_spike_at": [25]}, monitor={"warmup_steps": 10, "report": False})
    return _events(tmp / "run")


def oom(tmp: Path) -> list[dict[str, Any]]:
    _fit(tmp / "run", 4, chaos={"oom_batch": [4]})  # batch 8 > room for 4: torch.OutOfMemoryError
    return _events(tmp / "run")


def data_error(tmp: Path) -> list[dict[str, Any]]:
    _fit(tmp / "run", 20, fit={"train": BadRows(), "val": None, "model": torch.nn.Linear(4, 3)})
    return _events(tmp / "run")


def user_error(tmp: Path) -> list[dict[str, Any]]:
    _fit(tmp / "run", 4, fit={"loss": user_loss})
    return _events(tmp / "run")


class Sleep(Plugin):
    def __init__(self, rank: int, step: int, seconds: float) -> None:
        self.rank, self.step, self.seconds = rank, step, seconds

    def on_step_start(self, trainer: Trainer) -> None:
        if trainer.dist.rank == self.rank and trainer.state.step == self.step:
            time.sleep(self.seconds)


def _rank(rank: int, port: int, run: str, steps: int, sections: dict[str, Any], sleep: bool) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    plugins = [Sleep(1, 3, 6.0)] if sleep else []
    _fit(Path(run), steps, *plugins, **sections)  # a failure is recorded in the run folder


def comm_timeout(tmp: Path) -> list[dict[str, Any]]:
    sections = {"dist": {"timeout_s": 2.0}, "checkpoint": {"enabled": False}}
    spawn(_rank, 2, (free_port(), str(tmp / "run"), 10, sections, True), timeout=60)
    return _events(tmp / "run")


def slow_node(tmp: Path) -> list[dict[str, Any]]:
    sections = {"chaos": {"slow_rank": 1, "slow_rank_s": 0.03}, "monitor": {"gather_every": 5}}
    spawn(_rank, 2, (free_port(), str(tmp / "run"), 40, sections, False), timeout=120)
    return _events(tmp / "run")


RUNS: dict[str, Callable[[Path], list[dict[str, Any]]]] = {
    "kill9": kill9,
    "sigterm": sigterm,
    "corrupt_object": lambda tmp: damaged(tmp, flip_object),
    "truncate_manifest": lambda tmp: damaged(tmp, truncate_manifest),
    "lost_node": lost_node,
    "disk_full": disk_full,
    "nan_burst": nan_burst,
    "lr_spike": lr_spike,
    "oom": oom,
    "comm_timeout": comm_timeout,
    "slow_node": slow_node,
    "data_error": data_error,
    "user_error": user_error,
}


@pytest.mark.slow(60)
def test_every_injected_fault_kind_is_classified_as_its_cause(tmp_path: Path) -> None:
    # Prepare / Execute: one real short run per injected kind; the run's verdict from its events
    matrix: dict[str, dict[str, int]] = {kind: dict.fromkeys(KINDS, 0) for kind in RUNS}
    found: dict[str, Any] = {}
    for kind, run in RUNS.items():
        (tmp_path / kind).mkdir()
        verdict = diagnosis(run(tmp_path / kind))
        found[kind] = verdict
        matrix[kind][verdict["kind"] if verdict else "unknown"] += 1
    # Assert: the confusion matrix (injected kind × cause named) is diagonal over the expected causes
    table = "\n".join(f"{k:18} {[c for c, n in row.items() if n]}" for k, row in matrix.items())
    for kind, expected in EXPECTED.items():
        assert matrix[kind][expected] == 1, f"{kind}: {found[kind]}\n{table}"
        assert 0 < found[kind]["confidence"] <= 1 and found[kind]["evidence"] and found[kind]["action"]
    assert "they wait on rank 1" in " ".join(found["slow_node"]["evidence"])  # chaos.slow_rank = 1


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (
            "DistBackendError: [Rank 0] Watchdog caught collective operation timeout: "
            "WorkNCCL(OpType=ALLREDUCE)",
            "comm_timeout",
        ),
        (
            "RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] "
            "Timed out waiting 2000ms for recv operation to complete",
            "comm_timeout",
        ),
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "oom"),
        (
            "RuntimeError: [enforce fail at alloc_cpu.cpp:118] DefaultCPUAllocator: can't allocate memory",
            "oom",
        ),
        ("OSError: [Errno 28] No space left on device", "disk_full"),
        ("RuntimeError: DataLoader worker (pid 4242) is killed by signal: Bus error.", "data_error"),
        ("StoreError: versions/s0000010-a0.json: sha256 mismatch", "corrupt_checkpoint"),
        ("KeyboardInterrupt: ", "preemption"),  # what the campaign's SIGTERMed workers raised
    ],
)
def test_library_error_texts_name_their_cause(error: str, kind: str) -> None:
    assert classify(Evidence(error=error))["kind"] == kind


def test_a_sigkill_with_the_memory_gone_reads_as_the_oom_killer_and_with_memory_as_a_dead_node() -> None:
    killed = {"rank": 1, "exit_code": -9, "signal": "SIGKILL"}
    assert classify(Evidence(**killed, mem_available_frac=0.01))["kind"] == "oom"
    assert classify(Evidence(**killed, mem_available_frac=0.6))["kind"] == "dead_node"
    assert classify(Evidence(exit_code=1))["kind"] == "unknown"


def test_a_sigkill_after_a_skipped_nan_step_is_the_kill_not_the_nan() -> None:
    # the live-recovery benchmark's restart arm: skip_spike skipped a NaN step, then rank 1 was SIGKILLed
    skipped = {"event": "heal", "action": "skip_update", "reason": "non-finite gradient norm", "step": 90}
    recent = [{"step": 90, "loss": float("nan")}]
    killed = Evidence(signal="SIGKILL", rank=1, events=[skipped], recent=recent, mem_available_frac=0.6)
    assert classify(killed)["kind"] == "dead_node"
    assert classify(Evidence(events=[skipped], recent=recent))["kind"] == "nan"
