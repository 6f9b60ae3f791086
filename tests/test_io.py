"""``atomic_write``: a reader sees the old file or the new one, whoever writes and whatever dies."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import vatra._io
from vatra._io import TEMP_MARK, atomic_write

ROOT = Path(__file__).resolve().parents[1]


def test_bytes_and_text_replace_the_file_whole_and_leave_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "meta.json"
    atomic_write(target, b"old")
    assert atomic_write(target, "nouveau é") == target
    assert target.read_text(encoding="utf-8") == "nouveau é"
    atomic_write(target, lambda f: f.write(b"streamed"))
    assert target.read_bytes() == b"streamed"
    assert [p.name for p in tmp_path.iterdir()] == ["meta.json"]


def test_a_failing_write_keeps_the_old_file_and_removes_its_temporary(tmp_path: Path) -> None:
    target = tmp_path / "summary.json"
    target.write_text("old")

    def fill(f: object) -> None:
        f.write(b"half")  # type: ignore[attr-defined]
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        atomic_write(target, fill, durable=True)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_a_process_killed_before_the_rename_leaves_the_old_file_intact(tmp_path: Path) -> None:
    # Prepare: the file as a finished write left it
    target = tmp_path / "latest"
    target.write_text("step-100")
    # Execute: a writer dies (no cleanup, no atexit) with half the new bytes in its temporary file
    code = (
        "import os, sys\n"
        "from vatra._io import atomic_write\n"
        "def fill(f):\n"
        "    f.write(b'step-2'); f.flush(); os._exit(9)\n"
        "atomic_write(sys.argv[1], fill, durable=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, "-c", code, str(target)], env=env, timeout=60)
    # Assert: the old content under the name; the leftover is marked for a store's sweep
    assert proc.returncode == 9
    assert target.read_text() == "step-100"
    left = [p.name for p in tmp_path.iterdir() if p != target]
    assert len(left) == 1 and left[0].startswith(f"latest{TEMP_MARK}")


def test_concurrent_writers_never_leave_a_partial_file(tmp_path: Path) -> None:
    # Prepare: four writers of 256 KiB payloads, each of one repeated byte, and a reader
    target, size = tmp_path / "state.bin", 256 << 10
    atomic_write(target, b"a" * size)
    stop, seen, bad = threading.Event(), set(), []

    def write(letter: bytes) -> None:
        for i in range(15):
            atomic_write(target, letter * size, durable=i % 5 == 0)

    def read() -> None:
        while not stop.is_set():
            data = target.read_bytes()
            if len(data) != size or data.count(data[:1]) != size:
                bad.append(len(data))
            seen.add(data[:1])

    # Execute
    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=write, args=(c,)) for c in (b"b", b"c", b"d", b"e")]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    reader.join()
    # Assert: every read was one writer's whole payload; no temporary file is left
    assert bad == []
    assert len(seen) >= 2
    assert target.read_bytes()[:1] in (b"b", b"c", b"d", b"e")
    assert [p.name for p in tmp_path.iterdir()] == ["state.bin"]


@pytest.mark.parametrize(("durable", "want"), [(True, 2), (False, 0)])
def test_durable_fsyncs_the_file_and_its_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, durable: bool, want: int
) -> None:
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(vatra._io.os, "fsync", lambda fd: synced.append(fd) or real(fd))
    atomic_write(tmp_path / "tag", "v3", durable=durable)
    assert len(synced) == want


def test_private_files_are_created_0600_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o277)
    try:
        atomic_write(tmp_path / "client.key", b"secret", private=True)
        atomic_write(tmp_path / "client.crt", b"public")
    finally:
        os.umask(old)
    assert (tmp_path / "client.key").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "client.crt").stat().st_mode & 0o777 == 0o400  # the umask's, as open() gives
