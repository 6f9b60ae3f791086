"""``vatra export``: a run's model as a self-contained model folder.

The folder holds the weights (safetensors, TorchScript or ONNX), the fitted preprocessing, and
``vatra-model.json``: format, the data spec, the signature, the lineage (run config, data table
and version, final metrics, checkpoint version, git commit) and each file's SHA-256. After writing,
the folder is loaded back and scored on the run's validation rows against the PyTorch model; the
largest absolute difference of the outputs is printed and kept in the manifest (``check``). The
folder is written beside its destination and renamed into place: it is never seen half-written.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from vatra._extras import require
from vatra.data import BatchedDataset, DataContext, build_dataset
from vatra.errors import ConfigError
from vatra.serve.folder import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    PREPROCESS,
    WEIGHTS,
    file_sha256,
    load_folder,
    quiet_deprecations,
)
from vatra.serve.lineage import lineage
from vatra.serve.predict import torch_runner
from vatra.serve.signature import make_signature, output_columns
from vatra.serve.weights import RunModel, load_run_model, spec_to_dict

CHECK_ROWS = 2048  # validation rows the exported model is compared on
FORMATS = tuple(f for f in WEIGHTS if f != "executorch")  # .pte: vatra edge export --target executorch
EXPORT = ("vatra export", "--out")


class _Positional(nn.Module):
    """The model called with positional tensors (``x`` or ``x, ids``), as tracing and ONNX need."""

    def __init__(self, model: nn.Module, ids: bool) -> None:
        super().__init__()
        self.model = model
        self.ids = ids

    def forward(self, x: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(x=x, ids=ids) if self.ids else self.model(x)


def validation_inputs(rm: RunModel, run_dir: Path) -> dict[str, np.ndarray] | None:
    """Up to CHECK_ROWS of the run's validation rows as model inputs, built by the training data
    code (the fitted preprocessing reused); None when the run's data can no longer be read."""
    cfg = rm.cfg
    heads = {name: h.task for name, h in cfg.train.multitask.heads.items()}
    ctx = DataContext(seed=cfg.run.seed, run_dir=run_dir, task=cfg.train.task, head_tasks=heads)
    try:
        val = build_dataset(cfg.data, ctx, cfg.train.task).val
    except ConfigError:
        return None
    if not isinstance(val, BatchedDataset) or len(val) == 0:
        return None
    inputs, _ = val.get_batch(np.arange(min(len(val), CHECK_ROWS)))
    if isinstance(inputs, dict):
        return {k: v.numpy() for k, v in inputs.items()}
    return {"x": inputs.numpy()}


def _example(rm: RunModel, val: dict[str, np.ndarray] | None) -> dict[str, np.ndarray]:
    """Inputs to trace or export with: validation rows, else two rows of zeros of the right shapes."""
    if val is not None:
        return {k: v[:2] for k, v in val.items()}
    out = {"x": np.zeros((2, *rm.spec.input_shape), np.float32)}
    if rm.spec.categorical:
        out["ids"] = np.zeros((2, len(rm.spec.categorical)), np.int64)
    return out


def write_weights(rm: RunModel, fmt: str, path: Path, example: dict[str, np.ndarray]) -> None:
    wrapped = _Positional(rm.model, "ids" in example).eval()
    args = tuple(torch.from_numpy(v) for v in example.values())
    if fmt == "safetensors":
        require("safetensors", "serve", "vatra export --format safetensors")
        from safetensors.torch import save_file

        save_file({k: v.detach().contiguous() for k, v in rm.model.state_dict().items()}, str(path))
    elif fmt == "torchscript":
        with torch.no_grad(), quiet_deprecations():
            traced = torch.jit.trace(wrapped, args)
        traced.save(str(path))
    elif fmt == "pt2":
        rows = torch.export.Dim("rows")
        shapes = tuple({0: rows} for _ in args)
        with torch.no_grad(), quiet_deprecations():
            torch.export.save(torch.export.export(wrapped, args, dynamic_shapes=shapes), str(path))
    else:
        require("onnx", "onnx", "vatra export --format onnx")
        names = list(example)
        axes = {n: {0: "rows"} for n in [*names, "output"]}
        with torch.no_grad(), quiet_deprecations():
            torch.onnx.export(
                wrapped, args, str(path), input_names=names, output_names=["output"],
                dynamic_axes=axes, dynamo=False,  # the TorchScript exporter: ~0.1 s, the dynamo one ~10 s
            )  # fmt: skip


def export_run(
    run_dir: str | Path, out_dir: str | Path, fmt: str = "safetensors", version: str | None = None
) -> Path:
    """Write the model of ``run_dir`` (checkpoint ``version``, default ``latest``) as a model folder
    ``out_dir`` in weights format ``fmt``; returns the folder. Loadable by ``vatra.load(out_dir)``."""
    check_destination(out_dir, fmt)
    run_dir = Path(run_dir)
    rm = load_run_model(run_dir, version)
    val = validation_inputs(rm, run_dir)
    return write_folder(rm, out_dir, fmt, lineage(run_dir, rm.cfg, rm.checkpoint), val)


def check_destination(out_dir: str | Path, fmt: str, command: tuple[str, str] = EXPORT) -> None:
    """Refuse an unknown format, or a destination that exists and is not an empty folder, before
    any work (``command``: the command and its folder option, named in the message)."""
    if fmt not in FORMATS:
        raise ConfigError(f"{command[0]} --format {fmt!r}: choose one of {', '.join(FORMATS)}")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{command[0]} {command[1]} {out}: exists and is not empty; name a new folder")


def signature_of(rm: RunModel, source: str) -> dict[str, Any]:
    """The signature of ``rm`` (data source name ``source``); with ``rm.class_outputs`` the
    classes are the model's first that many outputs (a meta-learned model's task classes)."""
    signature = make_signature(rm.preprocess, rm.spec, source, rm.standardize)
    n = rm.class_outputs
    if n and signature["task"] == "classification":
        if len(signature["classes"]) < n:
            raise ConfigError(
                f"the model's first {n} outputs are its classes, but the data names only "
                f"{len(signature['classes'])}: {signature['classes']}"
            )
        signature["classes"] = signature["classes"][:n]
        signature["outputs"] = output_columns("classification", signature["targets"], signature["classes"])
        signature["class_outputs"] = n
    return signature


def write_folder(
    rm: RunModel,
    out_dir: str | Path,
    fmt: str,
    record: dict[str, Any],
    check_inputs: dict[str, np.ndarray] | None,
    source: str | None = None,
    command: tuple[str, str] = EXPORT,
) -> Path:
    """Write ``rm`` as a self-contained model folder ``out_dir`` (weights in ``fmt``, preprocessing,
    manifest with the lineage ``record``); when ``check_inputs`` are given, the folder is loaded back
    and its outputs on them compared with the PyTorch model's (kept as the manifest's ``check``).
    ``source``: the data source's name (default the config's), which sets the inputs' scaling."""
    check_destination(out_dir, fmt, command)
    out = Path(out_dir)
    signature = signature_of(rm, source or rm.cfg.data.name)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        weights = WEIGHTS[fmt]
        write_weights(rm, fmt, tmp / weights, _example(rm, check_inputs))
        files = [weights]
        if rm.preprocess is not None:
            rm.preprocess.save(tmp / PREPROCESS)
            files.append(PREPROCESS)
        manifest: dict[str, Any] = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "weights": {"format": fmt, "file": weights},
            "spec": spec_to_dict(rm.spec),
            "signature": signature,
            "lineage": record,
            "check": None,
            "files": {name: file_sha256(tmp / name) for name in files},
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if check_inputs is not None:
            manifest["check"] = _check(tmp, rm, check_inputs, record.get("adaptation") is not None)
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if out.exists():
            out.rmdir()  # empty, checked above
        tmp.replace(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _check(folder: Path, rm: RunModel, val: dict[str, np.ndarray], adapted: bool) -> dict[str, Any]:
    """The exported model's outputs against the PyTorch model's on the validation rows (an adapted
    model's: the new data's rows it was not adapted on)."""
    want = torch_runner(rm.model)(val)
    got = load_folder(folder).run(val)
    diff = float(np.max(np.abs(got - want))) if want.size else 0.0
    rows = "the new data's rows not in the support set" if adapted else "validation rows"
    return {"rows": len(want), "max_abs_diff": diff, "against": f"the PyTorch model on {rows}"}
