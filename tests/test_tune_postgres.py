"""Two trial workers and a joining machine on a real, throwaway PostgreSQL (initdb + pg_ctl on a free
port); skipped where the PostgreSQL server binaries are not installed."""

from __future__ import annotations

import glob
import json
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.conftest import run_vatra
from tests.test_tune import write_config

from vatra.cli import main
from vatra.launch.local import free_port

pytest.importorskip("optuna")
pytest.importorskip("psycopg")


def pg_bin(name: str) -> str | None:
    """A PostgreSQL server binary: on PATH, or in Debian's versioned folder (not on PATH there)."""
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return candidates[-1] if candidates else None


@pytest.fixture
def postgres() -> Iterator[str]:
    """A database ``tune`` on a fresh server; yields its URL. The server refuses to run as root:
    as root it runs as the ``postgres`` user (created by the Debian package) or ``nobody``."""
    initdb, pg_ctl = pg_bin("initdb"), pg_bin("pg_ctl")
    if initdb is None or pg_ctl is None:
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) are not installed")
    user: str | None = None
    if os.geteuid() == 0:
        names = [p.pw_name for p in pwd.getpwall()]
        user = "postgres" if "postgres" in names else "nobody"
    base = Path(tempfile.mkdtemp(prefix="vatra-pg-"))  # under /tmp: readable by that user
    data, sock = base / "data", base / "sock"
    sock.mkdir()
    if user is not None:
        shutil.chown(base, user)
        shutil.chown(sock, user)

    def as_user(*cmd: str) -> subprocess.CompletedProcess[str]:
        full = ["runuser", "-u", user, "--", *cmd] if user is not None else list(cmd)
        return subprocess.run(full, capture_output=True, text=True, timeout=120, check=False)

    port = free_port()
    try:
        done = as_user(initdb, "-D", str(data), "-U", "vatra", "--auth=trust", "-E", "UTF8")
        assert done.returncode == 0, done.stderr
        opts = f"-p {port} -k {sock} -c listen_addresses=127.0.0.1 -c fsync=off"
        done = as_user(pg_ctl, "-D", str(data), "-o", opts, "-l", str(base / "log"), "-w", "start")
        assert done.returncode == 0, done.stderr + (base / "log").read_text()
        createdb = pg_bin("createdb") or "createdb"
        done = as_user(createdb, "-h", "127.0.0.1", "-p", str(port), "-U", "vatra", "tune")
        assert done.returncode == 0, done.stderr
        yield f"postgresql://vatra@127.0.0.1:{port}/tune"
    finally:
        as_user(pg_ctl, "-D", str(data), "-m", "immediate", "stop")
        shutil.rmtree(base, ignore_errors=True)


def test_two_workers_and_a_joining_one_complete_a_study_on_postgres(
    tmp_path: Path, postgres: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare: one thread per worker (a tiny model; more threads only contend for the CPU)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    path = write_config(tmp_path, {"trials": 3}, monitor={"report": False})  # report: see test_tune
    folder = tmp_path / "runs" / "st"

    # Execute: 2 workers run 3 trials; then another "machine" joins the study and adds one more
    first = run_vatra("tune", str(path), "--workers", "2", "--storage", postgres, timeout=180)
    joined = run_vatra(
        "tune", str(path), "--join", "st", "--storage", postgres, "--set", "tune.trials=4", timeout=180
    )

    # Assert
    assert first.returncode == 0, first.stderr[-2000:]
    assert joined.returncode == 0, joined.stderr[-2000:]
    data = json.loads((folder / "study.json").read_text())
    numbers = [t["number"] for t in data["trials"]]
    assert sorted(numbers) == list(range(len(numbers)))  # unique, from one counter
    assert sum(t["state"] == "COMPLETE" for t in data["trials"]) == 4
    assert data["storage"].startswith("postgresql://vatra@127.0.0.1")
    with pytest.raises(SystemExit) as exit_:
        main(["tune", str(path), "--join", "nope", "--storage", postgres])
    assert exit_.value.code == 2 and "--join nope: no such study" in capsys.readouterr().err
