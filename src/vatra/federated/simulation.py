"""``vatra federate``: N clients on one machine (:mod:`vatra.federated.simpool`) or a Ray cluster
(:mod:`vatra.federated.raypool`), the server's rounds in this process."""

from __future__ import annotations

from typing import Any

import torch

from vatra.config import Config, dump_toml
from vatra.federated._base import UploadHook
from vatra.federated.data import Federation
from vatra.federated.owned import OwnedFederation, build_owners
from vatra.federated.private import build_private_hook
from vatra.federated.server import FederatedServer
from vatra.federated.simpool import SimulationExecutor
from vatra.rundir import RunDir


def simulation_executor(
    cfg: Config, fed: Federation | OwnedFederation, hook: UploadHook | None = None
) -> SimulationExecutor:
    """The executor ``federated.backend`` names: this machine's processes, or a Ray cluster."""
    if cfg.federated.backend == "ray":
        from vatra.federated.raypool import RayExecutor

        return RayExecutor(cfg, fed, hook)
    return SimulationExecutor(cfg, fed, hook)


def simulate(
    cfg: Config, run_dir: RunDir, *, hook: UploadHook | None = None, progress: bool = True
) -> dict[str, Any]:
    """Run ``federated.rounds`` rounds in this process tree; writes and returns the summary.

    The owners' rows are written to the run folder as ``partition.json`` (the form
    ``federated.partition.file`` reads), so the same partition can be reproduced anywhere.
    """
    torch.set_num_threads(1)
    if cfg.data.name == "delta":  # the owners' rows come from one pinned version, named in config.toml
        from vatra.data.tables.source import pin

        cfg = pin(cfg)
    run_dir.create()
    run_dir.config.write_text(dump_toml(cfg))
    fed = build_owners(cfg)
    rows = fed.partition_json()  # None: owners read their own sources (federated.client_data)
    if rows is not None:
        (run_dir.path / "partition.json").write_text(rows)
    hook = hook or build_private_hook(cfg, run_dir)  # None unless secure aggregation or DP is on
    executor = simulation_executor(cfg, fed, hook)
    clients = hook.wrap(executor) if hook is not None else executor
    try:
        server = FederatedServer(
            cfg, fed.spec, run_dir, clients, eval_data=fed.server_val, hook=hook, progress=progress
        )
        return server.run()
    finally:
        executor.close()
