"""Checking a user's datasets against the batch contract, and inferring their spec from one item."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset

from vatra.data._base import Datasets, DatasetSpec, StreamDataset, TargetSpec
from vatra.errors import ConfigError
from vatra.registry import describe


def is_dataset(obj: Any) -> bool:
    """A torch Dataset, or anything map-style (``__len__`` and ``__getitem__``, e.g. a list of pairs)."""
    return isinstance(obj, Dataset) or (hasattr(obj, "__len__") and hasattr(obj, "__getitem__"))


def user_datasets(out: Any, source: str, task: str = "auto", key: str = "data.name") -> Datasets:
    """A factory's ``(train, val)`` or ``(train, val, spec)`` as :class:`Datasets` (spec inferred if
    absent)."""
    if isinstance(out, Datasets):
        return out
    if not isinstance(out, tuple | list) or len(out) not in (2, 3):
        raise ConfigError(
            f"{key}: {source!r} returned {describe(out)}; expected (train, val) or (train, val, spec) "
            "with torch Datasets (val may be None)"
        )
    train, val = out[0], out[1]
    spec = out[2] if len(out) == 3 else None
    for name, ds in (("train", train), ("val", val)):
        if ds is None and name == "val":
            continue
        if not is_dataset(ds):
            raise ConfigError(
                f"{key}: {source!r} returned {describe(ds)} as the {name} dataset; expected a "
                "torch.utils.data.Dataset (map-style or iterable)"
            )
    if spec is not None and not isinstance(spec, DatasetSpec):
        raise ConfigError(f"{key}: {source!r} returned {describe(spec)} as the spec; expected a DatasetSpec")
    return Datasets(train, val, spec or infer_spec(train, task, source, key))


def first_item(ds: Any, source: str, key: str) -> tuple[Any, Any]:
    """Item 0 of a map-style dataset, the first item (or first batch) of an iterable one."""
    if isinstance(ds, StreamDataset):
        raise ConfigError(f"{key}: {source!r}: a StreamDataset must come with its DatasetSpec")
    try:
        item = next(iter(ds)) if isinstance(ds, IterableDataset) else ds[0]
    except (StopIteration, IndexError):
        raise ConfigError(f"{key}: {source!r}: the training dataset is empty") from None
    if not isinstance(item, tuple | list) or len(item) != 2:
        raise ConfigError(
            f"{key}: {source!r}: an item is {describe(item)}; a dataset item must be (inputs, target), "
            "each a tensor or a dict of tensors"
        )
    return item[0], item[1]


def _as_tensor(obj: Any, what: str, source: str, key: str) -> torch.Tensor:
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, int | float | bool):
        return torch.tensor(obj)
    raise ConfigError(
        f"{key}: {source!r}: the item's {what} is {describe(obj)}; use a tensor or a dict of tensors"
    )


def _target_kind(t: torch.Tensor) -> tuple[str, int]:
    """(kind, size) a target tensor of one item implies: int scalar = a class, floats = regression."""
    if not t.is_floating_point() and t.dim() == 0:
        return "classification", 0
    return "regression", max(1, t.numel())


def infer_spec(ds: Any, task: str = "auto", source: str = "dataset", key: str = "data.name") -> DatasetSpec:
    """A spec from the first item: input shape, task and output width (classes when the dataset has a
    ``num_classes`` attribute; 0 = unknown, which only built-in models need)."""
    inputs, target = first_item(ds, source, key)
    if isinstance(inputs, dict):
        main = inputs.get("x", next(iter(inputs.values()), None))
        shape = tuple(_as_tensor(main, "inputs['x']", source, key).shape) if main is not None else ()
    else:
        shape = tuple(_as_tensor(inputs, "inputs", source, key).shape)
    classes = int(getattr(ds, "num_classes", 0) or 0)
    if isinstance(target, dict):
        heads: dict[str, TargetSpec] = {}
        for name, t in target.items():
            kind, size = _target_kind(_as_tensor(t, f"target[{name!r}]", source, key))
            heads[name] = TargetSpec(kind, size)  # type: ignore[arg-type]
        return DatasetSpec("multitask", shape, 0, heads=heads)
    kind, size = _target_kind(_as_tensor(target, "target", source, key))
    if task != "auto":
        kind = task
    width = classes if kind in ("classification", "lm") else size
    return DatasetSpec(kind, shape, width)  # type: ignore[arg-type]
