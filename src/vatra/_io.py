"""One way to replace a file whole: :func:`atomic_write` (a temporary file beside it, then a rename)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["TEMP_MARK", "atomic_write", "fsync_dir"]

# In the name of a write's temporary file (``<name>.tmp-<8 hex>``), never in a file vatra reads: a
# store's sweep removes the ones a crash left behind.
TEMP_MARK = ".tmp-"


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable (a file's own fsync does not cover its name)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(
    path: str | Path,
    data: bytes | str | Callable[[BinaryIO], object],
    *,
    durable: bool = False,
    private: bool = False,
    encoding: str = "utf-8",
) -> Path:
    """Replace ``path`` with ``data`` whole: a reader sees the old file or the new one, never part.

    ``data``: bytes, text (written in ``encoding``), or a function that writes the bytes to the
    open file (a stream copied without holding it in memory). The bytes go to a temporary file of
    a unique name in ``path``'s folder (writers never share one; a rename stays in one filesystem),
    which is renamed over ``path``; a failed write removes it and leaves the old file as it was.
    The folder must exist.

    ``durable``: the file is fsynced before the rename and the folder after it, so the new file
    survives a power cut or a kernel crash once this returns (a killed process needs no fsync: the
    rename alone is atomic). It costs one or two disk flushes, milliseconds on a busy disk: for
    what a restart or a reader relies on (checkpoint metadata, tags, manifests, summaries), not for
    a file rewritten every few steps.

    ``private``: the file is created 0600 whatever the umask, so the new content (a key) is
    never readable by others, not even under its temporary name.
    """
    target = Path(path)
    tmp = target.with_name(f"{target.name}{TEMP_MARK}{uuid.uuid4().hex[:8]}")
    try:
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600 if private else 0o666)
        if private:
            os.fchmod(fd, 0o600)  # a umask such as 0o277 must not leave it 0400
        with os.fdopen(fd, "wb") as f:
            if isinstance(data, str):
                f.write(data.encode(encoding))
            elif isinstance(data, bytes):
                f.write(data)
            else:
                data(f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(target.parent)
    return target
