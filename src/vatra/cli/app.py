"""The ``vatra`` command: the typer app and the one-line error handling around it."""

from __future__ import annotations

import sys

import typer
from typer.exceptions import TyperException

from vatra import __version__
from vatra.errors import VatraError

# rich_markup_mode=None on every Typer: help is printed as written (rich markup would swallow
# bracketed words such as [tune.space]) and paragraphs are re-wrapped to the terminal.
app = typer.Typer(
    rich_markup_mode=None,
    help="vatra: distributed PyTorch training that keeps going, sends few bytes and keeps data private.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        print(f"vatra {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version."
    ),
) -> None:
    """Train across processes, machines or data owners. Each command takes a TOML config (see examples/)."""


def fail(message: str, code: int = 2) -> None:
    """Print one ``error:`` line on stderr and exit."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry: run the app, turning user errors into one line and an exit code."""
    try:
        code = app(args=argv, prog_name="vatra", standalone_mode=False)
        if isinstance(code, int) and code:  # a typer.Exit(n) is returned, not raised, here
            raise SystemExit(code)
    except typer.Exit as e:
        raise SystemExit(e.exit_code) from None
    except typer.Abort:
        fail("aborted", 130)
    except TyperException as e:  # usage errors: unknown option, missing argument, bad type
        if type(e).__name__ == "NoArgsIsHelpError":  # no arguments at all: its message is the help
            print(e.format_message(), flush=True)
            raise SystemExit(2) from None
        ctx = getattr(e, "ctx", None)
        hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        fail(e.format_message() + hint, 2)
    except VatraError as e:
        fail(str(e), e.exit_code)
    except KeyboardInterrupt:
        fail("interrupted", 130)
