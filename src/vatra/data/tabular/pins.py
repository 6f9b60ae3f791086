"""Categories pinned by ``data.categories``: the order of a column's one-hot columns (or ids) and of a
target's classes, fixed by the config instead of sorted from whatever values the training rows hold.

Two parties that pin the same categories encode the same value in the same column, whichever of the
categories their own rows happen to hold: what a federation's data contract relies on
(:mod:`vatra.federated.contract`). A value outside a column's pinned categories is an error naming
the column and the value (and its row, from :func:`~vatra.data.tabular.cells.outside_pins`), never a
silent all-zero row.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from vatra.errors import ConfigError

Pins = Mapping[str, Sequence[str | int]]


def _fix(column: str, outside: list[str], pinned: list[Any]) -> ConfigError:
    return ConfigError(
        f"data.categories: column {column!r} holds {outside[:5]}, outside its pinned categories {pinned}; "
        f"map each to one of them or add it to data.categories.{column}"
    )


def pinned_vocab(column: str, seen: Iterable[str], pins: Pins) -> list[str]:
    """A categorical column's vocabulary: its pinned categories (as text), else the sorted values seen."""
    values = sorted(set(seen))
    if column not in pins:
        return values
    pinned = [str(v) for v in pins[column]]
    outside = [v for v in values if v not in set(pinned)]
    if outside:
        raise _fix(column, outside, pinned)
    return pinned


def pinned_classes(column: str, seen: Iterable[Any], pins: Pins) -> list[Any]:
    """The classes of a target column: its pinned classes in the type of the values seen (integers stay
    integers), else the sorted values seen."""
    values = sorted(set(seen))
    if column not in pins:
        return values
    raw = list(pins[column])
    pinned: list[Any] = [str(v) for v in raw]
    if values and all(isinstance(v, bool) for v in values):  # a bool column: True / False, 1 / 0
        truth = {"true": True, "1": True, "false": False, "0": False}
        if not all(str(v).lower() in truth for v in raw):
            raise ConfigError(f"data.categories: target {column!r} holds booleans, but its pins are {raw}")
        pinned = [truth[str(v).lower()] for v in raw]
    elif values and all(isinstance(v, int) for v in values):
        try:
            pinned = [int(v) for v in raw]
        except ValueError:
            raise ConfigError(
                f"data.categories: target {column!r} holds integers, but its pinned classes are {raw}"
            ) from None
    outside = [v for v in values if v not in set(pinned)]
    if outside:
        raise _fix(column, [str(v) for v in outside], pinned)
    return pinned


def unpinnable(pins: Pins, categorical: Sequence[str], classes: Iterable[str]) -> None:
    """ConfigError when a pinned column is neither categorical nor a classification target."""
    known = {*categorical, *classes}
    bad = [c for c in pins if c not in known]
    if bad:
        raise ConfigError(
            f"data.categories: {bad[0]!r} is a target that is not read as classes; pin categorical "
            "features and classification targets only"
        )


def saved_pins_problem(vocab: Mapping[str, list[str]], classes: Mapping[str, list[Any]], pins: Pins) -> str:
    """Why a saved preprocessing (a resumed run's) disagrees with ``data.categories``, or ''."""
    for column, pinned in pins.items():
        saved = vocab.get(column, classes.get(column))
        if saved is not None and [str(v) for v in saved] != [str(v) for v in pinned]:
            return f"categories of {column!r} = {saved} but data.categories gives {list(pinned)}"
    return ""
