"""What ``vatra train``'s ranks import after the fork, and when the forkserver starts (issue 36 item 10)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from tests._dist import ROOT

from vatra.config import config_from_dict
from vatra.worker import preload

# A rank's own start, in a fresh interpreter: the forkserver's imports, then what every rank of a
# digits run constructs (an optimizer, a TensorBoard writer); prints the modules that were new.
_RANK = """
import importlib, json, sys, tempfile
for name in sys.argv[1:]:
    importlib.import_module(name)
before = set(sys.modules)
import torch
from torch.utils.tensorboard import SummaryWriter
torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
SummaryWriter(tempfile.mkdtemp()).close()
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def _imported_after(modules: list[str]) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run(
        [sys.executable, "-c", _RANK, *modules], capture_output=True, text=True, check=True, env=env
    )
    return json.loads(out.stdout.splitlines()[-1])


def test_the_forkserver_imports_what_every_rank_would_import_on_its_own() -> None:
    # Prepare: a run that writes TensorBoard (the default)
    modules = preload(config_from_dict({}))

    # Execute
    new = _imported_after(modules)

    # Assert: no rank imports torch._dynamo (every optimizer's constructor does, ~0.9 s) or
    # TensorBoard again after the fork
    heavy = [m for m in new if m.startswith("torch._dynamo") or "tensorboard" in m]
    assert heavy == []


def test_a_run_without_tensorboard_does_not_import_it() -> None:
    assert "torch.utils.tensorboard" not in preload(config_from_dict({"run": {"tensorboard": False}}))
    assert "torch.utils.tensorboard" in preload(config_from_dict({}))


@pytest.mark.skipif(sys.platform != "linux", reason="reads the forkserver's /proc environment")
def test_the_forkserver_starts_at_once_with_the_launchs_thread_cap() -> None:
    # Execute: start it as `vatra train --nproc 2` does, in a fresh interpreter (the forkserver is
    # one per process), and read the environment it was started with
    code = (
        "import multiprocessing.forkserver as fs, os; os.environ.pop('OMP_NUM_THREADS', None)\n"
        "from vatra.launch.forked import start\n"
        "start(['os'], 2)\n"
        "import time; pid = fs._forkserver._forkserver_pid\n"
        # /proc/PID/environ is the forked launcher's until the exec: wait for the forkserver's own
        "while b'forkserver' not in open(f'/proc/{pid}/cmdline', 'rb').read(): time.sleep(0.01)\n"
        "print(b'OMP_NUM_THREADS=' in open(f'/proc/{pid}/environ', 'rb').read())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)

    # Assert: running before any launch, with OMP_NUM_THREADS set (two ranks must not each use every core)
    assert out.stdout.split() == ["True"]
