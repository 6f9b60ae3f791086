"""The fault campaign's machinery: one launch's process tree, faults injected from outside, what a run left.

Everything here acts on a run the way a real fault would: signals to processes found through
``/proc``, bytes flipped or cut in the store's files behind its back, a storage node's folder
removed, a filesystem filled. The harness reads the store with the store's own primitives
(backend reads, checksummed object reads) rather than its listing helpers, so a damaged manifest
that makes a listing refuse still leaves every other version measurable.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from vatra.config import load_config
from vatra.errors import VatraError
from vatra.resilience.recovery import read_progress
from vatra.resilience.store import LATEST, CheckpointStore, open_store

ROOT = Path(__file__).resolve().parents[1]
TRACEBACK = "Traceback (most recent call last)"


# ------------------------------------------------------------------ processes
def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a live process, None when it is gone (or a zombie)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the command name may contain spaces
    return None if fields[0] == "Z" else (int(fields[1]), int(fields[19]))


def descendants(root: int) -> dict[int, int]:
    """pid → start time of every live process below ``root`` (workers run in sessions of their own)."""
    children: dict[int, list[int]] = {}
    started: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (st := _stat(int(entry.name))) is not None:
            children.setdefault(st[0], []).append(int(entry.name))
            started[int(entry.name)] = st[1]
    out: dict[int, int] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if pid in started and pid not in out:
            out[pid] = started[pid]
            todo += children.get(pid, [])
    return out


def _signal_if_same(pid: int, start: int, sig: signal.Signals) -> bool:
    """Signal ``pid`` only while it is still the process first seen (a reused pid is left alone)."""
    st = _stat(pid)
    if st is None or st[1] != start:
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
        return True
    return False


@dataclass
class Attempt:
    """One launch of the training command, as the harness saw it."""

    rc: int
    wall_s: float
    stderr: str
    timed_out: bool = False
    leftovers: int = 0  # processes below the launcher still alive after it exited (killed)

    @property
    def last_line(self) -> str:
        lines = [line for line in self.stderr.splitlines() if line.strip()]
        return lines[-1].strip() if lines else ""

    @property
    def clear_stop(self) -> bool:
        """A non-zero exit that said one ``error:`` line, last, and printed no Python traceback."""
        errors = [line for line in self.stderr.splitlines() if line.startswith("error:")]
        return (
            self.rc != 0
            and self.last_line.startswith("error: ")
            and len(errors) == 1
            and TRACEBACK not in self.stderr
        )

    def record(self) -> dict[str, Any]:
        return {
            "rc": self.rc,
            "wall_s": self.wall_s,
            "timed_out": self.timed_out,
            "leftovers": self.leftovers,
            "clear_stop": self.clear_stop,
            "last_line": self.last_line,
            "traceback": TRACEBACK in self.stderr,
        }


class Job:
    """One launch of ``cmd`` in a session of its own, with every process below it remembered.

    torch's elastic agent starts each worker in a new session, so the launcher's process group
    does not reach them: the harness keeps the pids it has seen below the launcher (with their
    start times, so a reused pid is never signalled) and kills what is left when the launch ends.
    """

    def __init__(self, cmd: list[str], log: Path, timeout_s: float) -> None:
        self.log, self.timeout_s = log, timeout_s
        self.t0 = time.perf_counter()
        with log.with_suffix(".stdout").open("wb") as out, log.with_suffix(".stderr").open("wb") as err:
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True
            )
        self.seen: dict[int, int] = {}
        self.timed_out = False
        self._scanned = 0.0

    def running(self) -> bool:
        if self.proc.poll() is not None:
            return False
        if time.perf_counter() - self._scanned > 0.5:
            self.scan()
        if time.perf_counter() - self.t0 > self.timeout_s:
            self.timed_out = True
            self.kill()
            return False
        return True

    def scan(self) -> dict[int, int]:
        now = descendants(self.proc.pid)
        self.seen.update(now)
        self._scanned = time.perf_counter()
        return now

    def workers(self) -> dict[int, int]:
        """The live worker processes (``python -m vatra.worker``) below the launcher."""
        out = {}
        for pid, start in self.scan().items():
            with contextlib.suppress(OSError):
                if b"vatra.worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    out[pid] = start
        return out

    def signal_workers(self, workers: dict[int, int], sig: signal.Signals) -> None:
        for pid, start in workers.items():
            _signal_if_same(pid, start, sig)

    def terminate(self) -> None:
        """A spot machine's notice: SIGTERM to the launcher's process group and to every worker."""
        workers = self.workers()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        self.signal_workers(workers, signal.SIGTERM)

    def kill(self) -> None:
        self.scan()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for pid, start in self.seen.items():
            _signal_if_same(pid, start, signal.SIGKILL)

    def finish(self) -> Attempt:
        rc = self.proc.wait()
        wall = time.perf_counter() - self.t0
        left = sum(_signal_if_same(pid, start, signal.SIGKILL) for pid, start in self.seen.items())
        stderr = self.log.with_suffix(".stderr").read_text(errors="replace")
        return Attempt(rc=rc, wall_s=wall, stderr=stderr, timed_out=self.timed_out, leftovers=left)


@contextlib.contextmanager
def frozen(job: Job) -> Iterator[dict[int, int]]:
    """SIGSTOP every worker while the harness changes the store, so the change is one instant to the run."""
    workers = job.workers()
    job.signal_workers(workers, signal.SIGSTOP)
    try:
        yield workers
    finally:
        job.signal_workers(workers, signal.SIGCONT)


def rank_pid(workers: dict[int, int], progress: dict[str, Any] | None) -> int | None:
    """The pid of the rank whose progress record is given, if it is one of this launch's workers."""
    pid = progress.get("pid") if progress else None
    return pid if isinstance(pid, int) and pid in workers else None


# ---------------------------------------------------------------- the store
def read_manifest(store: CheckpointStore, version: str) -> dict[str, Any]:
    """One version's manifest; raises ValueError or VatraError when it is missing or unreadable."""
    return dict(json.loads(store.backend.get(f"versions/{version}.json")))


def manifests(store: CheckpointStore) -> dict[str, dict[str, Any] | None]:
    """version → manifest for every manifest key in the store; None for an unreadable one."""
    out: dict[str, dict[str, Any] | None] = {}
    for key in store.backend.keys("versions/"):
        if key.endswith(".json"):
            version = key.removeprefix("versions/").removesuffix(".json")
            try:
                out[version] = read_manifest(store, version)
            except (ValueError, VatraError):
                out[version] = None
    return out


def read_version(store: CheckpointStore, manifest: dict[str, Any]) -> dict[str, bytes]:
    """Every file of a version, each checked against its sha256 by the store; raises on any damage."""
    return {name: store.get_object(entry["sha256"]) for name, entry in manifest["files"].items()}


def intact_versions(store: CheckpointStore) -> dict[str, dict[str, Any]]:
    """version → {step, time} of every version whose manifest and objects all read back intact."""
    out = {}
    for version, manifest in manifests(store).items():
        if manifest is None:
            continue
        try:
            read_version(store, manifest)
        except (VatraError, KeyError):
            continue
        out[version] = {"step": manifest["step"], "time": manifest["time"]}
    return out


def latest_version(store: CheckpointStore) -> str | None:
    """What the ``latest`` tag points at (None without a readable tag)."""
    try:
        text = store.backend.get(f"tags/{LATEST}").decode().strip()
    except (VatraError, UnicodeDecodeError):
        return None
    return text.split()[0] if text else None


def lost_versions(
    before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]], keep_last: int
) -> list[str]:
    """Versions intact at fault time that the run lost: damaged now, or gone without retention's reason.

    ``checkpoint.keep_last`` deletes a version once that many newer ones exist; a version absent
    with fewer than ``keep_last`` intact versions saved after it was deleted by something else.
    """
    lost = []
    for version, info in before.items():
        if version in after:
            continue
        newer = sum(1 for v in after.values() if v["time"] > info["time"])
        if not keep_last or newer < keep_last:
            lost.append(version)
    return sorted(lost)


def weights(files: dict[str, bytes]) -> dict[str, Any]:
    """The model and optimizer state of a version's DCP files, as one plain state dict."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "version"
        for name, data in files.items():
            if name.startswith("/") or ".." in Path(name).parts:
                raise VatraError(f"manifest entry {name!r} points outside the version")
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_bytes(data)
        (meta,) = root.rglob(".metadata")  # DCP's index, next to (or above) its data files
        dcp_to_torch_save(meta.parent, Path(tmp) / "state.pt")
        return dict(torch.load(Path(tmp) / "state.pt", weights_only=True))


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        return {k: v for key, val in obj.items() for k, v in _flatten(val, f"{prefix}{key}.").items()}
    if isinstance(obj, list | tuple):
        return {k: v for i, val in enumerate(obj) for k, v in _flatten(val, f"{prefix}{i}.").items()}
    return {prefix.rstrip("."): obj}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (so -0.0 ≠ 0.0 and NaN = the same NaN, as a bitwise comparison wants)."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def first_difference(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """The first key whose value differs bitwise (tensors: dtype, shape and every bit); None when equal."""
    fa, fb = _flatten(a), _flatten(b)
    if fa.keys() != fb.keys():
        return f"keys differ: {sorted(fa.keys() ^ fb.keys())[:3]}"
    for key in sorted(fa):
        x, y = fa[key], fb[key]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            same = (
                isinstance(x, torch.Tensor)
                and isinstance(y, torch.Tensor)
                and x.dtype == y.dtype
                and x.shape == y.shape
                and torch.equal(_bits(x), _bits(y))
            )
        else:
            same = x == y
        if not same:
            return key
    return None


# ------------------------------------------------------------------- faults
def flip_bytes(path: Path, rng: random.Random) -> int:
    """XOR 16 bytes at a random offset of a file in place (a disk's silent corruption); returns the offset."""
    data = bytearray(path.read_bytes())
    offset = rng.randrange(max(1, len(data) - 16))
    data[offset : offset + 16] = bytes(b ^ 0xFF for b in data[offset : offset + 16])
    path.write_bytes(bytes(data))
    return offset


def unique_objects(manifest: dict[str, Any], others: list[dict[str, Any]]) -> dict[str, str]:
    """name → sha256 of the version's objects no other version references (damage to them hits it alone)."""
    shared = {e["sha256"] for m in others for e in m["files"].values()}
    return {name: e["sha256"] for name, e in manifest["files"].items() if e["sha256"] not in shared}


def fill_disk(folder: Path) -> int:
    """Write zeros to ``folder/filler`` until the filesystem says ENOSPC; returns the bytes written."""
    written = 0
    with (folder / "filler").open("wb", buffering=0) as f:
        for chunk in (1 << 20, 4096, 1):
            block = b"\0" * chunk
            while True:
                try:
                    written += f.write(block) or 0
                except OSError as err:
                    if err.errno != errno.ENOSPC:
                        raise
                    break
    return written


def can_mount() -> str | None:
    """None when a tmpfs can be mounted here, else why not (the full-disk fault needs root)."""
    if os.geteuid() != 0:
        return "needs root (mounts a small tmpfs)"
    with tempfile.TemporaryDirectory() as tmp:
        try:
            with tmpfs(Path(tmp), 1):
                return None
        except (OSError, subprocess.CalledProcessError) as err:
            return f"cannot mount a tmpfs: {err}"


@contextlib.contextmanager
def tmpfs(path: Path, size_mb: int) -> Iterator[Path]:
    """A tmpfs of ``size_mb`` MiB mounted at ``path`` for the block; unmounted however it ends."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)],
        check=True,
        capture_output=True,
    )
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)  # still busy: detach it


def remove_node(folder: Path) -> None:
    """A storage node lost for good: its folder gone (retried while a writer recreates entries)."""
    for _ in range(5):
        shutil.rmtree(folder, ignore_errors=True)
        if not folder.exists():
            return
    shutil.rmtree(folder)


# ------------------------------------------------------------------ results
def progress_step(run: Path, nproc: int) -> int:
    """The highest step any rank has completed (its ``.ranks/rank<r>.json``); 0 before the first."""
    steps = [
        p["step"] for r in range(nproc) if (p := read_progress(run, r)) and isinstance(p.get("step"), int)
    ]
    return max(steps, default=0)


def open_run_store(run: Path) -> CheckpointStore:
    """The store the run's own config.toml names (raises VatraError when there is none yet)."""
    return open_store(load_config(run / "config.toml").store, run / "checkpoints")


def try_open_store(run: Path) -> CheckpointStore | None:
    """The run's store once the launcher has written config.toml; None before (or while half written)."""
    try:
        return open_run_store(run)
    except VatraError:
        return None


def ckpt_verify(run: Path) -> tuple[int, str]:
    """``vatra ckpt verify RUN`` in this process: its exit code and last line."""
    from vatra.cli import main

    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
        try:
            main(["ckpt", "verify", str(run)])
            rc = 0
        except SystemExit as end:
            rc = end.code if isinstance(end.code, int) else 1
    lines = [line for line in text.getvalue().splitlines() if line.strip()]
    return rc, lines[-1] if lines else ""


def read_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of a file that parse (a killed writer may leave a torn one); [] when absent."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict):
                out.append(record)
    return out


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file ({} when it is absent or unreadable: a run killed before writing it)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


@dataclass
class EventDigest:
    """What events.jsonl says about a run: counts by kind, and the failures' own words."""

    counts: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, events: list[dict[str, Any]]) -> EventDigest:
        digest = cls()
        for e in events:
            kind = str(e.get("event"))
            digest.counts[kind] = digest.counts.get(kind, 0) + 1
            if kind in ("failure", "checkpoint_corrupt") and len(digest.failures) < 4:
                text = str(e.get("error") or e.get("problem"))
                digest.failures.append(f"{kind} rank {e.get('rank')} step {e.get('step')}: {text[:200]}")
        return digest
