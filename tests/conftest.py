"""Shared test fixtures: small configs, the command line in process, a small disk, an S3 server."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from tests._dist import ROOT

from vatra.config import Config, config_from_dict
from vatra.data._base import DatasetSpec


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``slow(seconds)`` run first, the slowest first, the rest in file order.

    xdist (``-n N --dist loadgroup``) hands tests out in collection order (the ``xdist_group``s
    first): a slow test handed out last keeps one worker busy after the others are done. The
    seconds are a test's time in a full parallel run (the table in docs/architecture.md)."""

    def seconds(item: pytest.Item) -> float:
        mark = item.get_closest_marker("slow")
        return float(mark.args[0]) if mark is not None and mark.args else 0.0

    items.sort(key=seconds, reverse=True)  # stable: unmarked tests keep their order


def pytest_report_header() -> str:
    """The run's first lines say which PyTorch the suite tested (pyproject.toml accepts a range)."""
    import torch

    return f"torch {torch.__version__}"


@pytest.fixture(autouse=True)
def _own_incident_history(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Launchers keep a host's incident history (vatra.launch.incidents): each test starts with an
    empty one of its own, never the machine's, so no test's failures change another's launch."""
    monkeypatch.setenv("VATRA_INCIDENTS_DIR", str(tmp_path_factory.mktemp("incidents")))


def small_config(**sections: dict) -> Config:
    """Digits + small MLP + SGD, quiet: fast enough for unit tests."""
    raw: dict = {
        "run": {"progress": "off", "tensorboard": False},
        "data": {"name": "digits"},
        "model": {"name": "mlp", "hidden": [32]},
        "train": {"steps": 5, "batch_size": 8, "eval_every": 0},
        "optim": {"name": "sgd", "lr": 0.1},
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return config_from_dict(raw)


def dataset_spec(kind: str, num_classes: int = 0, **kw: Any) -> DatasetSpec:
    """A task's spec on 4 input features (the losses and metrics tests' models)."""
    return DatasetSpec(kind=kind, input_shape=(4,), num_classes=num_classes, **kw)  # type: ignore[arg-type]


@pytest.fixture
def root() -> Path:
    return ROOT


@contextmanager
def small_disk(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (``"1m"``, ``"720k"``) mounted at ``path``: a disk that really fills up.
    Skips the test without root or ``mount``; unmounted afterwards."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    path.mkdir(parents=True, exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def vatra_in_process(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``vatra ARGS`` run in this process through the console entry: (exit code, stdout, stderr)."""
    from vatra.cli import main

    try:
        main(list(args))
        code = 0
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


@contextmanager
def _moto_server() -> Iterator[dict[str, str]]:
    """A real S3-compatible server (moto_server) on a free port; skips the test when it cannot start."""
    pytest.importorskip("s3fs")
    exe = shutil.which("moto_server") or str(Path(sys.executable).parent / "moto_server")
    if not Path(exe).exists():
        pytest.skip("moto_server is not installed (pip install 'moto[server]')")
    from vatra.launch import free_port

    port = free_port()
    proc = subprocess.Popen(
        [exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            if proc.poll() is not None:
                pytest.skip("moto_server exited at start")
            time.sleep(0.2)
    else:
        proc.kill()
        pytest.skip("moto_server did not start within 30 s")
    endpoint = f"http://127.0.0.1:{port}"
    options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    import s3fs

    s3fs.S3FileSystem(**options).mkdir("ckpt-bucket")
    try:
        yield options
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture
def s3_server() -> Iterator[dict[str, str]]:
    """A real S3-compatible server (moto_server) on a free port, with a bucket ``ckpt-bucket``."""
    with _moto_server() as options:
        yield options


@pytest.fixture(scope="module")
def s3_server_shared() -> Iterator[dict[str, str]]:
    """One moto_server for a whole test module (~2 s saved per test): tests use distinct prefixes."""
    with _moto_server() as options:
        yield options
