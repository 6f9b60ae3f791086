"""The served models of a registry: a :class:`~vatra.serve.predict.Predictor` per version."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vatra.serve.loader import load
from vatra.serve.predict import Predictor

if TYPE_CHECKING:
    from vatra.serve.registry import Registry


class PredictorModel:
    """A :class:`Predictor` as a served model: rows of the signature's input columns in, one
    record per row out (``prediction`` and, for classification, ``proba_<class>``).

    A model trained on tensors (the built-in digits) takes one column ``x`` holding each row's
    values as a list (``{"x": [0, 3, 16, ...]}``)."""

    def __init__(self, predictor: Predictor) -> None:
        self.predictor = predictor
        inputs = predictor.signature["inputs"]
        self.columns = [i["name"] for i in inputs]
        self._tensor = len(inputs) == 1 and inputs[0]["type"] == "tensor"

    def predict(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        data: Any = [r[self.columns[0]] for r in rows] if self._tensor else rows
        records: list[dict[str, Any]] = self.predictor.predict_arrow(data).to_pylist()
        return records


class RegistrySource:
    """The versions of model ``name`` in a registry: an alias, ``latest`` or an id prefix is
    resolved to a version id on every poll; a version is fetched (cached) and loaded once."""

    def __init__(self, registry: Registry, name: str) -> None:
        self.registry = registry
        self.name = name

    def version(self, ref: str) -> str:
        return self.registry.get(f"{self.name}@{ref}").id

    def load(self, ref: str, version: str) -> PredictorModel:
        return PredictorModel(load(self.registry.resolve(f"{self.name}@{version}")))

    def default_ref(self) -> str:
        """What ``vatra model serve NAME`` serves: the ``champion`` alias if there is one, else the newest."""
        return "champion" if "champion" in self.registry.aliases(self.name) else "latest"
