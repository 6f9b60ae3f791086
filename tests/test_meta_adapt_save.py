"""``vatra meta adapt RUN --save DIR``: the adapted model as a model folder that ``vatra.load`` and
``vatra model register`` read without the run folder, scoring as the curve reported."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tests.conftest import vatra_in_process
from tests.test_meta import meta_config

import vatra
from vatra.data import DataContext, build_dataset

NAMES = {7: "seven", 8: "eight", 9: "nine"}


@pytest.fixture(scope="module")
def meta_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A 3-way digits meta run (3 meta-steps) and a new site: a CSV of 30 rows of each of 3 digits,
    labelled with words, every row in the training split (so rows as read = rows of the file)."""
    root = tmp_path_factory.mktemp("meta-save")
    cfg = meta_config(algorithm="fomaml", inner_steps=2)
    cfg.run.out_dir = str(root)
    vatra.fit(cfg, run_dir=root / "run")
    data = build_dataset(cfg.data, DataContext(seed=0), "classification").train
    rows = np.concatenate([np.flatnonzero(data.labels == d)[:30] for d in NAMES])
    x = data.get_batch(rows)[0].numpy() * 16  # back to the raw pixel counts 0..16
    lines = [",".join([*(f"p{i}" for i in range(64)), "label", "split"])]
    for pixels, digit in zip(x, data.labels[rows], strict=True):
        lines.append(",".join([*(f"{v:g}" for v in pixels), NAMES[int(digit)], "train"]))
    (root / "site.csv").write_text("\n".join(lines) + "\n")
    return root / "run", root / "site.csv"


def adapt(capsys: pytest.CaptureFixture[str], run: Path, csv: Path, *args: str) -> tuple[int, str, str]:
    return vatra_in_process(
        capsys, "meta", "adapt", str(run), "--data", str(csv),
        "--set", "data.target=label", "--set", "data.split_column=split", *args,
    )  # fmt: skip


@pytest.mark.parametrize("fmt", ["safetensors", "onnx"])
def test_the_saved_model_scores_as_the_curve_said_without_the_run(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, meta_run: tuple[Path, Path], fmt: str
) -> None:
    # Prepare: the run and the new site, the run moved away after the adaptation
    run, csv = meta_run
    moved = tmp_path / "run-elsewhere"
    # Execute: one draw per K, so the curve's K = 5 figure is the saved model's own support set
    code, out, err = adapt(
        capsys, run, csv, "--shots", "1,5", "--repeats", "1", "--out", str(tmp_path / "curve.json"),
        "--save", str(tmp_path / "model"), "--format", fmt,
    )  # fmt: skip
    assert code == 0, err
    curve = json.loads((tmp_path / "curve.json").read_text())["curve"]
    assert not (run / "data").exists()  # the new data's preprocessing was fitted elsewhere, not in the run
    run.rename(moved)
    try:
        predictor = vatra.load(tmp_path / "model")
        scored = predictor.predict(csv, keep=["label"])
    finally:
        moved.rename(run)
    # Assert: labels as the new data wrote them, one probability per task class (not per model output)
    adaptation = predictor.meta["adaptation"]
    assert adaptation["shots"] == 5 and adaptation["support_rows"] == 15 and adaptation["seed"] == 0
    assert predictor.signature["classes"] == ["eight", "nine", "seven"]
    assert [c for c in scored.columns if c.startswith("proba_")] == [
        "proba_eight",
        "proba_nine",
        "proba_seven",
    ]
    np.testing.assert_allclose(scored.filter(like="proba_").sum(axis=1), 1.0, rtol=1e-5)
    # the rows not drawn: the accuracy the curve reported for K = 5 (one row per near-tie at most,
    # float32 outputs of a batch of 75 against the curve's; none occurs here)
    rest = np.setdiff1d(np.arange(len(scored)), adaptation["support_index"])
    right = (scored["prediction"] == scored["label"]).to_numpy()[rest]
    assert len(rest) == adaptation["scored_rows"] == 75
    assert right.sum() == round(curve[1]["accuracy"] * len(rest)) == round(adaptation["accuracy"] * 75)
    assert predictor.meta["check"]["max_abs_diff"] < 1e-4
    assert f"K = 5 per class, the curve's first draw; accuracy {curve[1]['accuracy']:.3f}" in out


def test_an_adapted_folder_registers_and_resolves(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, meta_run: tuple[Path, Path]
) -> None:
    # Prepare
    run, csv = meta_run
    code, _, err = adapt(capsys, run, csv, "--shots", "3", "--repeats", "1", "--save", str(tmp_path / "m"))
    assert code == 0, err
    # Execute: the model folder registered as it is (twice: the same content is the same version)
    registry = str(tmp_path / "registry")
    code, out, err = vatra_in_process(
        capsys, "model", "register", str(tmp_path / "m"), "--name", "site", "--registry", registry
    )
    again = vatra_in_process(
        capsys, "model", "register", str(tmp_path / "m"), "--name", "site", "--registry", registry
    )
    # Assert
    assert code == 0, err
    assert out.startswith("registered site@") and again[1].startswith("already registered site@")
    from vatra.serve.registry import Registry

    reg = Registry(registry)
    (mv,) = reg.versions("site")
    assert mv.meta["adaptation"]["shots"] == 3 and mv.meta["run"] == run.name
    predictor = vatra.load(reg.resolve("site"))
    assert set(predictor.predict(csv)["prediction"]) <= set(NAMES.values())
    # a folder changed after it was written is refused in one line, never registered
    manifest = json.loads((tmp_path / "m" / "vatra-model.json").read_text())
    weights = tmp_path / "m" / manifest["weights"]["file"]
    weights.write_bytes(weights.read_bytes()[:-8] + bytes(8))
    code, _, err = vatra_in_process(
        capsys, "model", "register", str(tmp_path / "m"), "--name", "site", "--registry", registry
    )
    assert code == 2 and "does not match its SHA-256" in err and len(err.strip().splitlines()) == 1
    assert len(reg.versions("site")) == 1


def test_a_bad_save_is_one_line_and_writes_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, meta_run: tuple[Path, Path]
) -> None:
    run, csv = meta_run
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    code, _, err = adapt(capsys, run, csv, "--save", str(tmp_path / "full"))
    assert code == 2 and "vatra meta adapt --save" in err and "exists and is not empty" in err
    assert len(err.strip().splitlines()) == 1 and (tmp_path / "full" / "keep.txt").read_text() == "mine"
    code, _, err = adapt(capsys, run, csv, "--save", str(tmp_path / "m"), "--format", "pickle")
    assert code == 2 and "--format 'pickle': choose one of" in err
    # two classes for a 3-way initialisation: the third output would have no label to decode to
    two = [line for line in csv.read_text().splitlines() if ",seven," not in line]
    (tmp_path / "two.csv").write_text("\n".join(two) + "\n")
    code, _, err = adapt(capsys, run, tmp_path / "two.csv", "--shots", "2", "--save", str(tmp_path / "m"))
    assert code == 2 and "give rows of 3 classes" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "m").exists()
