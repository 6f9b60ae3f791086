"""``vatra.load``: a :class:`~vatra.serve.predict.Predictor` from a run folder or a model folder."""

from __future__ import annotations

from pathlib import Path

from vatra.errors import ConfigError
from vatra.serve.folder import MANIFEST, load_folder
from vatra.serve.lineage import lineage
from vatra.serve.predict import Predictor, torch_runner
from vatra.serve.signature import make_signature
from vatra.serve.weights import load_run_model


def load(where: str | Path, version: str | None = None) -> Predictor:
    """A :class:`Predictor` from a run folder (weights of checkpoint ``version``, a version id, tag
    or unique prefix; default ``latest``) or from a model folder written by ``vatra export``."""
    path = Path(where)
    if (path / MANIFEST).is_file():
        if version is not None:
            raise ConfigError(
                f"vatra.load: {path} is an exported model folder; it has one version, pass none"
            )
        return load_folder(path)
    if not path.is_dir():
        raise ConfigError(
            f"vatra.load: no folder {path}; pass a run folder (runs/<run-id>) or a model folder"
        )
    rm = load_run_model(path, version)
    sig = make_signature(rm.preprocess, rm.spec, rm.cfg.data.name, rm.standardize)
    meta = {"weights": "checkpoint", **lineage(path, rm.cfg, rm.checkpoint)}
    return Predictor(torch_runner(rm.model), sig, meta, rm.preprocess, rm.model)
