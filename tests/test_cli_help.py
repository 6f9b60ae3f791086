"""Every ``vatra ... --help`` prints its command's and options' help as written in the code."""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import cache
from typing import Any

import pytest
import typer
from tests.conftest import vatra_in_process
from typer.core import TyperGroup

Command = Any  # a click command (typer 0.29 builds on its own copy of click)


def _commands(cmd: Command, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Command]]:
    """Every command and sub-command of the tree under ``cmd`` with its argv path (hidden ones skipped)."""
    yield path, cmd
    if isinstance(cmd, TyperGroup):
        for name, sub in sorted(cmd.commands.items()):
            if not sub.hidden:
                yield from _commands(sub, (*path, name))


@cache
def _all_commands() -> tuple[tuple[tuple[str, ...], Command], ...]:
    from vatra.cli import app

    return tuple(_commands(typer.main.get_command(app)))


def _words(text: str) -> str:
    return " ".join(text.split())


def _helps(cmd: Command) -> list[str]:
    """The help the code gives this command: its own (up to typer's \\f cut) and each shown option's."""
    own = (cmd.help or "").split("\f")[0]
    params = [p.help for p in cmd.params if getattr(p, "help", None) and not getattr(p, "hidden", False)]
    return [h for h in [own, *params] if h]


def test_the_tree_is_walked_and_has_bracketed_help() -> None:
    # Prepare / Execute
    commands = _all_commands()
    bracketed = [w for _, c in commands for h in _helps(c) for w in re.findall(r"\[[^\]\s]+\]", h)]
    # Assert: the walk reaches nested groups, and there are bracketed words to guard
    assert ("fl", "certs") in {p for p, _ in commands} and ("data", "schema", "show") in {
        p for p, _ in commands
    }
    assert "[tune.space]" in bracketed


@pytest.mark.parametrize("path", [p for p, _ in _all_commands()], ids=lambda p: " ".join(("vatra", *p)))
def test_help_shows_every_help_string_as_written(
    capsys: pytest.CaptureFixture[str], path: tuple[str, ...]
) -> None:
    # Prepare
    cmd = dict(_all_commands())[path]
    # Execute
    code, out, err = vatra_in_process(capsys, *path, "--help")
    # Assert: each help string survives whole (bracketed words included), only re-wrapped
    assert code == 0, err
    shown = _words(out)
    for text in _helps(cmd):
        for word in re.findall(r"\[[^\]]+\]", text):
            assert _words(word) in shown, f"'vatra {' '.join(path)} --help' lost {word!r}"
        assert _words(text) in shown, f"'vatra {' '.join(path)} --help' does not show {text!r}"


def test_every_command_prints_help_without_markup() -> None:
    # a Typer added without rich_markup_mode=None would print its help through rich markup again
    for path, cmd in _all_commands():
        assert getattr(cmd, "rich_markup_mode", None) is None, (
            f"vatra {' '.join(path)}: rich_markup_mode is set"
        )


@pytest.mark.parametrize("group", [(), ("fl",), ("data", "schema")], ids=lambda p: " ".join(("vatra", *p)))
def test_a_group_without_arguments_prints_its_help_not_an_error(
    capsys: pytest.CaptureFixture[str], group: tuple[str, ...]
) -> None:
    # Execute
    code, out, err = vatra_in_process(capsys, *group)
    # Assert: the help on stdout, exit 2 (no command given), nothing on stderr
    assert code == 2 and err == ""
    assert out.startswith(f"Usage: {' '.join(('vatra', *group))} [OPTIONS] COMMAND") and "Commands:" in out
