"""vatra export / vatra.load of a model folder, and a sharded (FSDP) checkpoint loaded into one process."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from tests._dist import end_group, rendezvous, spawn
from tests.conftest import vatra_in_process
from tests.test_serve_predict import _config, _table, _val

import vatra
from vatra.errors import ConfigError
from vatra.serve import export_run
from vatra.serve.folder import MANIFEST


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A finished run (categories one-hot encoded) and its validation rows."""
    folder = tmp_path_factory.mktemp("export")
    table = _table()
    pq.write_table(table, folder / "rows.parquet")
    result = vatra.fit(_config(folder / "rows.parquet", folder / "runs"))
    return result.run_dir, _val(table)


@pytest.mark.parametrize(("fmt", "tol"), [("safetensors", 0.0), ("torchscript", 1e-6), ("onnx", 1e-4)])
def test_export_then_load_gives_the_same_predictions(
    trained: Any, tmp_path: Path, fmt: str, tol: float
) -> None:
    run, val = trained
    want = vatra.load(run).predict(val)
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    folder = export_run(copy, tmp_path / "model", fmt)
    shutil.rmtree(copy)  # the model folder stands alone
    predictor = vatra.load(folder)
    got = predictor.predict(val)
    assert got["prediction"].tolist() == want["prediction"].tolist()
    np.testing.assert_allclose(got["proba_yes"], want["proba_yes"], rtol=0, atol=tol)
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["check"]["rows"] == val.num_rows and manifest["check"]["max_abs_diff"] <= tol
    lineage = predictor.meta
    assert lineage["weights"] == fmt and lineage["checkpoint"]["step"] == 25
    assert lineage["metrics"]["val_accuracy"] == pytest.approx(
        json.loads((run / "summary.json").read_text())["val_accuracy"]
    )
    assert lineage["config"]["data"]["target"] == "y" and predictor.signature["classes"] == ["no", "yes"]
    assert (predictor.model is None) == (fmt == "onnx")  # ONNX runs in ONNX Runtime, not torch


def test_a_tampered_model_folder_is_refused(trained: Any, tmp_path: Path) -> None:
    run, _ = trained
    folder = export_run(run, tmp_path / "model", "safetensors")
    pre = folder / "preprocess.json"
    pre.write_text(pre.read_text().replace('"standardize": true', '"standardize": false'))
    with pytest.raises(ConfigError, match="does not match its SHA-256"):
        vatra.load(folder)


@pytest.mark.parametrize("fmt", ["safetensors", "torchscript", "onnx"])
def test_hostile_model_folders_are_refused_in_one_line(trained: Any, tmp_path: Path, fmt: str) -> None:
    run, _ = trained
    folder = export_run(run, tmp_path / "model", fmt)
    good = json.loads((folder / MANIFEST).read_text())

    def refused(manifest: Any, words: str) -> None:
        (folder / MANIFEST).write_text(json.dumps(manifest))
        with pytest.raises(ConfigError, match=words) as err:
            vatra.load(folder)
        assert "\n" not in str(err.value)

    weights = good["weights"]["file"]
    outside = {**good, "files": {**good["files"], "../model.bin": good["files"][weights]}}
    refused(outside, "names a file outside its folder")
    refused({**good, "weights": {"format": fmt, "file": "../../x"}}, "names unknown weights")
    refused({k: v for k, v in good.items() if k != "signature"}, "lacks its files")
    (folder / weights).write_bytes(b"not a model at all")  # the attacker rewrites the checksum too
    refused({**good, "files": {**good["files"], weights: hashlib.sha256(b"not a model at all").hexdigest()}},
            "cannot read the model weights")  # fmt: skip
    (folder / MANIFEST).write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read"):
        vatra.load(folder)


def test_export_cli_reports_the_onnx_difference_and_refuses_a_full_folder(
    trained: Any, tmp_path: Path, capsys: Any
) -> None:
    run, _ = trained
    code, out, err = vatra_in_process(
        capsys, "export", str(run), "--format", "onnx", "--out", str(tmp_path / "m")
    )
    assert code == 0, err
    assert "max abs difference from the PyTorch model on 80 validation rows" in out
    code, _, err = vatra_in_process(
        capsys, "export", str(run), "--format", "onnx", "--out", str(tmp_path / "m")
    )
    assert code == 2 and "exists and is not empty" in err
    code, _, err = vatra_in_process(
        capsys, "export", str(run), "--format", "pickle", "--out", str(tmp_path / "n")
    )
    assert (
        code == 2
        and err.strip()
        == "error: vatra export --format 'pickle': choose one of safetensors, torchscript, onnx, pt2"
    )


def test_a_model_with_category_embeddings_exports_to_every_format(tmp_path: Path) -> None:
    table = _table()
    pq.write_table(table, tmp_path / "rows.parquet")
    cfg = _config(tmp_path / "rows.parquet", tmp_path / "runs", categorical_encoding="embedding")
    cfg["train"]["steps"] = 5
    run = vatra.fit(cfg).run_dir
    want = vatra.load(run).predict(_val(table))
    for fmt, tol in (("safetensors", 0.0), ("torchscript", 1e-6), ("onnx", 1e-4)):  # inputs x and ids
        got = vatra.load(export_run(run, tmp_path / fmt, fmt)).predict(_val(table))
        np.testing.assert_allclose(got["proba_yes"], want["proba_yes"], rtol=0, atol=tol, err_msg=fmt)


# --- a model trained with FSDP over 2 ranks, loaded into one process -------------------------------


def _fsdp_rank(rank: int, world: int, rdzv: str, run: str) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from vatra.engine import DistContext

    torch.set_num_threads(1)
    cfg = {
        "run": {"progress": "off", "tensorboard": False},
        "data": {"name": "digits"},
        "model": {"name": "mlp", "hidden": [32]},
        "train": {"steps": 4, "batch_size": 16, "eval_every": 0},
        "optim": {"name": "adamw", "lr": 0.01},
        "monitor": {"report": False},
        "parallel": {"fsdp": world},
    }
    ctx = DistContext.init(vatra.load_config(None).dist, rank=rank, world_size=world, init_method=rdzv)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    try:
        result = vatra.fit(cfg, run_dir=run)
        full = get_model_state_dict(result.model, options=StateDictOptions(full_state_dict=True))
        if rank == 0:  # the reference: the sharded parameters gathered by torch itself
            torch.save({k: v.detach().clone() for k, v in full.items()}, Path(run) / "full.pt")
    finally:
        end_group()
        del ctx


@pytest.mark.slow(20)
def test_an_fsdp_checkpoint_loads_into_one_process(tmp_path: Path) -> None:
    run = tmp_path / "run"
    spawn(_fsdp_rank, 2, (2, rendezvous(tmp_path), str(run)))
    manifest = json.loads(next((run / "checkpoints" / "versions").iterdir()).read_text())
    assert manifest["world_size"] == 2  # written as two ranks' shards
    predictor = vatra.load(run)
    assert predictor.model is not None
    want = torch.load(run / "full.pt", weights_only=True)
    got = predictor.model.state_dict()
    assert set(got) == set(want)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=name)
