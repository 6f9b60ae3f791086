"""The run folder: resolved config, metrics, events, summary and TensorBoard files, and the lock
that keeps it to one writer."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import shlex
import socket
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vatra import _child
from vatra._io import atomic_write
from vatra.errors import RunLocked, VatraError, write_failed

ERRORS_ENV = "VATRA_ERRORS_DIR"  # set by the launcher for its workers: where they leave error lines
LOCK = ".lock"  # exclusive: the job's first launcher or a maintenance command; holds the record
LOCK_NODES = ".lock-nodes"  # shared by every launcher of the job while it runs
LOCK_WAIT_S = 1.0  # how long an acquirer retries through another's half-finished acquire


def new_run_id(name: str) -> str:
    """``<name>-<UTC timestamp>-<pid>``: sortable and unique on one machine."""
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{os.getpid()}"


def adopt_run_name(launched: Path, stem: str, name: str, out_dir: str) -> Path:
    """The run folder of a script under ``vatra run``, named as its config says.

    The launcher names the folder ``<stem>-<timestamp>`` after the script, before any config is
    read. When the config names the run (``run.name``, ``run.out_dir``), rank 0 moves the folder to
    ``<out_dir>/<name>-<timestamp>`` and leaves a link at the launcher's path, through which the
    launcher records worker failures and a restarted group finds the same folder. A second call
    (a restart) follows the link. When the move cannot be made (another filesystem), the launcher's
    folder stays the run's.
    """
    if launched.is_symlink():
        return launched.resolve()
    wanted = Path(out_dir) / f"{stem if name == 'run' else name}{launched.name.removeprefix(stem)}"
    if wanted.resolve() == launched.resolve() or wanted.exists():
        return launched
    try:
        wanted.parent.mkdir(parents=True, exist_ok=True)
        os.rename(launched, wanted)
    except OSError:
        return launched
    os.symlink(wanted.resolve(), launched)
    return wanted


def cut_torn_tail(path: Path) -> None:
    """Make ``path`` end at a line boundary before appending to it.

    A last line without its newline that does not parse is an append a crash (or a full disk) cut
    short: it is cut off, so the next line does not continue it (which would damage the file
    mid-way). A whole record that only lacks its newline gets one.
    """
    try:
        f = path.open("r+b")
    except FileNotFoundError:
        return
    with f:
        size = f.seek(0, 2)
        if size == 0:
            return
        f.seek(-1, 2)
        if f.read(1) == b"\n":
            return
        f.seek(0)
        data = f.read()
        cut = data.rfind(b"\n") + 1
        try:
            json.loads(data[cut:])
            f.write(b"\n")
        except ValueError:
            f.truncate(cut)


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON line and flush it, so a crash keeps every line written before it.

    A torn last line is cut first (:func:`cut_torn_tail`); a write that fails half-way (a full
    disk) is undone, so the file never holds half a line, and raises one line
    (:func:`~vatra.errors.write_failed`).
    """
    line = json.dumps(record, default=float) + "\n"
    try:
        cut_torn_tail(path)
        with path.open("ab") as f:
            start = f.tell()
            try:
                f.write(line.encode("utf-8"))
                f.flush()
            except OSError:
                with contextlib.suppress(OSError):
                    f.truncate(start)
                raise
    except OSError as err:
        raise write_failed(err, path) from None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every record of a JSON-lines file, in order ([] when the file does not exist).

    A last line without its newline that does not parse is the append a crash cut short: it is
    skipped with a warning, so a resume can go on. A bad line anywhere else is damage and raises
    :class:`~vatra.errors.VatraError` naming the file and line.
    """
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")  # the last item is "" when the file ends with a newline
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError as err:
            if number == len(lines):  # no newline after it: the write never finished
                warnings.warn(
                    f"{path}: skipped a half-written last line ({len(line)} characters)", stacklevel=2
                )
                break
            raise VatraError(f"{path}, line {number}: not valid JSON ({err}); the file is damaged") from None
    return records


@dataclass(frozen=True)
class RunDir:
    """Paths inside ``runs/<run-id>/`` and the small writers every rank may use."""

    path: Path

    @property
    def config(self) -> Path:
        return self.path / "config.toml"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def events(self) -> Path:
        return self.path / "events.jsonl"

    @property
    def summary(self) -> Path:
        return self.path / "summary.json"

    @property
    def tb(self) -> Path:
        return self.path / "tb"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def create(self) -> RunDir:
        self.path.mkdir(parents=True, exist_ok=True)
        return self

    def log_event(self, kind: str, **fields: Any) -> None:
        """One line in events.jsonl; safe from several ranks (small O_APPEND writes)."""
        append_jsonl(self.events, {"time": time.time(), "event": kind, **fields})

    @property
    def errors(self) -> Path:
        """Where workers leave their one-line errors for the launcher: the folder the launcher
        names in ``VATRA_ERRORS_DIR`` (its own, off the run folder, so a full run disk cannot
        swallow the reason), else ``<run>/errors``."""
        env = os.environ.get(ERRORS_ENV)
        return Path(env) if env else self.path / "errors"

    def write_error(self, rank: int, message: str, exit_code: int, *, peer_lost: bool = False) -> None:
        """A worker's one-line error, for the launcher to report once for the whole group
        (:func:`vatra._child.write_error`, in :attr:`errors`).

        ``peer_lost``: this rank failed only because another rank went away (a collective's
        connection closed); the launcher names the rank that went away instead.
        """
        _child.write_error(self.errors, f"rank{rank:05d}", message, exit_code, peer_lost=peer_lost)

    def take_errors(self) -> list[dict[str, Any]]:
        """The workers' own errors in rank order, removed from the folder (a later attempt starts
        clean); errors of ranks that only lost a peer are dropped."""
        return _child.take_errors(self.errors, "rank*.json")

    @contextmanager
    def lock(self, purpose: str, job: str | None = None) -> Iterator[None]:
        """Hold this folder for one writer while the block runs; raise :class:`RunLocked` at once
        (after at most ``LOCK_WAIT_S``) when another holds it.

        ``purpose`` names the holder in the refusal others get ("vatra train", "vatra ckpt gc"),
        with its pid, host, start time and command line. ``job`` is set only by a launcher of a
        multi-node job (its rendezvous id and endpoint): launchers that pass the same ``job`` share
        the folder, everyone else is refused.

        Why this shape:

        - ``flock`` locks belong to the open file and end with the process that holds them, so a
          launcher killed with SIGKILL leaves no stale lock, and no pid file needs checking. The
          launcher opens the files close-on-exec (Python's default), so the workers it spawns do
          not inherit them and a restarted worker group never touches the lock. (A worker that
          outlives a killed launcher, in its own session as the elastic agent starts it, does
          not hold the folder either: the lock guards launchers, not orphans.) On NFS, Linux emulates
          ``flock`` with POSIX locks; the lock files are read and written only through the locked
          descriptors, because closing any other descriptor of the file would drop those.
        - Multi-node: node launchers of one job may share a run folder on a shared filesystem, and
          which node starts first, or its node rank, is unknown before the rendezvous (``--nnodes
          MIN:MAX``). So the first launcher takes ``.lock`` exclusively and records its ``job``;
          a later launcher that finds it held joins when the record names the same job (the same
          ``--rdzv-id`` and ``--rdzv-endpoint``: two running jobs with both equal would be one
          rendezvous, hence one job). Every launcher of the job also holds ``.lock-nodes`` shared,
          so when the first launcher dies while the others go on (an elastic job that lost a
          node), a new job or ``vatra ckpt gc`` that then gets ``.lock`` still sees that the
          folder is in use (it cannot take ``.lock-nodes`` exclusively), while a replacement
          launcher of the same job is admitted. Without a shared filesystem each host has its own
          folder and lock.
        - An acquirer holds ``.lock-nodes`` exclusively while it writes its record, so a joiner
          that waits for it shared reads a whole record; acquirers that meet in the middle of
          each other's steps back off and retry for up to ``LOCK_WAIT_S``.
        """
        if not self.path.is_dir():
            raise VatraError(f"{self.path}: no such run folder")
        main = self._open_lock_file(LOCK)
        try:
            nodes = self._open_lock_file(LOCK_NODES)
        except VatraError:
            os.close(main)
            raise
        try:
            deadline = time.monotonic() + LOCK_WAIT_S
            while (refusal := _try_lock(main, nodes, self.path, purpose, job)) is not None:
                if time.monotonic() > deadline:
                    raise RunLocked(refusal)
                time.sleep(random.uniform(0.02, 0.08))  # jitter: two acquirers do not retry in step
            yield
        finally:
            os.close(nodes)  # closing releases the locks; the record stays for whoever is refused
            os.close(main)

    def _open_lock_file(self, name: str) -> int:
        try:
            return os.open(self.path / name, os.O_RDWR | os.O_CREAT, 0o644)  # close-on-exec
        except OSError as err:
            raise VatraError(f"cannot lock run folder {self.path}: {err.strerror}") from None

    def write_summary(self, summary: dict[str, Any]) -> None:
        atomic_write(self.summary, json.dumps(summary, indent=2, default=float) + "\n", durable=True)


def _flock(fd: int, mode: int) -> bool:
    """Try one ``flock`` without blocking; False when another holds a conflicting lock."""
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _try_lock(main: int, nodes: int, path: Path, purpose: str, job: str | None) -> str | None:
    """One attempt of :meth:`RunDir.lock`: None when admitted (the locks are held), else why not
    (nothing is held then)."""
    if _flock(main, fcntl.LOCK_EX):
        if _flock(nodes, fcntl.LOCK_EX):  # no launcher of an earlier job runs here
            _write_record(main, purpose, job)
            fcntl.flock(nodes, fcntl.LOCK_SH)  # let launchers of this job join
            return None
        record = _read_record(main)
        if job is not None and record.get("job") == job:  # it replaces a launcher of this job
            _write_record(main, purpose, job)
            fcntl.flock(nodes, fcntl.LOCK_SH)  # only shared holders remain: granted at once
            return None
        fcntl.flock(main, fcntl.LOCK_UN)
        return (
            f"run folder {path} is in use by the other node launchers of the job of "
            f"{_describe(record)}, which has ended; wait until they end or stop them, or use "
            "another run folder"
        )
    joined = _flock(nodes, fcntl.LOCK_SH)  # fails while the holder is still writing its record
    record = _read_record(main)
    if joined and job is not None and record.get("job") == job:
        return None
    if joined:
        fcntl.flock(nodes, fcntl.LOCK_UN)
    hint = (
        "; the node launchers of one job share a folder when they pass the same --rdzv-id and --rdzv-endpoint"
        if job is not None
        else ""
    )
    return (
        f"run folder {path} is in use by {_describe(record)}; wait until it ends or stop it, "
        f"or use another run folder{hint}"
    )


def _write_record(fd: int, purpose: str, job: str | None) -> None:
    """Who holds the lock, for the one line that refuses the next writer."""
    command = shlex.join([Path(sys.orig_argv[0]).name, *sys.orig_argv[1:]])
    record = {
        "purpose": purpose,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": time.time(),
        "job": job,
        "command": command if len(command) <= 300 else command[:297] + "...",
    }
    data = json.dumps(record).encode("utf-8")
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def _read_record(fd: int) -> dict[str, Any]:
    """The last holder's record ({} when there is none, or it is not whole)."""
    try:
        record = json.loads(os.pread(fd, 1 << 16, 0))
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def _describe(record: dict[str, Any]) -> str:
    """``vatra train (pid 4242 on node-a since 2026-01-01 12:00:00 UTC: python -m vatra train …)``."""
    try:
        purpose, pid, host, command = (record[k] for k in ("purpose", "pid", "host", "command"))
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(record["since"])))
    except (KeyError, TypeError, ValueError, OverflowError):
        return "another process (it left no readable record)"
    job = f", job {record['job']}" if record.get("job") else ""
    command = " ".join(str(command).split())  # one line, whatever the arguments held
    return f"{purpose} (pid {pid} on {host} since {since}{job}: {command})"
