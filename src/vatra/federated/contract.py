"""The federation's data contract: what every owner's rows must mean before they train together.

A :class:`DataContract` holds a table's numeric columns (in order), its categorical columns with
their categories (in order), its target columns with their classes, and the categorical encoding:
enough to say what each input column of the model means, and nothing about the rows (no values of
numeric columns, no counts). The federation has one: the server's, from its held-out file
(``vatra fl server --eval-data``), or else the first client's to join.

Each client compares its own data with it before training (:func:`conform_problem`): same columns,
its categories and classes a subset of the federation's. A client that conforms re-encodes its rows
with the federation's columns and categories in the federation's order (:func:`pins`), so a one-hot
column means the same on every side; one that does not is refused with one line naming the column
and the values that differ. The contract crosses the network both ways, so :meth:`DataContract.from_json`
bounds its size and checks every type before anything is used.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from vatra.config import Config

MAX_BYTES = 256 * 1024  # the contract as JSON: ~4000 columns with names of 60 characters
MAX_NAME = 256  # characters of a column name, a category or a class


@dataclass(frozen=True)
class DataContract:
    """Columns, categories and classes of a table, in the order its rows are encoded."""

    numeric: tuple[str, ...]
    categories: dict[str, list[str]]  # categorical column -> its categories, in one-hot order
    target: tuple[str, ...]
    classes: dict[str, list[str | int]]  # classification target -> its classes, in id order
    encoding: str

    def to_json(self) -> dict[str, Any]:
        return {
            "numeric": list(self.numeric),
            "categories": {c: list(v) for c, v in self.categories.items()},
            "target": list(self.target),
            "classes": {c: list(v) for c, v in self.classes.items()},
            "encoding": self.encoding,
        }

    @classmethod
    def from_json(cls, raw: Any) -> DataContract:
        """The contract in ``raw``; ValueError naming the first thing that is out of bounds or mistyped."""
        if not isinstance(raw, dict) or set(raw) != {
            "numeric",
            "categories",
            "target",
            "classes",
            "encoding",
        }:
            raise ValueError("a data contract is an object of numeric, categories, target, classes, encoding")
        try:
            size = len(json.dumps(raw))
        except (RecursionError, TypeError, ValueError):
            raise ValueError("the data contract is not plain JSON") from None
        if size > MAX_BYTES:
            raise ValueError(f"the data contract is over {MAX_BYTES // 1024} KiB")
        if raw["encoding"] not in ("onehot", "embedding"):
            raise ValueError(f"encoding must be onehot or embedding, got {raw['encoding']!r}")
        numeric, target = _names(raw["numeric"], "numeric"), _names(raw["target"], "target")
        categories = {
            c: _names(v, f"the categories of {c!r}", empty=True) for c, v in _named(raw["categories"]).items()
        }
        classes = {c: _classes(v, c) for c, v in _named(raw["classes"]).items()}
        columns = [*numeric, *categories, *target]
        if len(set(columns)) != len(columns):
            raise ValueError("a column is named twice")
        if not set(classes) <= set(target):
            raise ValueError("classes are given for a column that is no target")
        return cls(tuple(numeric), categories, tuple(target), classes, raw["encoding"])


def _text(value: Any, what: str, empty: bool = False) -> str:
    if not isinstance(value, str) or not int(not empty) <= len(value) <= MAX_NAME:
        raise ValueError(f"{what}: {value!r} is not a name of at most {MAX_NAME} characters")
    return value


def _names(raw: Any, what: str, empty: bool = False) -> list[str]:
    if not isinstance(raw, list):
        raise ValueError(f"{what} must be a list")
    names = [_text(v, what, empty) for v in raw]
    if len(set(names)) != len(names):
        raise ValueError(f"{what} lists a value twice")
    return names


def _named(raw: Any) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise ValueError("categories and classes must be objects")
    return {_text(k, "a column"): v for k, v in raw.items()}


def _classes(raw: Any, column: str) -> list[str | int]:
    """Classes are all text, all integers (below 2^53) or all booleans (the target column's type)."""
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"the classes of {column!r} must be a non-empty list")
    if all(type(v) is int and abs(v) < 2**53 for v in raw) or all(type(v) is bool for v in raw):
        values: list[str | int] = list(raw)
    else:
        values = list(_names(raw, f"the classes of {column!r}", empty=True))
    if len(set(values)) != len(values):
        raise ValueError(f"the classes of {column!r} list a value twice")
    return values


def contract_of(dataset: Any) -> DataContract | None:
    """The contract of a preprocessed table dataset (its fitted ``preprocess``); None for other data."""
    pre = getattr(dataset, "preprocess", None)
    if pre is None:
        return None
    return DataContract(
        tuple(pre.features),
        {c: list(pre.vocab[c]) for c in pre.categorical},
        tuple(pre.target),
        {t: list(v) for t, v in pre.classes.items()},
        pre.encoding,
    )


def _listed(values: list[Any]) -> str:
    return ", ".join(repr(v) for v in values)


def conform_problem(own: DataContract, fed: DataContract) -> str | None:
    """Why this owner's data cannot be encoded as the federation's (one line naming the column and
    the values that differ), or None when it can: the same columns, and each of its categories and
    classes among the federation's."""
    fix = "or pin data.categories"
    if own.target != fed.target:
        return f"data.target: this owner's target is {list(own.target)}, the federation's {list(fed.target)}"
    if own.encoding != fed.encoding:
        return (
            f"data.categorical_encoding: this owner encodes categories as {own.encoding}, "
            f"the federation as {fed.encoding}"
        )
    mine, theirs = [*own.numeric, *own.categories], [*fed.numeric, *fed.categories]
    for column in theirs:
        if column not in mine:
            return (
                f"column {column!r}: the federation's data has it, this owner's does not: add it to this "
                "owner's data (or leave it out of data.features on every side)"
            )
    for column in mine:
        if column not in theirs:
            return (
                f"column {column!r}: this owner's data has it, the federation's does not: drop it or "
                "leave it out of data.features"
            )
    for column in own.numeric:
        if column in fed.categories:
            return (
                f"column {column!r}: this owner reads it as numbers, the federation as categories "
                f"{fed.categories[column]}: add it to data.categorical"
            )
    for column, values in own.categories.items():
        if column in fed.numeric:
            return (
                f"column {column!r}: this owner reads it as categories {values}, the federation as numbers: "
                "take it out of data.categorical, or correct the cells that are no numbers"
            )
        outside = [v for v in values if v not in fed.categories[column]]
        if outside:
            return (
                f"column {column!r}: this owner has categories {values}, the federation's are "
                f"{fed.categories[column]}: map {_listed(outside)} to one of them {fix}"
            )
    for column in fed.target:
        have, want = own.classes.get(column), fed.classes.get(column)
        if (have is None) != (want is None):
            kinds = ("classes", "numbers") if have is not None else ("numbers", "classes")
            return f"target {column!r}: this owner reads it as {kinds[0]}, the federation as {kinds[1]}"
        strays = [v for v in have or [] if str(v) not in {str(w) for w in want or []}]
        if strays:
            return (
                f"target {column!r}: this owner has classes {have}, the federation's are {want}: "
                f"map {_listed(strays)} to one of them {fix}"
            )
    return None


def notices(own: DataContract, fed: DataContract) -> list[str]:
    """Lines worth telling an owner that conforms: a column where it holds one category only."""
    return [
        f"column {c!r}: this owner holds one category only ({v[0]!r}) of the federation's {fed.categories[c]}"
        for c, v in own.categories.items()
        if len(v) == 1 and len(fed.categories.get(c, [])) > 1
    ]


def pins(cfg: Config, fed: DataContract) -> Config:
    """``cfg`` reading its table as the federation does: its columns in the federation's order, its
    categories and classes pinned to the federation's (``data.features``, ``data.categorical``,
    ``data.categories``)."""
    categories: dict[str, list[str | int]] = {c: list(v) for c, v in fed.categories.items()}
    categories.update({t: list(v) for t, v in fed.classes.items()})
    data = cfg.data.model_copy(
        update={
            "features": [*fed.numeric, *fed.categories],
            "categorical": list(fed.categories),
            "categories": categories,
        }
    )
    return cfg.model_copy(update={"data": data})


def pins_problem(cfg: Config, fed: DataContract) -> str | None:
    """Why a first client's contract disagrees with the server's own ``data.categories``, or None."""
    for column, pinned in cfg.data.categories.items():
        have = fed.categories.get(column, fed.classes.get(column))
        if have is not None and [str(v) for v in have] != [str(v) for v in pinned]:
            return f"column {column!r}: its categories are {have}, the server pins {list(pinned)}"
    return None
