"""``vatra federate``: N clients on one machine, trained by a pool of processes.

Determinism: a client's result depends only on (config, round, client id, the weights it was
sent), never on which worker ran it, and results are aggregated in client-id order; each worker
runs torch on one thread, so a seed gives the same run for any ``federated.workers``.
Messages to and from workers are the same safetensors blobs a deployment sends, so the byte
counts are the wire's.
"""

from __future__ import annotations

import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np
import torch

from vatra.config import Config, config_from_dict, dump_toml
from vatra.federated._base import EvalRes, Failure, FitIns, FitRes, UploadHook
from vatra.federated.client import LocalClient, initial_weights
from vatra.federated.compression import build_upload_hook
from vatra.federated.data import Federation
from vatra.federated.edgesync import EdgeSync
from vatra.federated.owned import OwnedFederation, build_owners
from vatra.federated.private import build_private_hook
from vatra.federated.server import FederatedServer
from vatra.federated.wire import (
    WireError,
    check_update,
    decode_eval_res,
    decode_ins,
    decode_res,
    encode_eval_res,
    encode_ins,
    encode_res,
)
from vatra.rundir import RunDir

_CLIENT: LocalClient | None = None  # one per worker process


def _init_worker(
    raw_cfg: dict[str, Any], hook: UploadHook | None, fed: Federation | OwnedFederation | None = None
) -> None:
    global _CLIENT
    torch.set_num_threads(1)
    cfg = config_from_dict(raw_cfg)
    fed = fed or build_owners(cfg)
    _CLIENT = LocalClient(cfg, fed.spec, fed.client_data, hook)


def _run_task(blob: bytes, personal: np.ndarray | None) -> tuple[bytes, np.ndarray | None]:
    assert _CLIENT is not None, "worker not initialised"
    res, personal = _CLIENT.fit(decode_ins(blob), personal)
    return encode_res(res), personal


def _run_group(blobs: list[bytes]) -> list[tuple[bytes, None]] | None:
    """A round's clients trained together (vmap), or None when their config needs the loop."""
    assert _CLIENT is not None, "worker not initialised"
    results = _CLIENT.fit_group([decode_ins(b) for b in blobs])
    return None if results is None else [(encode_res(r), None) for r in results]


def _run_eval(blob: bytes, personal: np.ndarray | None) -> bytes:
    assert _CLIENT is not None, "worker not initialised"
    return encode_eval_res(_CLIENT.evaluate(decode_ins(blob), personal))


class SimulationExecutor:
    """Every client is always available; a round's clients run in ``workers`` processes (or this one)."""

    def __init__(
        self, cfg: Config, fed: Federation | OwnedFederation, hook: UploadHook | None = None
    ) -> None:
        self.cfg = cfg
        self.fed = fed
        layout = initial_weights(cfg, fed.spec)[1]
        self.hook = hook or build_upload_hook(cfg, layout)
        self.sync = EdgeSync(cfg, layout.shapes)  # what each client's device is sent (fp32 or int8)
        self.sync.check_simulated(cfg.federated.clients)
        self.personal: dict[int, np.ndarray] = {}
        self.holds_out = fed.val_sizes > 0  # (clients,) bool
        self.workers = cfg.federated.workers
        self.pool: ProcessPoolExecutor | None = None
        if self.workers > 1:
            raw = cfg.model_dump(mode="json")
            self.pool = ProcessPoolExecutor(
                self.workers,
                mp_context=mp.get_context("spawn"),
                initializer=_init_worker,
                initargs=(raw, self.hook),
            )
        else:
            _init_worker(cfg.model_dump(mode="json"), self.hook, fed)

    def available(self) -> list[int]:
        return np.arange(self.fed.num_clients).tolist()

    def _map(self, fn: Any, blobs: list[bytes], personal: list[np.ndarray | None]) -> list[Any]:
        if self.pool is None:
            return [fn(b, p) for b, p in zip(blobs, personal, strict=True)]
        chunk = max(1, len(blobs) // (4 * self.workers))
        return list(self.pool.map(fn, blobs, personal, chunksize=chunk))

    def fit(
        self, rnd: int, ins: dict[int, FitIns], expected: int
    ) -> tuple[list[FitRes], list[Failure], int, int]:
        order = sorted(ins)
        blobs = [encode_ins(ins[c], self.sync.download(c)) for c in order]
        grouped = _run_group(blobs) if self.pool is None and len(blobs) > 1 else None
        outs = grouped or self._map(_run_task, blobs, [self.personal.get(c) for c in order])
        results: list[FitRes] = []
        failures: list[Failure] = []
        for c, (blob, head) in zip(order, outs, strict=True):
            if head is not None:
                self.personal[c] = head
            try:
                res = self.hook.decode(decode_res(blob))
            except WireError as err:
                failures.append(Failure(c, str(err)))
                continue
            reason = check_update(res, expected)
            if res.client_id != c:  # a result is kept under the client that was asked, not the one it names
                reason = f"result names client {res.client_id}, but client {c} was asked"
            if reason:
                failures.append(Failure(c, reason))
            else:
                results.append(res)
        return results, failures, sum(map(len, blobs)), sum(len(b) for b, _ in outs)

    def evaluate(self, rnd: int, ins: dict[int, FitIns]) -> tuple[list[EvalRes], list[Failure]]:
        order = [c for c in sorted(ins) if self.holds_out[c]]  # clients that hold rows out
        blobs = [encode_ins(ins[c], self.sync.download(c)) for c in order]  # scored as they run it
        outs = self._map(_run_eval, blobs, [self.personal.get(c) for c in order])
        reports: list[EvalRes] = []
        failures: list[Failure] = []
        for c, blob in zip(order, outs, strict=True):
            try:
                rep = decode_eval_res(blob)
            except WireError as err:
                failures.append(Failure(c, str(err)))
                continue
            if rep.client_id != c:
                failures.append(Failure(c, f"report names client {rep.client_id}, but client {c} was asked"))
            else:
                reports.append(rep)
        return reports, failures

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)
            self.pool = None


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
    executor = SimulationExecutor(cfg, fed, hook)
    clients = hook.wrap(executor) if hook is not None else executor
    try:
        server = FederatedServer(
            cfg, fed.spec, run_dir, clients, eval_data=fed.server_val, hook=hook, progress=progress
        )
        return server.run()
    finally:
        executor.close()
