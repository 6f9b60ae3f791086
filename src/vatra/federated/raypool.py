"""``federated.backend = "ray"``: a simulation's clients run on a Ray cluster, one actor per worker.

Each actor is a simulation worker (:func:`~vatra.federated.simpool._init_worker`) in its own
Ray process: it builds the model and the owners' data source from the config itself (rows are
read there, never pickled from the driver) and trains whichever clients it is handed, with the
same code as the in-process backend: the vmapped group when the round's config allows it (a
group of any size, so a client's update does not depend on how the round was split), else client
by client. Client ``c`` always runs on actor ``c mod actors``. The driver keeps the server, the
selection and the aggregation, and sends each client the same wire blob the in-process backend
encodes, so a seed gives the same per-client results and the same aggregate, bit for bit
(``tests/test_fl_ray.py``).

Without ``federated.ray_address`` the run starts a local Ray (one CPU per actor) and stops it
after; with one it joins that cluster (``ray start --head`` on one machine, ``ray start
--address=HEAD`` on the others; vatra and the data must be reachable on every node) and leaves
it running. An actor lost mid-round (a node gone) fails the clients it held for that round; Ray
restarts it for the next.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

import numpy as np

from vatra._extras import require
from vatra.errors import ConfigError
from vatra.federated.simpool import SimulationExecutor, _init_worker, _run_eval, _run_group, _run_task

FEATURE = "federated.backend = 'ray'"


def _probe(address: str, timeout_s: float = 3.0) -> None:
    """Raise OSError unless something listens at ``host:port`` (``auto`` and ``ray://`` are Ray's)."""
    host, sep, port = address.rpartition(":")
    if not sep or "://" in address or not port.isdigit():
        return
    with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s):
        pass


def _last_line(err: BaseException) -> str:
    """The error a Ray traceback ends with, without its class's module path."""
    line = str(err).strip().splitlines()[-1]
    name, sep, message = line.partition(": ")
    return message if sep and name.replace(".", "").replace("_", "").isalnum() else line


class ClientHost:
    """One Ray actor's simulation worker: the model, and the owners' data read on demand."""

    def __init__(self, raw_cfg: dict[str, Any], hook: Any) -> None:
        _init_worker(raw_cfg, hook)

    def ready(self) -> bool:
        return True

    def train(
        self, blobs: list[bytes], personal: list[np.ndarray | None], grouped: bool
    ) -> list[tuple[bytes, np.ndarray | None]]:
        """The clients' results; ``grouped``: the round would be vmapped in process, so it is here."""
        together = _run_group(blobs) if grouped else None
        if together is not None:
            return list(together)
        return [_run_task(b, p) for b, p in zip(blobs, personal, strict=True)]

    def score(self, blobs: list[bytes], personal: list[np.ndarray | None]) -> list[bytes]:
        return [_run_eval(b, p) for b, p in zip(blobs, personal, strict=True)]


class RayExecutor(SimulationExecutor):
    """The simulation executor whose workers are Ray actors (see the module docstring)."""

    actors: list[Any]
    owns_ray: bool

    def _start(self) -> None:
        ray = require("ray", "ray", FEATURE)
        address = self.cfg.federated.ray_address
        self.owns_ray = not ray.is_initialized()
        local = self.workers if self.workers > 1 else os.cpu_count() or 1
        quiet: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.ERROR}
        if self.owns_ray and address:
            try:
                _probe(address)  # Ray itself retries an address that does not answer for minutes
                ray.init(address=address, **quiet)
            except (OSError, ValueError, RuntimeError) as err:
                first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                raise ConfigError(
                    f"federated.ray_address = {address!r}: no Ray cluster to join ({first}); start one "
                    "with `ray start --head`, or leave ray_address empty for a local Ray"
                ) from None
        elif self.owns_ray:
            ray.init(address="local", num_cpus=local, include_dashboard=False, **quiet)
        try:
            cpus = float(ray.cluster_resources().get("CPU", 1.0))
            count = self.workers if self.workers > 1 else max(1, int(cpus))
            host = ray.remote(ClientHost).options(
                num_cpus=min(1.0, cpus / count), max_restarts=1, scheduling_strategy="SPREAD"
            )
            raw = self.cfg.model_dump(mode="json")
            self.actors = [host.remote(raw, self.hook) for _ in range(count)]
            self._gather([a.ready.remote() for a in self.actors])
        except BaseException:
            self.close()
            raise

    def _gather(self, refs: list[Any]) -> list[Any]:
        """``ray.get`` of each ref; a task's own exception is raised as itself (the in-process
        backend's error), a lost actor is its clients' failure: a string that says so."""
        ray = require("ray", "ray", FEATURE)
        out: list[Any] = []
        for ref in refs:
            try:
                out.append(ray.get(ref))
            except ray.exceptions.RayTaskError as err:
                raise err.cause from None
            except ray.exceptions.RayActorError as err:
                if getattr(err, "actor_init_failed", False):  # the config or data fails on that node
                    raise ConfigError(f"{FEATURE}: a Ray worker could not start: {_last_line(err)}") from None
                first = str(err).strip().splitlines()[0]
                out.append(f"its Ray worker was lost ({first})")
        return out

    def _split(self, order: list[int]) -> list[list[int]]:
        """Positions in ``order`` per actor: client ``c`` runs on actor ``c mod actors``."""
        parts: list[list[int]] = [[] for _ in self.actors]
        for i, c in enumerate(order):
            parts[c % len(self.actors)].append(i)
        return parts

    def _run(self, method: str, order: list[int], blobs: list[bytes], *args: Any) -> list[Any]:
        parts = [(a, p) for a, p in zip(self.actors, self._split(order), strict=True) if p]
        refs = [
            getattr(actor, method).remote(
                [blobs[i] for i in part], [self.personal.get(order[i]) for i in part], *args
            )
            for actor, part in parts
        ]
        outs: list[Any] = [None] * len(order)
        for (_, part), got in zip(parts, self._gather(refs), strict=True):
            for j, i in enumerate(part):
                outs[i] = got if isinstance(got, str) else got[j]
        return outs

    def _train(self, order: list[int], blobs: list[bytes]) -> list[tuple[bytes, np.ndarray | None] | str]:
        return self._run("train", order, blobs, len(blobs) > 1)

    def _score(self, order: list[int], blobs: list[bytes]) -> list[bytes | str]:
        return self._run("score", order, blobs)

    def close(self) -> None:
        ray = require("ray", "ray", FEATURE)
        for actor in getattr(self, "actors", []):
            ray.kill(actor)
        self.actors = []
        if getattr(self, "owns_ray", False) and ray.is_initialized():
            ray.shutdown()
        self.owns_ray = False
