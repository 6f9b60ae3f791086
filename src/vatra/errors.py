"""Errors the CLI turns into one ``error:`` line and an exit code."""

from __future__ import annotations

import errno


class VatraError(Exception):
    """An error a user can fix; shown as one line without a traceback."""

    exit_code = 1


class ConfigError(VatraError):
    """Bad config, bad override or bad command-line usage (exit code 2)."""

    exit_code = 2


class RunLocked(VatraError):
    """Another process writes to this run folder (a job, or a ``vatra ckpt`` command); the message
    names it and what to do. Exit code 2: the command was refused before it changed anything."""

    exit_code = 2


class DiskFull(VatraError):
    """A write failed for want of space (or quota); the run's last good checkpoint and logs are kept."""


def write_failed(err: OSError, path: object) -> VatraError:
    """The one-line error for a failed write of ``path``: a full disk says how to go on."""
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFull(
            f"no space left on the device holding {path}; free space there and run the same command "
            "again: it resumes from the last good checkpoint"
        )
    return VatraError(f"cannot write {path}: {err.strerror or err}")
