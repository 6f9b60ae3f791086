"""A model's input/output signature, and new rows checked against it before they are scored.

The signature is what a caller needs to send rows to a model: the input columns (numbers, or
categories with the training vocabulary) or the input tensor's shape, the task, and the output
columns. :func:`as_table` turns what a caller hands :meth:`Predictor.predict` into an Arrow table;
:func:`check_rows` refuses a missing column, a value of the wrong type, an unseen category or a
missing value that training would not have filled, with one line naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from vatra.data import DatasetSpec
from vatra.data.datasets import DIGITS_PIXEL_SCALE
from vatra.data.npz import standardized
from vatra.data.tabular.files import arrow
from vatra.data.tabular.preprocess import missing_masks
from vatra.errors import ConfigError

if TYPE_CHECKING:
    import pyarrow as pa

    from vatra.data.tabular import Preprocess

Signature = dict[str, Any]
# built-in sources whose model inputs are scaled raw values: the same scale training applied
INPUT_TRANSFORMS = {"digits": DIGITS_PIXEL_SCALE}


class InputError(ConfigError):
    """Rows that do not fit the model's signature (exit code 2): the message names the column."""


def classes_of(pre: Preprocess | None, spec: DatasetSpec) -> list[Any]:
    """The class labels as the training data wrote them (a table's target values, else 0..C-1)."""
    if pre is not None and pre.task == "classification":
        return list(pre.classes[pre.target[0]])
    return list(range(spec.num_classes))


def output_columns(task: str, targets: list[str], classes: list[Any]) -> list[str]:
    """The prediction columns of a task: ``prediction`` (one per target when there are several)
    and, for classification and multilabel, the probabilities."""
    if task == "classification":
        return ["prediction", *(f"proba_{c}" for c in classes)]
    if len(targets) > 1:
        cols = [f"prediction_{t}" for t in targets]
        return cols + ([f"proba_{t}" for t in targets] if task == "multilabel" else [])
    return ["prediction"]


def make_signature(
    pre: Preprocess | None,
    spec: DatasetSpec,
    source: str,
    standardize: dict[str, list[float]] | None = None,
) -> Signature:
    """The signature of a model trained on a table (``pre`` fitted) or on tensors (``spec``;
    ``standardize``: array inputs' training mean and std, applied to new samples)."""
    classes = classes_of(pre, spec)
    if pre is not None:
        if pre.task == "multitask":
            raise ConfigError("vatra.load: multitask models cannot be scored yet; score each head's model")
        inputs: list[dict[str, Any]] = [{"name": c, "type": "number"} for c in pre.features]
        inputs += [{"name": c, "type": "category", "categories": pre.vocab[c]} for c in pre.categorical]
        task, targets = pre.task, list(pre.target)
        filled = bool(pre.fill)
    else:
        if spec.kind not in ("classification", "regression", "multilabel"):
            raise ConfigError(f"vatra.load: a {spec.kind!r} model cannot be scored row by row yet")
        inputs = [{"name": "x", "type": "tensor", "shape": list(spec.input_shape), "dtype": "float32"}]
        task, targets, filled = spec.kind, ["target"], False
        if spec.kind != "classification" and spec.num_classes > 1:
            targets = [f"output{i}" for i in range(spec.num_classes)]
    return {
        "task": task,
        "inputs": inputs,
        "targets": targets,
        "classes": classes if task == "classification" else [],
        "outputs": output_columns(task, targets, classes),
        "missing_filled": filled,  # data.nan = "mean": missing numbers take the training mean
        "input_scale": INPUT_TRANSFORMS.get(source),
        "input_standardize": standardize,
    }


# --- new rows ------------------------------------------------------------------------------------


def as_table(data: Any) -> pa.Table:
    """An Arrow table from a pandas DataFrame, an Arrow table or record batch, a dict of columns,
    a list of row dicts, or a CSV/Parquet file's path."""
    pa = arrow()
    if isinstance(data, pa.Table):
        return data
    if isinstance(data, pa.RecordBatch):
        return pa.Table.from_batches([data])
    if isinstance(data, str | Path):
        from vatra.serve.stream import read_whole

        return read_whole(Path(data))
    if isinstance(data, Mapping):
        return pa.table({k: np.asarray(v) if isinstance(v, list | tuple) else v for k, v in data.items()})
    if isinstance(data, list) and all(isinstance(r, Mapping) for r in data):
        return pa.Table.from_pylist(list(data))
    if type(data).__module__.startswith("pandas"):
        return pa.Table.from_pandas(data, preserve_index=False)
    raise InputError(
        f"predict: cannot read rows from a {type(data).__name__}; pass a pandas DataFrame, an Arrow "
        "table, a dict of columns, a list of row dicts or a file path"
    )


def as_tensor_rows(data: Any, sig: Signature) -> np.ndarray:
    """(n, *shape) float32 model inputs of a tensor model from rows (a list of rows, an array, a
    tensor, or a table/DataFrame whose columns are the flattened input), scaled as in training."""
    shape = tuple(sig["inputs"][0]["shape"])
    width = int(np.prod(shape))
    if isinstance(data, list | tuple) or (hasattr(data, "__array__") and not hasattr(data, "columns")):
        try:
            x = np.asarray(data, dtype=np.float64)
        except (TypeError, ValueError) as err:
            raise InputError(f"predict: the rows are not numbers: {err}") from None
    else:
        table = as_table(data)
        x = np.column_stack([np.asarray(c.to_numpy(zero_copy_only=False), np.float64) for c in table.columns])
    if x.ndim == 1 and x.size == width:
        x = x[None]
    if x.size == 0 and x.ndim >= 1:
        x = x.reshape(0, width)
    if x.ndim < 2 or int(np.prod(x.shape[1:])) != width:
        raise InputError(
            f"predict: each row must hold {width} values (input shape {list(shape)}), got rows of shape "
            f"{list(x.shape[1:]) if x.ndim > 1 else []}"
        )
    if not np.isfinite(x).all():
        raise InputError("predict: the rows hold missing or infinite values")
    x = x.reshape(len(x), *shape)
    if sig.get("input_standardize"):
        stats = sig["input_standardize"]
        mean, std = (np.asarray(stats[k], np.float64).reshape(shape) for k in ("mean", "std"))
        x = standardized(x, mean, std)
    x = x.astype(np.float32)
    scale = sig.get("input_scale")
    return x * np.float32(scale) if scale else x


def check_rows(table: pa.Table, sig: Signature, unseen: str = "error") -> None:
    """One line for the first problem of ``table`` against ``sig``: a missing input column, a
    column of the wrong type, a category outside the training vocabulary (``unseen = "error"``;
    ``"zero"`` encodes it as training encodes unseen values: no category), or a missing number
    that training did not fill."""
    pa, pc = arrow(), _compute()
    names = set(table.column_names)
    missing = [i["name"] for i in sig["inputs"] if i["name"] not in names]
    if missing:
        raise InputError(
            f"predict: no column {', '.join(map(repr, missing))}; the model takes "
            f"{', '.join(i['name'] for i in sig['inputs'])}"
        )
    for spec in sig["inputs"]:
        name, col = spec["name"], table.column(spec["name"])
        if spec["type"] == "number":
            t = col.type
            if not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)
                    or pa.types.is_decimal(t) or pa.types.is_null(t)):  # fmt: skip
                raise InputError(f"predict: column {name!r} is {t}, not numeric")
            if not sig.get("missing_filled"):
                mask = missing_masks(table, [name]).get(name)  # training's own check: one cheap pass
                if mask is not None:
                    bad = int(mask.sum())
                    raise InputError(
                        f"predict: column {name!r} has {bad} missing value(s); the model was trained "
                        "without filling them (data.nan = 'mean' fills with the training mean)"
                    )
        elif unseen == "error":
            values = col.dictionary_decode() if pa.types.is_dictionary(col.type) else col
            try:
                strings = values if pa.types.is_string(values.type) else pc.cast(values, pa.string())
            except pa.ArrowException:
                raise InputError(f"predict: column {name!r} is {col.type}, not categories") from None
            known = pa.array(spec["categories"], pa.string())
            outside = pc.filter(strings, pc.invert(pc.fill_null(pc.is_in(strings, value_set=known), True)))
            if len(outside):
                shown = pc.unique(outside).to_pylist()[:3]
                raise InputError(
                    f"predict: column {name!r} holds {shown}, not seen in training (known: "
                    f"{spec['categories'][:10]}); pass unseen='zero' (--unseen zero) to score them as unknown"
                )


def _compute() -> Any:
    arrow()
    import pyarrow.compute as pc

    return pc
