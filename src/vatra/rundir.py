"""The run folder: resolved config, metrics, events, summary and TensorBoard files."""

from __future__ import annotations

import json
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vatra.errors import VatraError


def new_run_id(name: str) -> str:
    """``<name>-<UTC timestamp>-<pid>``: sortable and unique on one machine."""
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{os.getpid()}"


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON line and flush it, so a crash keeps every line written before it.

    A last line without its newline that does not parse is an append a crash cut short: it is
    cut off first, so the new line does not continue it (which would damage the file mid-way).
    """
    line = json.dumps(record, default=float) + "\n"
    with path.open("ab") as f:
        if f.tell() > 0:
            with path.open("rb") as r:
                r.seek(-1, 2)
                if r.read(1) != b"\n":
                    r.seek(0)
                    data = r.read()
                    cut = data.rfind(b"\n") + 1
                    try:
                        json.loads(data[cut:])
                        f.write(b"\n")  # a whole record that only lacks its newline: keep it
                    except ValueError:
                        f.truncate(cut)
        f.write(line.encode("utf-8"))


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
        return self.path / "errors"

    def write_error(self, rank: int, message: str, exit_code: int) -> None:
        """A worker's one-line error, for the launcher to report once for the whole group."""
        self.errors.mkdir(parents=True, exist_ok=True)
        (self.errors / f"rank{rank:05d}.json").write_text(
            json.dumps({"message": message, "exit_code": exit_code})
        )

    def take_errors(self) -> list[dict[str, Any]]:
        """The workers' errors in rank order, removed from the folder (a later attempt starts clean)."""
        if not self.errors.is_dir():
            return []
        found = []
        for path in sorted(self.errors.glob("rank*.json")):
            try:
                found.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue
            path.unlink(missing_ok=True)
        return found

    def write_summary(self, summary: dict[str, Any]) -> None:
        tmp = self.summary.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(summary, indent=2, default=float) + "\n")
        tmp.replace(self.summary)  # atomic: a reader never sees half a summary
