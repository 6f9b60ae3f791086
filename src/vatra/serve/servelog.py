"""The serving logs that ``vatra model ab-report`` reads: predictions.jsonl and outcomes.jsonl.

``predictions.jsonl``: one row per scored input row, ``{"id", "t", "variant", "version", "key",
"latency_ms", "error"}``; ``outcomes.jsonl``: ``{"id", "t", "value"}``, one per prediction id at
most. Both are appended to and flushed after every request, and read back at start-up, so an outcome
may arrive for a prediction made before a restart (and not twice).
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import IO, Any


class OutcomeError(Exception):
    """An outcome that cannot be logged: unknown prediction id, or already logged (a 4xx)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def _ids(path: Path) -> set[str]:
    ids: set[str] = set()
    if path.is_file():
        with path.open(encoding="utf-8") as f:
            for line in f:
                try:
                    ids.add(str(json.loads(line)["id"]))
                except (ValueError, KeyError, TypeError):
                    continue  # a torn last line after a crash
    return ids


class ServeLog:
    """Appends to the two logs; remembers which ids were predicted and which have an outcome."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.predictions_path = folder / "predictions.jsonl"
        self.outcomes_path = folder / "outcomes.jsonl"
        self._predicted = _ids(self.predictions_path)
        self._outcomes = _ids(self.outcomes_path)
        self._pred: IO[str] = self.predictions_path.open("a", encoding="utf-8")
        self._out: IO[str] = self.outcomes_path.open("a", encoding="utf-8")

    @staticmethod
    def new_ids(n: int) -> list[str]:
        return [uuid.uuid4().hex for _ in range(n)]

    def predictions(
        self,
        ids: list[str],
        *,
        variant: str,
        version: str,
        key: str | None,
        latency_ms: float,
        error: bool,
    ) -> None:
        t = time.time()
        lines = []
        for id_ in ids:
            row: dict[str, Any] = {
                "id": id_,
                "t": t,
                "variant": variant,
                "version": version,
                "key": key,
                "latency_ms": round(latency_ms, 3),
                "error": error,
            }
            lines.append(json.dumps(row) + "\n")
        self._pred.write("".join(lines))
        self._pred.flush()
        self._predicted.update(ids)

    def outcome(self, id_: str, value: float) -> None:
        if id_ not in self._predicted:
            raise OutcomeError(f"unknown prediction id {id_!r}: use an id that /predict returned", 404)
        if id_ in self._outcomes:
            raise OutcomeError(f"prediction {id_!r} already has an outcome", 409)
        self._out.write(json.dumps({"id": id_, "t": time.time(), "value": value}) + "\n")
        self._out.flush()
        self._outcomes.add(id_)

    def close(self) -> None:
        self._pred.close()
        self._out.close()
