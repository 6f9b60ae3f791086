"""A child process's failure, told to its parent: the one channel for it.

The child leaves its one-line error as a small JSON record (``message``, ``exit_code``,
``peer_lost``) in a folder its parent named, under a name of its own, and exits with that code;
the parent, once the child has exited, takes the records (reads and removes them). A folder works
whoever started the child: the launcher's workers (torchrun starts them: no pipe reaches them,
see :meth:`vatra.rundir.RunDir.write_error`) and the role an asynchronous process supervises
(:func:`vatra.asyncrun.supervise`) alike. A child killed outright leaves no record: its parent
reports the exit code alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_error(folder: Path, name: str, message: str, exit_code: int, *, peer_lost: bool = False) -> None:
    """Leave the error ``message`` (and the ``exit_code`` the child exits with) as ``<folder>/<name>.json``.

    ``peer_lost``: the child failed only because another process went away; :func:`take_errors`
    drops such records (the parent names the process that went away instead).
    """
    folder.mkdir(parents=True, exist_ok=True)
    record = {"message": message, "exit_code": exit_code, "peer_lost": peer_lost}
    (folder / f"{name}.json").write_text(json.dumps(record))


def take_errors(folder: Path, pattern: str = "*.json") -> list[dict[str, Any]]:
    """The records in ``folder`` (in name order), removed from it (a later child starts clean);
    unreadable records and those of children that only lost a peer are dropped."""
    if not folder.is_dir():
        return []
    found = []
    for path in sorted(folder.glob(pattern)):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        finally:
            path.unlink(missing_ok=True)
        if not record.get("peer_lost"):
            found.append(record)
    return found
