"""Helpers for the federated deployment tests: certificates, servers and clients in threads."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vatra.config import Config
from vatra.data import Split
from vatra.federated.grpc import run_client, serve
from vatra.launch import free_port
from vatra.rundir import RunDir


def join_body(cfg: Config) -> bytes:
    """A hand-made client's Join message: the spec of the config's dataset and its row count."""
    from vatra.data import build_dataset
    from vatra.federated.data import spec_to_json
    from vatra.federated.wire import encode

    train, _, spec = build_dataset(cfg.data, cfg.run.seed)
    return encode({"kind": "join", "spec": spec_to_json(spec), "num_train": len(train)})  # type: ignore[arg-type]


class Background(threading.Thread):
    """Runs ``fn`` in a daemon thread and keeps its result or exception for ``join_result``."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self.fn = fn
        self.result: Any = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as exc:  # handed to the test thread
            self.error = exc

    def join_result(self, timeout: float) -> Any:
        self.join(timeout)
        assert not self.is_alive(), f"still running after {timeout} s"
        if self.error is not None:
            raise self.error
        return self.result


def start_server(cfg: Config, certs: Path, run_dir: Path, **kw: Any) -> tuple[Background, str]:
    """A real gRPC server with TLS on a free loopback port, in a thread; returns once it listens."""
    address = f"127.0.0.1:{free_port()}"
    bound = threading.Event()
    thread = Background(
        lambda: serve(
            cfg, address, certs, RunDir(run_dir), progress=False, on_bound=lambda _: bound.set(), **kw
        )
    )
    assert bound.wait(60) or thread.error is None, thread.error
    return thread, address


def start_client(cfg: Config, address: str, cid: int, certs: Path, **kw: Any) -> Background:
    return Background(lambda: run_client(cfg, address, cid, certs, progress=False, **kw))


READ: list[int] = []  # the clients the factory below was asked for


def owner_rows(cid: int, seed: int) -> tuple[Split, Split]:
    """A user's factory: client ``cid``'s own 24 rows of 64 features (12 held out)."""
    READ.append(cid)
    rng = np.random.default_rng([seed, cid])
    x = torch.from_numpy(rng.random((36, 64), dtype=np.float32))
    y = torch.from_numpy(rng.integers(0, 10, 36))
    return Split(x[:24], y[:24]), Split(x[24:], y[24:])
