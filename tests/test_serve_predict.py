"""vatra.load / Predictor.predict / vatra predict: a trained run scores new rows as training saw them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
import torch
from tests.conftest import vatra_in_process

import vatra
from vatra.data import DataContext, build_dataset
from vatra.data.stratify import bundled_digits, stratified_split
from vatra.errors import ConfigError
from vatra.serve import InputError, export_run
from vatra.serve.stream import predict_file

N_ROWS = 400


def _table(n: int = N_ROWS, seed: int = 0) -> pa.Table:
    """Two numeric features, a categorical one, a string label and a train/val split column."""
    rng = np.random.default_rng(seed)
    a, b = rng.normal(size=n), rng.normal(5.0, 2.0, size=n)
    c = rng.choice(["x", "y", "z"], size=n)
    label = np.where(a + (c == "x") + 0.3 * rng.normal(size=n) > 0.3, "yes", "no")
    split = np.where(np.arange(n) % 5 == 0, "val", "train")
    return pa.table({"id": np.arange(n) * 7, "a": a, "b": b, "c": c, "y": label, "split": split})


def _config(data: Path, out: Path, **data_keys: Any) -> dict[str, Any]:
    return {
        "run": {"progress": "off", "tensorboard": False, "out_dir": str(out)},
        "data": {
            "name": "table",
            "path": str(data),
            "target": "y",
            "features": ["a", "b", "c"],
            "categorical": ["c"],
            "split_column": "split",
            **data_keys,
        },
        "model": {"name": "mlp", "hidden": [16]},
        "train": {"steps": 25, "batch_size": 16, "eval_every": 0},
        "optim": {"name": "adamw", "lr": 0.01},
        "monitor": {"report": False},
    }


@pytest.fixture(scope="module")
def tabular(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, pa.Table, dict[str, Any]]:
    """A finished classification run on a table: (run folder, its table, its summary)."""
    folder = tmp_path_factory.mktemp("tabular")
    table = _table()
    pq.write_table(table, folder / "rows.parquet")
    result = vatra.fit(_config(folder / "rows.parquet", folder / "runs"))
    return result.run_dir, table, result.summary


def _val(table: pa.Table) -> pa.Table:
    return table.filter(pa.compute.equal(table.column("split"), "val"))


def test_predict_on_validation_rows_reproduces_the_runs_accuracy(tabular: Any) -> None:
    run, table, summary = tabular
    val = _val(table)
    out = vatra.load(run).predict(val.to_pandas(), keep=["id"])
    assert list(out.columns) == ["id", "prediction", "proba_no", "proba_yes"]
    assert out["id"].tolist() == val.column("id").to_pylist()  # one output row per input row, in order
    accuracy = float((out["prediction"].to_numpy() == val.column("y").to_numpy(zero_copy_only=False)).mean())
    assert accuracy == pytest.approx(summary["val_accuracy"], abs=1e-9)
    np.testing.assert_allclose(out["proba_no"] + out["proba_yes"], 1.0, rtol=1e-6)
    assert set(out["prediction"]) <= {"yes", "no"}  # the labels as the training data wrote them


def test_predictor_encodes_rows_exactly_as_training_did(tabular: Any) -> None:
    run, table, _ = tabular
    predictor = vatra.load(run)
    cfg = vatra.load_config(run / "config.toml")
    trained = build_dataset(cfg.data, DataContext(seed=cfg.run.seed, run_dir=run)).val
    assert trained is not None
    mine = predictor.inputs(_val(table).drop_columns(["y", "split"]))  # no target needed to score
    np.testing.assert_array_equal(mine["x"], trained.fields["x"].numpy())  # type: ignore[attr-defined]


def test_every_input_form_gives_the_same_predictions(tabular: Any, tmp_path: Path) -> None:
    run, table, _ = tabular
    predictor = vatra.load(run)
    rows = table.slice(0, 6).select(["a", "b", "c"])
    want = predictor.predict(rows)
    pq.write_table(rows, tmp_path / "rows.parquet")
    for form in (rows.to_pandas(), rows.to_pydict(), rows.to_pylist(), tmp_path / "rows.parquet"):
        assert predictor.predict(form).equals(want)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda t: t.drop_columns(["b"]), "no column 'b'"),
        (lambda t: t.set_column(1, "a", pa.array(["1.0"] * t.num_rows)), "column 'a' is string, not numeric"),
        (lambda t: t.set_column(3, "c", pa.array(["q"] * t.num_rows)), "column 'c' holds ['q'], not seen"),
        (lambda t: t.set_column(2, "b", pa.array([None] * t.num_rows, pa.float64())), "'b' has 4 missing"),
    ],
)
def test_bad_input_is_one_line_naming_it(tabular: Any, change: Any, words: str) -> None:
    run, table, _ = tabular
    with pytest.raises(InputError) as err:
        vatra.load(run).predict(change(table.slice(0, 4)))
    assert words in str(err.value) and "\n" not in str(err.value)


def test_unseen_categories_can_be_scored_as_unknown(tabular: Any) -> None:
    run, table, _ = tabular
    rows = table.slice(0, 4).set_column(3, "c", pa.array(["q"] * 4))
    out = vatra.load(run).predict(rows, unseen="zero")  # training encodes an unseen value as no category
    assert len(out) == 4 and out["proba_yes"].between(0, 1).all()


def test_streamed_predict_keeps_row_order_across_batches(tabular: Any, tmp_path: Path, capsys: Any) -> None:
    run, _, _ = tabular
    rows = _table(1000, seed=3)
    pcsv.write_csv(rows, tmp_path / "new.csv")
    args = ["--data", str(tmp_path / "new.csv"), "--out", str(tmp_path / "p.parquet"), "--keep", "id"]
    code, out, err = vatra_in_process(capsys, "predict", str(run), *args, "--batch-rows", "64")
    assert code == 0, err
    assert "1000 rows scored" in out
    got = pq.read_table(tmp_path / "p.parquet")
    assert got.column("id").to_pylist() == rows.column("id").to_pylist()
    whole = vatra.load(run).predict(rows)
    np.testing.assert_allclose(got.column("proba_yes").to_numpy(), whole["proba_yes"].to_numpy(), rtol=1e-6)


def test_the_progress_bar_leaves_the_output_alone(tabular: Any, tmp_path: Path) -> None:
    run, table, _ = tabular
    pq.write_table(table, tmp_path / "rows.parquet")
    predictor = vatra.load(run)
    shown = predict_file(
        predictor, tmp_path / "rows.parquet", tmp_path / "a.parquet", batch_rows=50, progress=True
    )
    quiet = predict_file(
        predictor, tmp_path / "rows.parquet", tmp_path / "b.parquet", batch_rows=50, progress=False
    )
    assert shown["rows"] == quiet["rows"] == N_ROWS
    assert pq.read_table(tmp_path / "a.parquet").equals(pq.read_table(tmp_path / "b.parquet"))


def test_a_delta_runs_lineage_names_the_table_and_its_pinned_version(tmp_path: Path) -> None:
    from deltalake import write_deltalake

    table = _table(200)
    write_deltalake(str(tmp_path / "lake"), table.slice(0, 100))
    write_deltalake(str(tmp_path / "lake"), table.slice(100), mode="append")  # version 1: the latest
    cfg = _config(tmp_path / "lake", tmp_path / "runs")
    cfg["data"]["name"] = "delta"
    cfg["train"]["steps"] = 3
    predictor = vatra.load(vatra.fit(cfg).run_dir)
    assert predictor.meta["data"] == {
        "name": "delta",
        "path": str(tmp_path / "lake"),
        "table": str(tmp_path / "lake"),
        "version": 1,
    }
    assert predictor.meta["checkpoint"]["step"] == 3 and predictor.meta["metrics"]["steps"] == 3


def test_predict_cli_refuses_bad_input_with_exit_2(tabular: Any, tmp_path: Path, capsys: Any) -> None:
    run, table, _ = tabular
    pq.write_table(table.drop_columns(["a"]), tmp_path / "bad.parquet")
    code, _, err = vatra_in_process(
        capsys,
        "predict",
        str(run),
        "--data",
        str(tmp_path / "bad.parquet"),
        "--out",
        str(tmp_path / "o.parquet"),
    )
    assert code == 2 and err.strip().splitlines() == [
        "error: predict: no column 'a'; the model takes a, b, c"
    ]
    assert not (tmp_path / "o.parquet").exists() and not (tmp_path / "o.parquet.part").exists()
    code, _, err = vatra_in_process(capsys, "predict", str(tmp_path), "--data", "x.csv", "--out", "o.parquet")
    assert code == 2 and "not a run folder" in err


def test_a_named_checkpoint_version_is_loaded(tabular: Any, tmp_path: Path) -> None:
    run, table, _ = tabular
    versions = sorted(p.stem for p in (run / "checkpoints" / "versions").iterdir())
    assert len(versions) == 1  # the run saved one version, at its end
    by_id = vatra.load(run, version=versions[-1]).predict(table.slice(0, 5))
    assert by_id.equals(vatra.load(run).predict(table.slice(0, 5)))
    with pytest.raises(ConfigError, match="no version or tag 'nope'"):
        vatra.load(run, version="nope")


def test_a_digits_run_predicts_rows_of_64_pixels(tmp_path: Path) -> None:
    result = vatra.fit(
        {
            "run": {"progress": "off", "tensorboard": False, "out_dir": str(tmp_path)},
            "data": {"name": "digits"},
            "model": {"name": "mlp", "hidden": [32]},
            "train": {"steps": 30, "batch_size": 32, "eval_every": 0},
            "optim": {"name": "adamw", "lr": 0.01},
            "monitor": {"report": False},
        }
    )
    pixels, labels = bundled_digits()  # raw pixel values 0..16, as a user has them
    _, val = stratified_split(labels, 0.2, 0)  # the run's own validation rows (data.val_fraction, seed)
    predictor = vatra.load(result.run_dir)
    out = predictor.predict(pixels[val].tolist())
    assert list(out.columns) == ["prediction", *(f"proba_{d}" for d in range(10))]
    accuracy = float((out["prediction"].to_numpy() == labels[val]).mean())
    assert accuracy == pytest.approx(result.summary["val_accuracy"], abs=1e-9)
    one = predictor.predict(pixels[val[0]])  # a single row as a flat array
    assert one["prediction"].tolist() == out["prediction"].tolist()[:1]
    with pytest.raises(InputError, match="must hold 64 values"):
        predictor.predict(np.zeros((2, 63)))
    for fmt, tol in (("torchscript", 1e-6), ("onnx", 1e-4)):  # the serving benchmark's model, exported
        exported = vatra.load(export_run(result.run_dir, tmp_path / fmt, fmt)).predict(pixels[val])
        assert exported["prediction"].tolist() == out["prediction"].tolist()
        np.testing.assert_allclose(exported["proba_3"], out["proba_3"], rtol=0, atol=tol)


def test_regression_values_come_back_in_the_targets_units(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(300, 2))
    target = 1000.0 + 50.0 * x[:, 0]  # far from zero: a scaled output would show
    pq.write_table(pa.table({"u": x[:, 0], "v": x[:, 1], "t": target}), tmp_path / "r.parquet")
    cfg = {
        "run": {"progress": "off", "tensorboard": False, "out_dir": str(tmp_path / "runs")},
        "data": {"name": "table", "path": str(tmp_path / "r.parquet"), "target": "t"},
        "model": {"name": "mlp", "hidden": [8]},
        "train": {"steps": 3, "batch_size": 16, "eval_every": 0},
        "monitor": {"report": False},
    }
    result = vatra.fit(cfg)
    predictor = vatra.load(result.run_dir)
    out = predictor.predict({"u": x[:4, 0], "v": x[:4, 1]})
    assert list(out.columns) == ["prediction"]
    assert predictor.model is not None
    with torch.no_grad():
        raw = predictor.model(
            torch.from_numpy(predictor.inputs(pa.table({"u": x[:4, 0], "v": x[:4, 1]}))["x"])
        )
    np.testing.assert_allclose(out["prediction"], raw[:, 0].numpy(), rtol=1e-6)


def test_an_npz_run_standardises_new_samples_as_training_did(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    x = rng.normal(40.0, 9.0, size=(400, 5))  # far from standardised: unscaled inputs would show
    y = (x[:, 0] + x[:, 1] > 80.0).astype(np.int64)
    np.savez(tmp_path / "d.npz", x=x[:300], y=y[:300], x_val=x[300:], y_val=y[300:])
    result = vatra.fit(
        {
            "run": {"progress": "off", "tensorboard": False, "out_dir": str(tmp_path / "runs")},
            "data": {"name": "npz", "path": str(tmp_path / "d.npz")},
            "model": {"name": "mlp", "hidden": [16]},
            "train": {"steps": 30, "batch_size": 32, "eval_every": 0},
            "optim": {"name": "adamw", "lr": 0.01},
            "monitor": {"report": False},
        }
    )
    out = vatra.load(result.run_dir).predict(x[300:])
    accuracy = float((out["prediction"].to_numpy() == y[300:]).mean())
    assert accuracy == pytest.approx(result.summary["val_accuracy"], abs=1e-9)
    assert accuracy > 0.8


def test_predict_reads_a_delta_table_folder(tabular: Any, tmp_path: Path, capsys: Any) -> None:
    from deltalake import write_deltalake

    run, _, _ = tabular
    rows = _table(300, seed=4)
    write_deltalake(str(tmp_path / "lake"), rows.slice(0, 200))
    write_deltalake(str(tmp_path / "lake"), rows.slice(200), mode="append")  # two files, two versions
    args = ["--data", str(tmp_path / "lake"), "--out", str(tmp_path / "p.parquet"), "--keep", "id"]
    code, out, err = vatra_in_process(capsys, "predict", str(run), *args, "--batch-rows", "128")
    assert "300 rows scored" in out
    assert code == 0, err
    got = pq.read_table(tmp_path / "p.parquet")
    assert got.column("id").to_pylist() == rows.column("id").to_pylist()  # files in the order added
    want = vatra.load(run).predict(rows)
    np.testing.assert_allclose(got.column("proba_yes").to_numpy(), want["proba_yes"].to_numpy(), rtol=1e-6)


@pytest.mark.parametrize("task", ["multilabel", "ranking"])
def test_multilabel_and_ranking_outputs(tmp_path: Path, task: str) -> None:
    rng = np.random.default_rng(5)
    x = rng.normal(size=(240, 3))
    cols = {"u": x[:, 0], "v": x[:, 1], "w": x[:, 2]}
    if task == "multilabel":
        cols |= {"p": (x[:, 0] > 0).astype(np.int64), "q": (x[:, 1] > 0).astype(np.int64)}
        data = {"target": ["p", "q"]}
    else:
        cols |= {"rel": np.clip(np.round(x[:, 0] + 1), 0, 3), "query": np.arange(240) // 8}
        data = {"target": "rel", "group": "query"}
    pq.write_table(pa.table(cols), tmp_path / "t.parquet")
    result = vatra.fit(
        {
            "run": {"progress": "off", "tensorboard": False, "out_dir": str(tmp_path / "runs")},
            "data": {
                "name": "table",
                "path": str(tmp_path / "t.parquet"),
                "features": ["u", "v", "w"],
                **data,
            },
            "model": {"name": "mlp", "hidden": [8]},
            "train": {"steps": 3, "batch_size": 8, "eval_every": 0},
            "monitor": {"report": False},
        }
    )
    predictor = vatra.load(result.run_dir)
    rows = pa.table(cols).slice(0, 8)
    out = predictor.predict(rows)
    assert predictor.model is not None
    with torch.no_grad():
        raw = predictor.model(torch.from_numpy(predictor.inputs(rows)["x"])).numpy()  # (8, K)
    if task == "multilabel":
        assert list(out.columns) == ["prediction_p", "prediction_q", "proba_p", "proba_q"]
        np.testing.assert_allclose(out["proba_q"], 1 / (1 + np.exp(-raw[:, 1])), rtol=1e-5)
        assert out["prediction_p"].tolist() == (raw[:, 0] > 0).astype(int).tolist()
    else:
        assert list(out.columns) == ["prediction"]  # one score per row: sort a list's rows by it
        np.testing.assert_allclose(out["prediction"], raw[:, 0], rtol=1e-6)


def test_a_bad_cell_deep_in_a_large_csv_is_one_line(tabular: Any, tmp_path: Path, capsys: Any) -> None:
    run, _, _ = tabular
    rows = _table(120_000, seed=6).select(["id", "a", "b", "c"])
    pcsv.write_csv(rows, tmp_path / "big.csv")
    with (tmp_path / "big.csv").open("a") as f:
        f.write("120000,oops,1.0,x\n")  # far past the first block the reader parses when it opens
    args = ["--data", str(tmp_path / "big.csv"), "--out", str(tmp_path / "p.parquet")]
    code, _, err = vatra_in_process(capsys, "predict", str(run), *args, "--batch-rows", "1000")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "CSV conversion error to double: invalid value 'oops'" in err
    assert not (tmp_path / "p.parquet").exists()
