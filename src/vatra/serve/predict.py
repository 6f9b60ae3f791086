"""The :class:`Predictor`: a trained model scoring new rows as training saw them.

A predictor holds the model (a torch module, or an ONNX Runtime session for an ONNX export), the
run's fitted table preprocessing and the task's output decoding. ``predict`` runs, per batch of
rows: :func:`~vatra.serve.signature.check_rows` (one line for a missing column, a wrong type, an
unseen category), the training code path's own ``Preprocess.encode`` / ``Preprocess.batch`` (no
second implementation of scaling or one-hot encoding), the model, and the decoding: class labels
as the training data wrote them with a ``proba_<class>`` column per class, values in the target's
units (vatra does not rescale targets, so the model's output is already in them), or a ranking
score per row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from vatra._extras import require
from vatra.data.tabular import Preprocess
from vatra.data.tabular.files import arrow
from vatra.errors import ConfigError
from vatra.serve.signature import InputError, Signature, as_table, as_tensor_rows, check_rows

if TYPE_CHECKING:
    import pandas as pd
    import pyarrow as pa
    from torch import nn

# (model inputs: "x" (n, ...) float32 and, with categorical embeddings, "ids" (n, K) int64) -> outputs (n, C)
Runner = Callable[[dict[str, np.ndarray]], np.ndarray]
BATCH_ROWS = 65_536  # rows per model call: bounds the memory of one call, large enough to amortise it


class Predictor:
    """A trained model with its preprocessing and output decoding; build one with :func:`vatra.load`.

    ``signature``: input columns (types, categories), task, output columns. ``meta``: lineage (run,
    config, data table and version, metrics, checkpoint version, weights format). ``model``: the
    torch module (None for an ONNX model, which runs in ONNX Runtime).
    """

    def __init__(
        self,
        runner: Runner,
        signature: Signature,
        meta: dict[str, Any],
        preprocess: Preprocess | None,
        model: nn.Module | None = None,
    ) -> None:
        self.runner = runner
        self.signature = signature
        self.meta = meta
        self.preprocess = preprocess
        self.model = model
        self.batch_rows = BATCH_ROWS

    def __repr__(self) -> str:
        names = ", ".join(i["name"] for i in self.signature["inputs"][:6])
        return f"Predictor({self.signature['task']}, inputs: {names}, weights: {self.meta.get('weights')})"

    # -- scoring ---------------------------------------------------------------------------

    def predict(self, data: Any, *, keep: Sequence[str] = (), unseen: str = "error") -> pd.DataFrame:
        """Score rows: a pandas DataFrame, an Arrow table, a dict of columns, a list of row dicts or
        a CSV/Parquet path (tensor models also take an array or a list of rows). One output row per
        input row, in input order: ``prediction`` (and ``proba_<class>``), plus the ``keep`` columns."""
        require("pandas", "serve", "Predictor.predict (it returns a pandas DataFrame)")
        return self.predict_arrow(data, keep=keep, unseen=unseen).to_pandas()

    def predict_arrow(self, data: Any, *, keep: Sequence[str] = (), unseen: str = "error") -> pa.Table:
        """:meth:`predict` as an Arrow table (no pandas conversion: what the streamed CLI writes)."""
        pa = arrow()
        if self.preprocess is None:
            if keep:
                table = as_table(data)
                _check_keep(table, keep)
                x = as_tensor_rows(table.drop_columns(list(keep)), self.signature)
            else:
                table, x = None, as_tensor_rows(data, self.signature)
            out = self.decode(self.run({"x": x}))
        else:
            table = as_table(data)
            _check_keep(table, keep)
            out = self.decode(self.run(self.inputs(table, unseen)))
        kept = {c: table.column(c) for c in keep} if table is not None else {}
        return pa.table({**kept, **out})

    def inputs(self, table: pa.Table, unseen: str = "error") -> dict[str, np.ndarray]:
        """The model inputs of a table's rows, checked against the signature and encoded by the
        training code path: ``x`` (n, F) float32 and, with embeddings, ``ids`` (n, K) int64."""
        if self.preprocess is None:
            return {"x": as_tensor_rows(table, self.signature)}
        if unseen not in ("error", "zero"):
            raise ConfigError(f"predict: unseen = {unseen!r}; use 'error' or 'zero'")
        check_rows(table, self.signature, unseen)
        pre = self.preprocess
        encoded = pre.encode(table, targets=False)
        return pre.batch([(encoded, np.arange(table.num_rows))], targets=False)

    def run(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        """The model's raw outputs (n, C), ``batch_rows`` rows per call."""
        n = len(inputs["x"])
        if n <= self.batch_rows:
            return self.runner(inputs)
        parts = [
            self.runner({k: v[start : start + self.batch_rows] for k, v in inputs.items()})
            for start in range(0, n, self.batch_rows)
        ]
        return np.concatenate(parts)

    def decode(self, raw: np.ndarray) -> dict[str, Any]:
        """Output columns from the raw outputs (n, C): labels and probabilities, or values."""
        import torch  # softmax and argmax over a row's few outputs: numpy's axis-1 reductions are ~5x slower

        pa, sig = arrow(), self.signature
        raw = np.ascontiguousarray(raw, dtype=np.float32).reshape(len(raw), -1)  # (n, C)
        logits = torch.from_numpy(raw)
        task, targets = sig["task"], sig["targets"]
        if task == "classification":
            if sig.get("class_outputs"):  # a meta-learned model: its first N outputs are the task's classes
                logits = logits[:, : sig["class_outputs"]]
            proba = torch.softmax(logits, dim=1).numpy()  # (n, C)
            labels = pa.array(sig["classes"]).take(pa.array(logits.argmax(dim=1).numpy()))
            return {"prediction": labels, **{f"proba_{c}": proba[:, j] for j, c in enumerate(sig["classes"])}}
        if task == "multilabel":
            proba = torch.sigmoid(logits).numpy()  # (n, K) per label
            if len(targets) == 1:
                return {"prediction": (proba[:, 0] > 0.5).astype(np.int64), "proba": proba[:, 0]}
            cols = {f"prediction_{t}": (proba[:, j] > 0.5).astype(np.int64) for j, t in enumerate(targets)}
            return cols | {f"proba_{t}": proba[:, j] for j, t in enumerate(targets)}
        if len(targets) == 1 or task == "ranking":
            return {"prediction": raw[:, 0]}  # the value in the target's units, or the row's ranking score
        return {f"prediction_{t}": raw[:, j] for j, t in enumerate(targets)}


def _check_keep(table: pa.Table, keep: Sequence[str]) -> None:
    absent = [c for c in keep if c not in table.column_names]
    if absent:
        raise InputError(
            f"predict: --keep {absent[0]!r}: no such column; the input has {', '.join(table.column_names)}"
        )


def torch_runner(model: nn.Module, positional: bool = False) -> Runner:
    """Runs a torch module under inference mode: inputs by the batch contract (``x`` alone, or
    ``x`` and ``ids`` as keywords), or positionally for a traced (TorchScript) export."""
    import torch

    from vatra.engine.objective import call_model

    def run(inputs: dict[str, np.ndarray]) -> np.ndarray:
        tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in inputs.items()}
        with torch.inference_mode():
            if positional:  # traced as forward(x) or forward(x, ids), whatever the dict's order
                out = model(*(tensors[k] for k in ("x", "ids") if k in tensors))
            else:
                out = call_model(model, tensors if "ids" in tensors else tensors["x"])
        if not isinstance(out, torch.Tensor):
            raise ConfigError(
                f"predict: the model returned a {type(out).__name__}, not one tensor of outputs"
            )
        return out.float().numpy()

    return run
