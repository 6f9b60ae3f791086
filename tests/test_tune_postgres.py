"""Two trial workers and a joining machine on a real, throwaway PostgreSQL (initdb + pg_ctl on a free
port, password logins over TCP): the password reaches libpq from the URL, PGPASSWORD or a password
file, and no file, log or command line; skipped where the server binaries are not installed."""

from __future__ import annotations

import glob
import json
import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from tests._dist import run_vatra
from tests._tune_helpers import write_config

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


@dataclass
class Server:
    """A throwaway PostgreSQL server: ``url`` (no password in it) and the password its TCP
    connections need (scram-sha-256; the Unix socket, used to set it up, trusts)."""

    url: str
    password: str
    port: int


@pytest.fixture
def postgres() -> Iterator[Server]:
    """A database ``tune`` on a fresh server. The server refuses to run as root: as root it runs
    as the ``postgres`` user (created by the Debian package) or ``nobody``."""
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
    # every character a URL or ~/.pgpass must escape, around a token no other text holds
    password = f"p@s:s/w?r%d#{secrets.token_hex(8)}&\\"
    (base / "pw").write_text(password + "\n")
    if user is not None:
        for path in (base, sock, base / "pw"):
            shutil.chown(path, user)

    def as_user(*cmd: str) -> subprocess.CompletedProcess[str]:
        full = ["runuser", "-u", user, "--", *cmd] if user is not None else list(cmd)
        return subprocess.run(full, capture_output=True, text=True, timeout=120, check=False)

    port = free_port()
    try:
        auth = ["--auth-local=trust", "--auth-host=scram-sha-256", f"--pwfile={base / 'pw'}"]
        done = as_user(initdb, "-D", str(data), "-U", "vatra", *auth, "-E", "UTF8")
        assert done.returncode == 0, done.stderr
        opts = f"-p {port} -k {sock} -c listen_addresses=127.0.0.1 -c fsync=off"
        done = as_user(pg_ctl, "-D", str(data), "-o", opts, "-l", str(base / "log"), "-w", "start")
        assert done.returncode == 0, done.stderr + (base / "log").read_text()
        createdb = pg_bin("createdb") or "createdb"
        done = as_user(createdb, "-h", str(sock), "-p", str(port), "-U", "vatra", "tune")
        assert done.returncode == 0, done.stderr
        yield Server(f"postgresql://vatra@127.0.0.1:{port}/tune", password, port)
    finally:
        as_user(pg_ctl, "-D", str(data), "-m", "immediate", "stop")
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def no_password(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No PGPASSWORD and no password file: libpq finds a password only where a test puts one.
    Returns the path PGPASSFILE names (absent until a test writes it)."""
    monkeypatch.delenv("PGPASSWORD", raising=False)
    monkeypatch.setenv("PGPASSFILE", str(tmp_path / "pgpass"))
    return tmp_path / "pgpass"


@pytest.mark.slow(40)
def test_two_workers_and_a_joining_one_complete_a_study_on_postgres_and_its_password_leaks_nowhere(
    tmp_path: Path,
    postgres: Server,
    no_password: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from vatra.tune import study as study_module

    # Prepare: one thread per worker (a tiny model; more threads only contend for the CPU). The
    # first machine has the password in its URL (percent-encoded, as a URL must write '@', ':', '/');
    # every worker's command line is read from /proc the moment it starts, as `ps` would show it
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    path = write_config(tmp_path, {"trials": 3}, monitor={"report": True})
    folder = tmp_path / "runs" / "st"
    url = postgres.url.replace("vatra@", f"vatra:{quote(postgres.password, safe='')}@")
    popen, seen = subprocess.Popen, []

    def spawn(args: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        proc = popen(args, **kwargs)
        cmdline, deadline = b"", time.monotonic() + 10
        while not cmdline and time.monotonic() < deadline:  # empty until the exec has set it up
            cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        seen.append(cmdline)
        return proc

    monkeypatch.setattr(study_module.subprocess, "Popen", spawn)

    # Execute: 2 workers run 3 trials; then another "machine" joins the study and adds one more,
    # with the password in PGPASSWORD, where libpq (under psycopg) reads it in every worker
    main(["tune", str(path), "--workers", "2", "--storage", url])
    said = capsys.readouterr()
    monkeypatch.setenv("PGPASSWORD", postgres.password)
    joined = run_vatra(
        "tune", str(path), "--join", "st", "--storage", postgres.url, "--set", "tune.trials=4", timeout=180
    )

    # Assert: one study, its trials numbered by one counter
    assert joined.returncode == 0, joined.stderr[-2000:]
    data = json.loads((folder / "study.json").read_text())
    numbers = [t["number"] for t in data["trials"]]
    assert sorted(numbers) == list(range(len(numbers)))  # unique, from one counter
    assert sum(t["state"] == "COMPLETE" for t in data["trials"]) == 4
    assert data["storage"] == postgres.url  # the URL less its password
    # ... and the password (its token: in any encoding) is in no file of the study folder (configs,
    # study.json, report.html, events), no worker's command line and no line the command printed
    token = postgres.password.split("#")[1][:16].encode()
    assert (folder / "report.html").is_file() and (folder / "trial-2" / "config.toml").is_file()
    assert [p for p in folder.rglob("*") if p.is_file() and token in p.read_bytes()] == []
    # 2 workers of the first machine, and the joining command (its workers start in it, unseen)
    assert len(seen) == 3 and all(b"--storage" in line and token not in line for line in seen)
    assert token.decode() not in said.out + said.err + joined.stdout + joined.stderr
    assert "kept out of the study's files" in said.err
    with pytest.raises(SystemExit) as exit_:
        main(["tune", str(path), "--join", "nope", "--storage", postgres.url])
    assert exit_.value.code == 2 and "--join nope: no such study" in capsys.readouterr().err


def test_the_password_comes_from_a_password_file_and_none_is_one_error_line(
    tmp_path: Path, postgres: Server, no_password: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from vatra.tune.study import open_storage

    # Prepare: a libpq password file (":" and "\" escaped with "\"), readable by its owner only
    path = write_config(tmp_path, {"trials": 1})
    escaped = postgres.password.replace("\\", "\\\\").replace(":", "\\:")

    # Execute + Assert: without a password the connection is refused in one line, naming no secret
    with pytest.raises(SystemExit) as exit_:
        main(["tune", str(path), "--storage", postgres.url])
    err = capsys.readouterr().err
    assert (
        exit_.value.code == 1 and err.startswith("error: tune.storage: cannot open") and err.count("\n") == 1
    )

    # Execute + Assert: with the file libpq reads the password itself (the URL has none)
    no_password.write_text(f"127.0.0.1:{postgres.port}:tune:vatra:{escaped}\n")
    no_password.chmod(0o600)
    storage = open_storage(postgres.url)
    assert storage.get_all_studies() == []
