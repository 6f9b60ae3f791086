"""Leaving a job: ``DistContext.destroy`` frees the process groups nothing uses any more (their gloo
worker threads are joined) and leaves no gloo worker running, so no worker is still dropping a
collective's tensors when the interpreter shuts down (that aborted processes: SIGABRT at exit)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from tests._dist import spawn
from tests.conftest import small_config

from vatra.engine import DistContext
from vatra.engine.dist import _gloo_worker_runnable

WORLD = 2


def _gloo_workers() -> int:
    names = (Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task"))
    return sum(name == "pt_gloo_runloop" for name in names)


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    ctx = DistContext.init(
        small_config().dist, rank=rank, world_size=WORLD, init_method=f"file://{init_file}"
    )
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 1))  # holds the default group
    model(torch.ones(2, 3)).sum().backward()
    # A plugin's own group, in a reference cycle as plugins and trainers are, then dropped
    plugin: dict = {"group": dist.new_group()}
    plugin["self"] = plugin
    for _ in range(5):  # the last collectives just before leaving, as at the end of a run
        dist.all_reduce(torch.ones(100))
        dist.all_reduce(torch.ones(100), group=plugin["group"])
    del plugin
    before = _gloo_workers()
    ctx.destroy()
    after = {"before": before, "after": _gloo_workers(), "runnable": _gloo_worker_runnable()}
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(after))


def test_destroy_frees_unused_groups_and_leaves_no_gloo_worker_running(tmp_path: Path) -> None:
    # Execute: every rank exits cleanly (a SIGABRT would raise here)
    spawn(_worker, WORLD, (str(tmp_path / "rdzv"), str(tmp_path)))
    for rank in range(WORLD):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # Assert: two groups' workers before; the plugin's group freed, its workers joined
        assert seen["before"] == 4, "torch's gloo worker threads are no longer named pt_gloo_runloop"
        assert seen["after"] == 2  # the default group: DDP keeps it alive to the end
        assert seen["runnable"] is False
