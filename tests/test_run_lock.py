"""One writer per run folder: the lock ``vatra train`` (and ``vatra run``, ``federate``,
``fl server``) holds for the whole job, which node launchers of one job share."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from contextlib import ExitStack, suppress
from pathlib import Path

import pytest
from tests._dist import start_vatra
from tests.conftest import vatra_in_process

from vatra import rundir
from vatra.cli import main
from vatra.errors import RunLocked
from vatra.launch import free_port
from vatra.rundir import LOCK, RunDir

QUIET = [
    "--nproc", "1",
    "--set", "run.progress=off", "--set", "run.tensorboard=false", "--set", "train.eval_every=0",
    "--set", "monitor.enabled=false", "--set", "heal.enabled=false", "--set", "checkpoint.enabled=false",
]  # fmt: skip


def _wait_for(
    what: str, ready: Callable[[], bool], proc: subprocess.Popen[str], timeout: float = 120
) -> None:
    """Poll ``ready()`` until true; fail early if ``proc`` ends first."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"ended before {what}: {proc.communicate()[1][-2000:]}"
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.1)


def _holder_pid(run: Path) -> int | None:
    try:
        return int(json.loads((run / LOCK).read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return None


def _is_locked(run: Path) -> bool:
    try:
        with RunDir(run).lock("test"):
            return False
    except RunLocked:
        return True


def test_a_second_writer_is_refused_while_the_first_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare: a first writer holds the folder as `vatra train` does for its whole job (taken here
    # directly: a real training run would have to be slowed down to outlast the second's start-up)
    monkeypatch.setattr(rundir, "LOCK_WAIT_S", 0.1)  # a refusal retries this long: nothing will change
    rd = RunDir(tmp_path / "run").create()
    run = rd.path
    (run / "config.toml").write_text("[train]\nsteps = 30\n")  # what the first one wrote
    with rd.lock("vatra train"):
        # Execute: a second one on the same folder, asking for something else, through the console entry
        code, _, err = vatra_in_process(capsys, "train", "examples/digits.toml", *QUIET, "--run-dir",
                                        str(run), "--set", "train.steps=99")  # fmt: skip
        # Assert: refused with one line that names the holder, while the first still holds it
        assert code == 2, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in err, err
        assert lines[0].startswith(f"error: run folder {run} is in use by vatra train (pid {os.getpid()} on ")
        assert "wait until it ends or stop it" in lines[0]
        assert _holder_pid(run) == os.getpid()
    assert "steps = 30" in (run / "config.toml").read_text()  # the refused one wrote nothing
    assert not rd.metrics.exists()
    with RunDir(run).lock("vatra ckpt gc"):  # after the first ends, the folder is free again
        pass


SCRIPT = """
import os, pathlib, sys, time
folder = pathlib.Path(os.environ["VATRA_RUN_DIR"])
(folder / f"rank{os.environ['RANK']}.pid").write_text(str(os.getpid()))
time.sleep(float(sys.argv[1]))
"""


def _run(tmp_path: Path, run: Path, sleep_s: float, *args: str) -> subprocess.Popen[str]:
    """``vatra run`` of a script that records its pid in the run folder, then sleeps (no torch in the
    workers: the launcher and the lock are what these tests are about)."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    return start_vatra("run", str(script), "--run-dir", str(run), *args, "--", str(sleep_s))


def test_a_killed_launcher_leaves_no_lock_even_while_its_worker_lives(tmp_path: Path) -> None:
    # Prepare: a launcher whose worker runs
    run = tmp_path / "run"
    proc = _run(tmp_path, run, 600)
    worker = run / "rank0.pid"
    try:
        _wait_for("the worker", worker.exists, proc)
        assert _is_locked(run)
        # Execute: SIGKILL the launcher alone
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        # Assert: the OS dropped the lock with its holder, and the worker (spawned, not forked, in a
        # session of its own) held none
        assert not _is_locked(run)
    finally:
        if proc.poll() is None:
            proc.kill()
        if worker.exists():
            with suppress(ProcessLookupError):
                os.kill(int(worker.read_text()), signal.SIGKILL)  # outlives its launcher
        proc.communicate(timeout=30)


@pytest.mark.slow(14)
def test_node_launchers_of_one_job_share_the_folder(tmp_path: Path) -> None:
    """Two elastic agents of one job (same --rdzv-id and --rdzv-endpoint) on one shared --run-dir."""
    run = tmp_path / "run"
    nodes = ["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "job-a"]
    node1 = _run(tmp_path, run, 0, *nodes, "--node-rank", "1")
    node0 = _run(tmp_path, run, 0, *nodes, "--node-rank", "0")
    _, err0 = node0.communicate(timeout=120)
    _, err1 = node1.communicate(timeout=120)
    assert node0.returncode == 0, err0[-2000:]
    assert node1.returncode == 0, err1[-2000:]
    assert (run / "rank0.pid").exists() and (run / "rank1.pid").exists()  # both nodes ran their worker


def test_the_launchers_of_a_job_keep_the_folder_until_the_last_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: the first launcher of job "a" and a second one that joins it
    monkeypatch.setattr(rundir, "LOCK_WAIT_S", 0.1)  # a refusal retries this long: nothing will change
    rd = RunDir(tmp_path)
    with ExitStack() as first, ExitStack() as second:
        first.enter_context(rd.lock("vatra train", job="a@host:1"))
        second.enter_context(rd.lock("vatra train", job="a@host:1"))
        # Assert: another job, a single-node run and a maintenance command are refused
        for job in ("b@host:1", None):
            held = r"in use by vatra train \(pid \d+ on .*, job a@host:1"
            with pytest.raises(RunLocked, match=held), rd.lock("vatra train", job=job):
                pass
        # Execute: the first launcher ends (a lost node) while the second goes on
        first.close()
        # Assert: the folder is still in use; a replacement launcher of the same job may join
        others = "in use by the other node launchers of the job of vatra train"
        with pytest.raises(RunLocked, match=others), rd.lock("vatra ckpt gc"):
            pass
        with rd.lock("vatra train", job="a@host:1"):
            pass
    # Assert: once the last launcher ends, anyone may take it
    with rd.lock("vatra ckpt rollback"):
        pass


def test_a_refusal_is_one_line_and_exit_code_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Prepare: this process holds the folder, as a `vatra ckpt gc` would
    rd = RunDir(tmp_path / "run").create()
    # Execute: a simulation on it
    with rd.lock("vatra ckpt gc"), pytest.raises(SystemExit) as exit_:
        main(["federate", "examples/fl_digits.toml", "--run-dir", str(rd.path)])
    # Assert
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: run folder {rd.path} is in use by vatra ckpt gc (pid {os.getpid()} on ")
    assert "\n" not in err
    assert not rd.metrics.exists()
