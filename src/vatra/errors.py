"""Errors the CLI turns into one ``error:`` line and an exit code."""

from __future__ import annotations


class VatraError(Exception):
    """An error a user can fix; shown as one line without a traceback."""

    exit_code = 1


class ConfigError(VatraError):
    """Bad config, bad override or bad command-line usage (exit code 2)."""

    exit_code = 2
