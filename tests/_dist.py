"""The distributed-test harness: ranks spawned on gloo, and the ``vatra`` command in a subprocess.

One copy of each mechanism for every test file:

- :func:`spawn` starts ``fn(rank, *args)`` in ``nprocs`` fresh processes and fails the test when one
  raises or when they outlive ``timeout`` (the others are killed, none is left behind).
- :func:`rendezvous` names the file (``file://``) every rank of one launch meets at; a free port
  (``vatra.launch.free_port``) is the alternative where a test needs a TCP store.
- :func:`run_vatra` / :func:`start_vatra` run ``python -m vatra ARGS`` from the repository root, to
  completion or in the background. Prefer ``vatra_in_process`` (conftest) for anything that fails
  before training starts: a subprocess costs a Python + torch start-up (~2 s on the 2-core machine).
"""

from __future__ import annotations

import faulthandler
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from vatra.config import dump_toml, load_config
from vatra.engine.dist import release_process_groups
from vatra.launch import free_port
from vatra.resilience import LATEST, open_store
from vatra.rundir import RunDir, read_jsonl

ROOT = Path(__file__).resolve().parents[1]


def rendezvous(folder: Path, name: str = "rdzv") -> str:
    """A ``file://`` init method under ``folder``: one fresh name per launch (gloo reuses none)."""
    return f"file://{folder / name}"


# What the forkserver imports once per test process, so a spawned rank starts in ~0.02 s instead of
# the ~3 s of CPU a fresh interpreter spends importing torch, vatra and the test module again.
_PRELOAD = [
    *("torch", "torch.distributed", "torch.distributed.checkpoint", "vatra.worker", "tests._dist"),
    *("sklearn.datasets", "sklearn.model_selection", "matplotlib"),  # the digits data, the report
]


def _rank(rank: int, env: dict[str, str], fn: Callable[..., Any], *args: Any) -> None:
    """A forked rank sees the test's environment of now, not the forkserver's of its start."""
    os.environ.clear()
    os.environ.update(env)
    stacks = open(Path(env[_STACKS]) / f"rank{rank}.txt", "w")  # noqa: SIM115 (open while the rank lives)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)  # spawn's timeout asks for them
    fn(rank, *args)


_STACKS = "_VATRA_TEST_STACKS"  # where a spawned rank writes its threads' stacks when asked (SIGUSR1)


def end_group() -> None:
    """A spawned rank's last call: ``destroy_process_group``, then gloo's workers settle with the
    GIL free (:func:`vatra.engine.dist.release_process_groups`). Without the wait, the rank's frame
    could free a DDP reducer, and with it the group, while holding the GIL: the group's destructor
    waits for its worker, which waits for the GIL to drop its last collective's tensors (a hang
    seen in tests/test_comm_lowrank.py; the stacks showed both sides)."""
    dist.destroy_process_group()
    release_process_groups()


def _stacks_of(processes: list[Any], folder: Path) -> str:
    """Every live rank's Python stacks (all threads), asked for by signal: what a hung test shows."""
    for process in processes:
        if process.is_alive():
            os.kill(process.pid, signal.SIGUSR1)
    time.sleep(2.0)
    text = [f"--- {f.stem}\n{f.read_text()[-3000:]}" for f in sorted(folder.glob("rank*.txt"))]
    return "\n".join(t for t in text if t.strip().count("\n") > 1)


def spawn(fn: Callable[..., Any], nprocs: int, args: tuple[Any, ...] = (), *, timeout: float = 270.0) -> None:
    """Run ``fn(rank, *args)`` for rank 0..nprocs-1 in processes of their own and wait for all of them.

    The ranks are forked from a forkserver that has imported torch and vatra once (a clean process
    with no threads, so as safe as ``spawn``), each with this process's environment as it is now.
    A rank that raises fails the test with its traceback (torch kills the other ranks); ranks still
    running after ``timeout`` seconds are killed and the test fails instead of hanging the suite
    (270 s: before pytest-timeout's 300 s, so no rank outlives the test).
    """
    mp.set_forkserver_preload(_PRELOAD)
    with tempfile.TemporaryDirectory(prefix="vatra-stacks-") as folder:
        env = {**os.environ, _STACKS: folder}
        context = mp.start_processes(
            _rank, args=(env, fn, *args), nprocs=nprocs, start_method="forkserver", join=False
        )
        deadline = time.monotonic() + timeout
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                stacks = _stacks_of(context.processes, Path(folder))
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                for process in context.processes:
                    process.join(10)
                pytest.fail(
                    f"{nprocs} spawned ranks of {fn.__name__} still running after {timeout:.0f} s; "
                    f"their stacks:\n{stacks}"
                )


def _env(extra: dict[str, str] | None) -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(extra or {})}


def run_vatra(
    *args: str, timeout: float = 240, cwd: Path = ROOT, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the ``vatra`` command in a subprocess to completion, capturing its output."""
    return subprocess.run(
        [sys.executable, "-m", "vatra", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=_env(env),
    )


def start_vatra(
    *args: str,
    cwd: Path = ROOT,
    env: dict[str, str] | None = None,
    stdout: int = subprocess.PIPE,
    stderr: int = subprocess.PIPE,
    new_session: bool = False,
) -> subprocess.Popen[str]:
    """Start the ``vatra`` command in the background (text pipes); the caller waits or kills it.
    ``new_session`` puts it in its own process group, so a test can signal the whole group, with
    SIGINT as a shell gives a foreground job (default and unblocked): an xdist worker that some
    earlier test left ignoring or blocking it would otherwise pass that on, and Ctrl-C would do nothing."""
    return subprocess.Popen(
        [sys.executable, "-m", "vatra", *args],
        cwd=cwd,
        env=_env(env),
        stdout=stdout,
        stderr=stderr,
        text=True,
        start_new_session=new_session,
        preexec_fn=_terminal_sigint if new_session else None,
    )


def _terminal_sigint() -> None:
    """In the child before exec: SIGINT default and unblocked, as in a terminal's foreground job."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


# report.html costs ~2 s of CPU per run; the report tests write their own
TRAIN_2 = ["--nproc", "2", *("--set", "run.tensorboard=false", "--set", "run.progress=plain")]
TRAIN_2 += ["--set", "monitor.report=false"]


def start_training(run: Path, *args: str) -> subprocess.Popen[str]:
    """``vatra train examples/digits.toml`` on 2 processes into ``run``, in the background."""
    return start_vatra("train", "examples/digits.toml", *TRAIN_2, "--run-dir", str(run), *args)


def final_weights(run: Path, tmp: Path, step: int) -> dict[str, torch.Tensor]:
    """The model weights of a run's ``latest`` checkpoint, which must be the one of ``step``."""
    store = open_store(load_config(run / "config.toml").store, run / "checkpoints")
    manifest = store.materialize(LATEST, tmp / run.name / "dcp")
    out = tmp / run.name / "full.pt"
    dcp_to_torch_save(tmp / run.name / "dcp", out)
    assert manifest["step"] == step
    return dict(torch.load(out, weights_only=True)["model"])


def events(run: Path, kind: str) -> list[dict[str, Any]]:
    """The ``kind`` events of a run folder's events.jsonl, in order."""
    return [e for e in read_jsonl(run / "events.jsonl") if e["event"] == kind]


def _train_rank(rank: int, world: int, port: int, config: str, run: str) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world)
    )
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    from vatra.worker import main

    code = main([config, "--run-dir", run])
    if code:
        raise SystemExit(code)  # spawn fails the test with this rank's exit code


def train_ranks(
    run: Path, *sets: str, config: Path = ROOT / "examples" / "digits.toml", world: int = 2
) -> dict:
    """``vatra train CONFIG --nproc WORLD`` without the command line or the elastic agent: the run
    folder and its config.toml as the command writes them, then ``vatra.worker`` in ``world`` spawned
    ranks meeting on a free port. Returns the run's summary.json. ``sets`` are ``section.key=value``
    (no report.html unless they ask for one)."""
    cfg = load_config(config, ["monitor.report=false", *sets], run="train")  # the report tests write theirs
    RunDir(run).create().config.write_text(dump_toml(cfg))
    spawn(_train_rank, world, (world, free_port(), str(run / "config.toml"), str(run)))
    return dict(json.loads((run / "summary.json").read_text()))


def rewind(run: Path, copy: Path, step: int) -> int:
    """A copy of a finished run with its ``latest`` tag moved back to the version saved at ``step``:
    the run as if it had died after that save (the next launch on ``copy`` resumes there). Returns the
    number of metrics lines the copy already holds (the resumed ones follow them)."""
    shutil.copytree(run, copy)
    store = open_store(load_config(copy / "config.toml").store, copy / "checkpoints")
    (saved,) = [m for m in store.versions() if m["step"] == step]
    store.set_tag(LATEST, str(saved["version"]))
    return len(read_jsonl(copy / "metrics.jsonl"))


def _netns_usable() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        return False
    probe = f"vprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode == 0
    if made:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return made


needs_netns = pytest.mark.skipif(not _netns_usable(), reason="needs root and network namespaces")
