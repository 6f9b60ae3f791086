"""A model folder (what ``vatra export`` writes) read back into a :class:`Predictor`, no run folder needed.

``vatra-model.json`` names the weights format and file, the data spec, the signature, the lineage
and each file's SHA-256; a file that does not match its checksum is refused before it is read.
Weights formats: ``safetensors`` (tensors only, no code: the model is rebuilt from the config in the
lineage, so a user's model code must be importable), ``torchscript`` (the traced model, no model
code needed; loading runs code from the file, so load only folders you trust), ``pt2`` (a
``torch.export`` program, e.g. a torchao-quantized model from ``vatra edge export``; the same trust
applies) and ``onnx`` (scored by ONNX Runtime).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from vatra._extras import require
from vatra.data.tabular import Preprocess
from vatra.errors import ConfigError
from vatra.serve.predict import Predictor, Runner, torch_runner

MANIFEST = "vatra-model.json"
FORMAT = "vatra-model"
FORMAT_VERSION = 1
WEIGHTS = {
    "safetensors": "model.safetensors",
    "torchscript": "model.pt",
    "onnx": "model.onnx",
    "pt2": "model.pt2",  # a torch.export program: what torchao's int8 tensors export to (not TorchScript)
    "executorch": "model.pte",  # an ExecuTorch program lowered to XNNPACK (vatra edge export writes it)
}
PREPROCESS = "preprocess.json"


@contextlib.contextmanager
def quiet_deprecations() -> Iterator[None]:
    """torch deprecates TorchScript and its ONNX exporter in favour of torch.export: both still
    work and are what these formats are (the dynamo ONNX exporter takes ~10 s per model here)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        yield


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_manifest(folder: Path) -> dict[str, Any]:
    """The folder's manifest, every listed file checked against its SHA-256."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"vatra.load: cannot read {folder / MANIFEST}: {err}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ConfigError(f"vatra.load: {folder / MANIFEST} is not a vatra model manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ConfigError(
            f"vatra.load: {folder} was written in model format {manifest.get('format_version')}; this "
            f"vatra reads format {FORMAT_VERSION}: upgrade vatra or export the run again"
        )
    files, weights = manifest.get("files"), manifest.get("weights")
    missing = [k for k in ("spec", "signature", "lineage") if not isinstance(manifest.get(k), dict)]
    if not isinstance(files, dict) or not isinstance(weights, dict) or missing:
        raise ConfigError(f"vatra.load: {folder / MANIFEST} lacks its files, weights or {missing}")
    if weights.get("format") not in WEIGHTS or weights.get("file") != WEIGHTS[weights["format"]]:
        raise ConfigError(f"vatra.load: {folder / MANIFEST} names unknown weights {weights}")
    for name in (weights["file"], *((PREPROCESS,) if PREPROCESS in files else ())):
        if name not in files:
            raise ConfigError(f"vatra.load: {folder / MANIFEST} has no checksum for {name!r}")
    for name, digest in files.items():
        path = folder / name
        if not isinstance(name, str) or Path(name).name != name or name != Path(name).as_posix():
            raise ConfigError(f"vatra.load: {folder / MANIFEST} names a file outside its folder: {name!r}")
        if not path.is_file():
            raise ConfigError(f"vatra.load: {folder} lacks the file {name!r} its manifest lists")
        if file_sha256(path) != digest:
            raise ConfigError(
                f"vatra.load: {path} does not match its SHA-256 in {MANIFEST} (changed or damaged); "
                "export the model again"
            )
    return manifest


def load_folder(folder: Path) -> Predictor:
    """A predictor from a model folder."""
    manifest = read_manifest(folder)
    fmt = manifest["weights"]["format"]
    weights = folder / WEIGHTS[fmt]
    pre = Preprocess.load(folder / PREPROCESS) if PREPROCESS in manifest["files"] else None
    model = None
    if fmt == "safetensors":
        model = _safetensors_model(manifest, weights)
        runner = torch_runner(model)
    elif fmt == "torchscript":
        import torch

        try:
            with quiet_deprecations():
                model = torch.jit.load(str(weights), map_location="cpu")
        except Exception as err:  # a damaged archive: torch raises RuntimeError and others
            raise _unreadable(weights, err) from None
        model.eval()
        runner = torch_runner(model, positional=True)
    elif fmt == "pt2":
        model = _exported_program(weights)
        runner = torch_runner(model, positional=True)
    elif fmt == "executorch":
        runner = pte_runner(weights)
    else:
        runner = onnx_runner(weights)
    meta = {"weights": fmt, "folder": str(folder.resolve()), **manifest["lineage"]}
    if manifest.get("check"):
        meta["check"] = manifest["check"]
    return Predictor(runner, manifest["signature"], meta, pre, model)


def _safetensors_model(manifest: dict[str, Any], weights: Path) -> Any:
    require("safetensors", "serve", "loading a safetensors model folder")
    from safetensors.torch import load_file

    from vatra.config import config_from_dict
    from vatra.serve.weights import build_run_model, spec_from_dict

    cfg = config_from_dict(dict(manifest["lineage"]["config"]))
    model = build_run_model(cfg, spec_from_dict(manifest["spec"]))
    try:
        tensors = load_file(str(weights))
    except Exception as err:  # safetensors' own error type for a damaged header
        raise _unreadable(weights, err) from None
    try:
        model.load_state_dict(tensors)
    except RuntimeError as err:
        raise ConfigError(f"vatra.load: {weights} does not fit the model its config builds: {err}") from None
    model.eval()
    return model


def _exported_program(weights: Path) -> Any:
    import importlib.util

    import torch

    if importlib.util.find_spec("torchao") is not None:  # its int8 tensor types must be registered
        import torchao  # noqa: F401

    try:
        with quiet_deprecations():
            return torch.export.load(str(weights)).module()
    except Exception as err:  # a damaged archive, or a tensor type whose package is missing
        raise _unreadable(weights, err) from None


def _unreadable(path: Path, err: BaseException) -> ConfigError:
    text = " ".join(str(err).split())[:200]
    return ConfigError(f"vatra.load: cannot read the model weights {path}: {type(err).__name__}: {text}")


def onnx_runner(path: Path, threads: int = 0) -> Runner:
    """Scores through an ONNX Runtime session on the CPU (inputs ``x`` and, with embeddings, ``ids``)."""
    ort = require("onnxruntime", "onnx", "scoring an ONNX model")
    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    try:
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as err:  # onnxruntime's own errors for a file that is no ONNX model
        raise _unreadable(path, err) from None
    names = [i.name for i in session.get_inputs()]

    def run(inputs: dict[str, np.ndarray]) -> np.ndarray:
        return np.asarray(session.run(None, {n: inputs[n] for n in names})[0])

    return run


def pte_runner(path: Path) -> Runner:
    """Scores through the ExecuTorch runtime (the XNNPACK delegate on the CPU), inputs ``x`` then ``ids``."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ExecuTorch's pybindings warn that the API is experimental
        runtime = require("executorch.runtime", "executorch", "scoring an ExecuTorch (.pte) model")
    try:
        method = runtime.Runtime.get().load_program(path).load_method("forward")
    except Exception as err:  # the runtime's own errors for a file that is no ExecuTorch program
        raise _unreadable(path, err) from None

    # A lowered conv net can refuse a batch past a size its XNNPACK plan resizes to (15 rows for the
    # cnn in tests/test_edge_qat4.py, though the export allows more): the rows then go in chunks,
    # halved until one is accepted, and later calls start at the size that worked.
    largest = [1 << 30]

    def run(inputs: dict[str, np.ndarray]) -> np.ndarray:
        arrays = [np.ascontiguousarray(inputs[k]) for k in ("x", "ids") if k in inputs]
        rows, out, at = len(arrays[0]), [], 0
        while at < rows:
            size = min(largest[0], rows - at)
            chunk = [torch.from_numpy(a[at : at + size]) for a in arrays]
            try:
                out.append(np.asarray(method.execute(chunk)[0].float().numpy()))
            except RuntimeError as err:  # the runtime logs the cause (a bounded input it cannot resize)
                if size == 1:
                    raise ConfigError(
                        f"ExecuTorch refused even one row for {path} ({err}); use --target onnx"
                    ) from None
                largest[0] = size // 2
                continue
            at += size
        return np.concatenate(out) if len(out) > 1 else out[0]

    return run
