"""The in-process simulation backend: a round's clients trained in this process or a process pool.

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

from vatra.config import Config, config_from_dict
from vatra.federated._base import EvalRes, Failure, FitIns, FitRes, UploadHook
from vatra.federated.client import LocalClient, initial_weights
from vatra.federated.compression import build_upload_hook
from vatra.federated.data import Federation
from vatra.federated.edgesync import EdgeSync
from vatra.federated.owned import OwnedFederation, build_owners
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
        self._start()

    def _start(self) -> None:
        """Start the workers that run the clients: a process pool, or this process."""
        raw = self.cfg.model_dump(mode="json")
        if self.workers > 1:
            self.pool = ProcessPoolExecutor(
                self.workers,
                mp_context=mp.get_context("spawn"),
                initializer=_init_worker,
                initargs=(raw, self.hook),
            )
        else:
            _init_worker(raw, self.hook, self.fed)

    def available(self) -> list[int]:
        return np.arange(self.fed.num_clients).tolist()

    def _map(self, fn: Any, blobs: list[bytes], personal: list[np.ndarray | None]) -> list[Any]:
        if self.pool is None:
            return [fn(b, p) for b, p in zip(blobs, personal, strict=True)]
        chunk = max(1, len(blobs) // (4 * self.workers))
        return list(self.pool.map(fn, blobs, personal, chunksize=chunk))

    def _train(self, order: list[int], blobs: list[bytes]) -> list[tuple[bytes, np.ndarray | None] | str]:
        """Each client's (encoded result, new personal head), or why it has none, in ``order``."""
        grouped = _run_group(blobs) if self.pool is None and len(blobs) > 1 else None
        return list(grouped or self._map(_run_task, blobs, [self.personal.get(c) for c in order]))

    def _score(self, order: list[int], blobs: list[bytes]) -> list[bytes | str]:
        """Each client's encoded report, or why it has none, in ``order``."""
        return self._map(_run_eval, blobs, [self.personal.get(c) for c in order])

    def fit(
        self, rnd: int, ins: dict[int, FitIns], expected: int
    ) -> tuple[list[FitRes], list[Failure], int, int]:
        order = sorted(ins)
        blobs = [encode_ins(ins[c], self.sync.download(c)) for c in order]
        outs = self._train(order, blobs)
        results: list[FitRes] = []
        failures: list[Failure] = []
        for c, out in zip(order, outs, strict=True):
            if isinstance(out, str):  # the worker that held it was lost
                failures.append(Failure(c, out))
                continue
            blob, head = out
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
        return results, failures, sum(map(len, blobs)), sum(len(o[0]) for o in outs if not isinstance(o, str))

    def evaluate(self, rnd: int, ins: dict[int, FitIns]) -> tuple[list[EvalRes], list[Failure]]:
        order = [c for c in sorted(ins) if self.holds_out[c]]  # clients that hold rows out
        blobs = [encode_ins(ins[c], self.sync.download(c)) for c in order]
        outs = self._score(order, blobs)
        reports: list[EvalRes] = []
        failures: list[Failure] = []
        for c, blob in zip(order, outs, strict=True):
            if isinstance(blob, str):
                failures.append(Failure(c, blob))
                continue
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
