"""What the server serves: a model that scores row dicts, and where its versions come from."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class ServedModel(Protocol):
    """A loaded model version. ``predict`` is called from one worker thread at a time per variant.

    ``columns``: the input columns the model takes (requests are checked against them before they
    join a batch, so one bad request cannot fail its batch-mates); ``None``: not checked here."""

    @property
    def columns(self) -> Sequence[str] | None: ...

    def predict(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """One output record per input row, in order (e.g. ``{"prediction": 3, "proba_3": 0.9}``)."""
        ...


class ModelSource(Protocol):
    """Versions of one model by reference (an alias such as ``champion``, or a version id).

    ``version`` is polled about once a second per variant, so it must be cheap; ``load`` runs in a
    background thread while the previous version keeps serving."""

    def version(self, ref: str) -> str:
        """The id of the version ``ref`` points at now."""
        ...

    def load(self, ref: str, version: str) -> ServedModel:
        """Version ``version`` (which ``ref`` pointed at), ready to predict."""
        ...


@dataclass(frozen=True)
class Slot:
    """A variant's current version and model, swapped as one reference between batches."""

    version: str
    model: ServedModel
