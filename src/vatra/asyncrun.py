"""``vatra.fit`` under ``dist.mode = "async"``: each process supervises one worker or server.

Of the job's N processes (torchrun's RANK / WORLD_SIZE), S (``dist.servers``) are parameter servers,
spread over the hosts (:func:`place`; on one host the last S ranks), and the others workers. Each
process runs its role in a child process and restarts it in place when it dies
(``async.restarts`` times), so one dead worker does not stop the others — the elastic agent, which
restarts the whole group when any process fails, sees nothing. The roles find each other through
the job's TCP store (the elastic agent's, or the one rank 0 hosts).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from vatra._child import take_errors, write_error
from vatra._io import atomic_write
from vatra.assembly import build_plugins, prepare_run
from vatra.asyncdp.ps import AsyncWorker, Server
from vatra.config import Config
from vatra.engine import DistContext, Plugin, Trainer
from vatra.errors import ConfigError, VatraError
from vatra.rundir import RunDir

FINAL = "final-model.pt"
# How a role's child starts: a fresh interpreter, since forking a process that runs threads (the
# launcher's, torch's) can deadlock; a test forks from a thread-free rank to skip the ~3 s imports.
START_METHOD = "spawn"


def job_store(timeout_s: float, *, host: bool) -> dist.Store:
    """The job's TCP store (MASTER_ADDR / MASTER_PORT), under a prefix of this launch attempt;
    ``host``: this process serves it when the elastic agent does not."""
    try:
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except KeyError:
        raise ConfigError(
            "dist.mode = 'async' needs a job of several processes: start it with vatra train --nproc N "
            "(or torchrun), which sets MASTER_ADDR and MASTER_PORT"
        ) from None
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(
        addr, port, is_master=host and not agent, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"vatra-async/{os.environ.get('TORCHELASTIC_RUN_ID', 'job')}/{attempt}", store)


class StoreShare:
    """Rank 0's objects on every process of an asynchronous job, through the job's store (the
    roles share no process group): what :func:`~vatra.assembly.prepare_run` needs."""

    def __init__(self, store: dist.Store, rank: int, world_size: int) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.sent = 0  # the calls so far: every process makes the same ones, in the same order

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def broadcast_object(self, obj: object, src: int = 0) -> object:
        key = f"share/{self.sent}"
        self.sent += 1
        if self.rank == src:
            self.store.set(key, pickle.dumps(obj))  # type: ignore[arg-type]  # bytes: the stub says str
            return obj
        return pickle.loads(self.store.get(key))  # waits up to dist.timeout_s for rank ``src``

    def barrier(self) -> None:
        """The others wait until rank 0 gets here; rank 0 waits for no one. In :func:`prepare_run`
        only rank 0 writes (the run folder, its config.toml), so that is the order it needs."""
        self.broadcast_object(None)


def roles(cfg: Config, world: int) -> tuple[int, int]:
    """(workers, servers) of a job of ``world`` processes."""
    servers = cfg.dist.servers
    if world - servers < 1:
        raise ConfigError(
            f"dist.mode = 'async' with dist.servers = {servers} needs at least {servers + 1} processes "
            f"(workers, then servers), got {world}; start more (--nproc {servers + 1}) or lower dist.servers"
        )
    return world - servers, servers


def place(rank: int, world: int, per_host: int, servers: int) -> tuple[str, int]:
    """Rank ``rank``'s role and index in a job of ``world`` ranks, ``per_host`` on each host (torchrun's
    LOCAL_WORLD_SIZE; ranks numbered host by host). The servers take each host's last slot from the
    last host back, then the slot before it, so no host gets a second server before every host has
    one and the shards' traffic crosses as many links as it can; numbered by rank, as the workers."""
    per_host = per_host if per_host > 0 and world % per_host == 0 else world
    hosts = world // per_host
    slots = [(hosts - 1 - p % hosts) * per_host + per_host - 1 - p // hosts for p in range(world)]
    chosen = sorted(slots[:servers])
    if rank in chosen:
        return "server", chosen.index(rank)
    return "worker", sum(1 for r in range(rank) if r not in chosen)


def fit_async(
    cfg: Config,
    *,
    model: nn.Module | None,
    train: Any,
    val: Any,
    loss: Any,
    plugins: tuple[Plugin, ...],
    run_dir: str | Path | None,
) -> tuple[dict[str, Any], nn.Module, Path]:
    """This process's role, supervised; returns (summary, model, run folder) as ``vatra.fit`` does."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    workers, _ = roles(cfg, world)
    store = job_store(cfg.dist.timeout_s, host=rank == 0)
    # the Delta version, the folder and the drift check, as a synchronous run's; the roles get
    # the pinned config
    cfg, rd = prepare_run(cfg, StoreShare(store, rank, world), run_dir, data_given=train is not None)
    role, index = place(rank, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)), cfg.dist.servers)
    objects = (model, train, val, loss, plugins)
    try:
        pickle.dumps(objects)
    except Exception as err:
        raise ConfigError(
            f"dist.mode = 'async' runs each role in a child process, which needs the model, data and "
            f"loss given to vatra.fit to pickle ({type(err).__name__}: {err}); define them at module level"
        ) from None
    supervise(cfg, role, index, workers, rd, objects)
    final = rd.checkpoints / "async" / FINAL
    summary: dict[str, Any] = {}
    if rank == 0 and rd.summary.exists():
        import json

        summary = json.loads(rd.summary.read_text())
    trained = model
    if role == "worker" and final.exists():
        trained = torch.load(final, weights_only=False)
    return summary, trained if trained is not None else nn.Module(), rd.path


def supervise(cfg: Config, role: str, index: int, workers: int, rd: RunDir, objects: tuple[Any, ...]) -> None:
    """Run the role in a child process; restart it in place when it dies, up to ``async.restarts``.

    The child leaves its one-line error through :mod:`vatra._child`, in a folder of this process's
    own (off the run folder, as the launcher's)."""
    ctx: Any = mp.get_context(START_METHOD)  # a spawn or fork context (the stub types neither)
    with tempfile.TemporaryDirectory(prefix=f"vatra-{role}{index}-") as errors:
        for incarnation in range(cfg.async_.restarts + 1):
            proc = ctx.Process(
                target=_child,
                args=(cfg, role, index, workers, incarnation, str(rd.path), objects, errors),
                name=f"vatra-{role}{index}",
            )
            proc.start()
            proc.join()
            # none when the child left without a word (killed, or an unexpected exception)
            said = next(iter(take_errors(Path(errors))), None)
            if proc.exitcode == 0:
                return
            if said is not None and said["exit_code"] == 2:  # a config error: the same after any restart
                raise ConfigError(said["message"])
            rd.log_event(
                "async_restart", role=role, index=index, exit_code=proc.exitcode, incarnation=incarnation + 1,
                error=None if said is None else said["message"],
            )  # fmt: skip
    raise VatraError(
        f"async {role} {index} died {cfg.async_.restarts + 1} times (last exit code {proc.exitcode}); "
        "see events.jsonl, or raise async.restarts"
    )


def _child(
    cfg: Config,
    role: str,
    index: int,
    workers: int,
    incarnation: int,
    run_path: str,
    objects: tuple[Any, ...],
    errors: str,
) -> None:
    if "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    rd = RunDir(Path(run_path))
    try:
        store = job_store(cfg.dist.timeout_s, host=False)
        if role == "server":
            Server(cfg, index, workers, store, rd, incarnation).run()
        else:
            run_worker(cfg, index, workers, store, rd, incarnation, objects)
    except VatraError as err:
        write_error(Path(errors), "child", str(err), err.exit_code)
        sys.exit(err.exit_code)


def run_worker(
    cfg: Config,
    index: int,
    workers: int,
    store: dist.Store,
    rd: RunDir,
    incarnation: int,
    objects: tuple[Any, ...] = (None, None, None, None, ()),
) -> dict[str, Any]:
    """Worker ``index`` of ``workers``: its own share of the data, no process group."""
    model, train, val, loss, extra = objects
    if cfg.chaos.kill_rank >= workers:  # a server's kill: the server counts its own updates
        cfg = cfg.model_copy(update={"chaos": cfg.chaos.model_copy(update={"kill_at_steps": []})})
    if index:  # worker 0 writes the run's records; the others each keep a folder of their own, quietly
        rd = RunDir(rd.path / "workers" / f"worker-{index}").create()
        run = cfg.run.model_copy(update={"progress": "off"})
        monitor = cfg.monitor.model_copy(update={"report": False})
        cfg = cfg.model_copy(update={"run": run, "monitor": monitor})
    ctx = DistContext(rank=index, world_size=workers, collective=False)
    worker = AsyncWorker(cfg, store, cfg.dist.servers, rd, incarnation)
    trainer = Trainer.from_config(
        cfg, model=model, train=train, val=val, loss=loss, dist=ctx,
        plugins=build_plugins(cfg, rd, extra, mode=worker), run_dir=rd,
    )  # fmt: skip
    summary = trainer.fit()
    final = rd.checkpoints / "async" / FINAL  # every worker ends with the servers' final parameters
    if index == 0:
        final.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(final, lambda f: torch.save(trainer.model, f), durable=True)
    return summary
