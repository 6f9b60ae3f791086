"""Two hosts that share no folder, a checkpoint store on S3, one host killed mid-run and the job resumed.

Each host of the namespace cluster sees its own copy of the run folder (``--private-dir``: a mount
namespace per host), and the store is a real S3 server (moto) on the switch, which every host
reaches over its shaped link. Host 1's whole process tree is SIGKILLed after the step-20 save; the
same command on both hosts then resumes: every rank fetches what it needs from S3.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests._dist import ROOT, needs_netns, run_vatra, start_vatra

from vatra.launch.cluster import SWITCH_ADDRESS
from vatra.rundir import read_jsonl

# The cluster tests share network-namespace names and the switch address: one xdist worker runs them all.
pytestmark = pytest.mark.xdist_group("netns")

MOTO = shutil.which("moto_server") or str(Path(sys.executable).parent / "moto_server")
PORT = 9000  # inside the switch namespace this test creates: no other process can hold it
S3 = {"endpoint_url": f"http://{SWITCH_ADDRESS}:{PORT}", "key": "testing", "secret": "testing"}
STEPS = 60


def _in(netns: str, *cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", "netns", "exec", netns, *cmd], capture_output=True, text=True)


def _start_s3(switch: str) -> subprocess.Popen[bytes]:
    """moto_server on the switch's bridge address, and a bucket on it."""
    proc = subprocess.Popen(["ip", "netns", "exec", switch, MOTO, "-H", SWITCH_ADDRESS, "-p", str(PORT)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if _in(switch, "bash", "-c", f"exec 3<>/dev/tcp/{SWITCH_ADDRESS}/{PORT}").returncode == 0:
            bucket = f"import s3fs; s3fs.S3FileSystem(**{S3!r}).mkdir('ckpt')"
            if _in(switch, sys.executable, "-c", bucket).returncode == 0:
                return proc
            break
        time.sleep(0.3)
    proc.kill()
    pytest.skip("moto_server did not start in the switch namespace")


def _config(path: Path) -> Path:
    # s3fs's listings cache stays on (its default): the store must see what other ranks uploaded
    options = ", ".join(f'{k} = "{v}"' for k, v in S3.items())
    path.write_text(
        (ROOT / "examples" / "digits.toml").read_text()
        + f'\n[store]\nurl = "s3://ckpt/run"\noptions = {{ {options} }}\n'
        + "\n[checkpoint]\nevery_steps = 10\n"
    )
    return path


def _cluster_run(name: str, config: Path, run: Path) -> subprocess.Popen[str]:
    cmd = [
        "cluster", "run", "--name", name, "--timeout", "240",
        "--private-dir", str(run), "--",
        "vatra", "train", str(config), "--run-dir", str(run), "--set", f"train.steps={STEPS}",
        "--set", "train.eval_every=0", "--set", "run.progress=off", "--set", "run.tensorboard=false",
        "--set", "monitor.report=false",
    ]  # fmt: skip
    return start_vatra(*cmd, stderr=subprocess.STDOUT)


def _events(folder: Path, kind: str) -> list[dict]:
    return [e for e in read_jsonl(folder / "events.jsonl") if e["event"] == kind]


@needs_netns
@pytest.mark.skipif(shutil.which("unshare") is None or not Path(MOTO).exists(), reason="needs unshare, moto")
def test_two_hosts_without_a_shared_folder_resume_from_s3_after_one_host_is_killed(tmp_path: Path) -> None:
    pytest.importorskip("s3fs")
    name = f"r{os.getpid() % 100000}"
    run, config = tmp_path / "run", _config(tmp_path / "cluster.toml")
    host0, host1 = tmp_path / "run.h0", tmp_path / "run.h1"
    up = run_vatra("cluster", "up", "--name", name, "--hosts", "2", "--bandwidth", "10mbit")
    assert up.returncode == 0, up.stderr
    s3 = None
    try:
        s3 = _start_s3(f"{name}-sw")
        # Execute: train; once the step-20 version is stored, SIGKILL everything on host 1
        first = _cluster_run(name, config, run)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and first.poll() is None:
            if any(e["step"] >= 20 for e in _events(host0, "checkpoint_saved")):
                break
            time.sleep(0.1)
        out = _in(f"{name}-h1", "true")  # the namespace still exists
        assert out.returncode == 0 and first.poll() is None, first.stdout.read() if first.stdout else ""
        pids = subprocess.run(["ip", "netns", "pids", f"{name}-h1"], capture_output=True, text=True).stdout
        for pid in pids.split():
            os.kill(int(pid), signal.SIGKILL)
        log, _ = first.communicate(timeout=120)
        assert first.returncode != 0, log[-3000:]
        # the hosts shared no folder: each wrote its own copy; host 0 alone has rank 0's logs
        assert not list(run.iterdir()) and not (host1 / "metrics.jsonl").exists()
        assert (host1 / ".ranks" / "rank1.json").exists() and not (host0 / ".ranks" / "rank1.json").exists()
        saved = max(e["step"] for e in _events(host0, "checkpoint_saved"))
        # Execute: the same command on both hosts
        second = _cluster_run(name, config, run)
        log, _ = second.communicate(timeout=240)
        # Assert: resumed from the newest version in S3 and finished
        assert second.returncode == 0, log[-4000:]
        (resume,) = _events(host0, "resume")
        assert resume["resumed_step"] == saved >= 20 and resume["resumed_step"] < STEPS
        assert json.loads((host0 / "summary.json").read_text())["steps"] == STEPS
        for host in (host0, host1):
            assert not (host / "checkpoints" / "objects").exists()
            assert not [p for p in (host / "checkpoints").rglob("*") if p.is_file()]  # staging cleaned
    finally:
        if s3 is not None:
            s3.kill()
        run_vatra("cluster", "down", "--name", name)
