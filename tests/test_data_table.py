"""``data.name = "table"``: CSV/Parquet in memory, every task, categories, splits, fitted preprocessing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import default_collate

from vatra.config import DataConfig
from vatra.data import DataContext, RankingDataset, TableDataset
from vatra.data.tabular import build_table
from vatra.errors import ConfigError


def _table(n: int = 60, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    return pa.table(
        {
            "a": rng.normal(3.0, 2.0, n),
            "b": rng.integers(0, 10, n),
            "color": rng.choice(["red", "green", "blue"], n),
            "label": rng.choice(["cat", "dog", "emu"], n),
            "score": rng.normal(size=n),
            "tag1": rng.integers(0, 2, n),
            "tag2": rng.integers(0, 2, n),
        }
    )


def _cfg(path: Path | str, **kw: Any) -> DataConfig:
    return DataConfig(name="table", path=str(path), **kw)


def _build(path: Path | str, ctx: DataContext | None = None, **kw: Any) -> tuple[Any, Any, Any]:
    return build_table(_cfg(path, **kw), ctx or DataContext(seed=0))


def _saved(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "data" / "preprocess.json").read_text())


# --- reading --------------------------------------------------------------------------------


def test_csv_parquet_folder_and_glob_give_the_same_datasets(tmp_path: Path) -> None:
    # Prepare: one table as CSV, as Parquet, and split into two Parquet files in a folder
    t = _table()
    pcsv.write_csv(t, tmp_path / "t.csv")
    pq.write_table(t, tmp_path / "t.parquet")
    (tmp_path / "parts").mkdir()
    pq.write_table(t.slice(0, 25), tmp_path / "parts" / "p0.parquet")
    pq.write_table(t.slice(25), tmp_path / "parts" / "p1.parquet")
    (tmp_path / "parts" / "_SUCCESS").write_text("")  # non-table files in a folder are ignored
    kw = {"target": "label", "features": ["a", "b", "color"], "categorical": ["color"]}

    # Execute
    built = [
        _build(p, **kw)
        for p in (
            tmp_path / "t.csv",
            tmp_path / "t.parquet",
            tmp_path / "parts",
            tmp_path / "parts" / "*.parquet",
        )
    ]

    # Assert: same spec, same tensors, same split (row order is file order, files sorted by name)
    ref_train, ref_val, ref_spec = built[0]
    for train, val, spec in built[1:]:
        assert spec == ref_spec
        for ds, ref in ((train, ref_train), (val, ref_val)):
            assert ds.fields.keys() == ref.fields.keys()
            for k in ds.fields:
                torch.testing.assert_close(ds.fields[k], ref.fields[k], rtol=0, atol=0)


def test_classification_with_string_labels(tmp_path: Path) -> None:
    # Prepare
    t = _table()
    pq.write_table(t, tmp_path / "t.parquet")

    # Execute
    train, val, spec = _build(tmp_path / "t.parquet", target="label", features=["a", "b"])

    # Assert: classes are the sorted names, ids 0..C-1, labels for label-aware sharding
    assert isinstance(train, TableDataset)
    assert spec.kind == "classification" and spec.num_classes == 3
    assert spec.input_shape == (2,) and spec.feature_names == ("a", "b")
    assert len(train) + len(val) == t.num_rows and len(val) == 12  # val_fraction 0.2
    x, y = train.get_batch(np.arange(len(train)))
    assert x.dtype == torch.float32 and x.shape == (len(train), 2)
    assert y.dtype == torch.int64 and set(y.tolist()) == {0, 1, 2}
    np.testing.assert_array_equal(train.labels, y.numpy())
    names = ["cat", "dog", "emu"]
    raw = {tuple(r.values()) for r in t.select(["label"]).to_pylist()}
    assert {(names[i],) for i in y.tolist()} <= raw


def test_integer_classes_map_to_their_sorted_values(tmp_path: Path) -> None:
    # Prepare: class values 3, 7, 10 (not 0..C-1); 10 appears only in validation rows
    y = [7, 3, 7, 3, 10, 3]
    split = ["train", "train", "train", "train", "val", "val"]
    pq.write_table(pa.table({"a": np.arange(6.0), "y": y, "split": split}), tmp_path / "t.parquet")
    run_dir = tmp_path / "run"

    # Execute
    train, val, spec = _build(
        tmp_path / "t.parquet", DataContext(run_dir=run_dir), target="y", split_column="split"
    )

    # Assert: classes from the whole column; saved with the fitted preprocessing
    assert spec.num_classes == 3 and _saved(run_dir)["classes"] == {"y": [3, 7, 10]}
    assert train.labels.tolist() == [1, 0, 1, 0] and val.labels.tolist() == [2, 0]


def test_regression_one_and_several_outputs(tmp_path: Path) -> None:
    # Prepare
    pq.write_table(_table(), tmp_path / "t.parquet")

    # Execute
    one = _build(tmp_path / "t.parquet", target="score", features=["a", "b"])
    two = _build(tmp_path / "t.parquet", target=["score", "a"], features=["b"])

    # Assert
    train, _, spec = one
    assert spec.kind == "regression" and spec.num_classes == 1
    assert train[0][1].shape == () and train[0][1].dtype == torch.float32 and train.labels is None
    train, _, spec = two
    assert spec.kind == "regression" and spec.num_classes == 2
    assert train.get_batch(np.arange(4))[1].shape == (4, 2)


def test_multilabel_from_several_binary_columns(tmp_path: Path) -> None:
    # Prepare
    pq.write_table(_table(), tmp_path / "t.parquet")

    # Execute
    train, _, spec = _build(tmp_path / "t.parquet", target=["tag1", "tag2"], features=["a", "b"])

    # Assert
    assert spec.kind == "multilabel" and spec.num_classes == 2
    _, y = train.get_batch(np.arange(5))
    assert y.shape == (5, 2) and y.dtype == torch.float32 and set(y.unique().tolist()) <= {0.0, 1.0}


def test_multitask_targets_are_a_dict_per_column(tmp_path: Path) -> None:
    # Prepare: two heads and one extra column a penalty may read
    pq.write_table(_table(), tmp_path / "t.parquet")
    ctx = DataContext(task="multitask", head_tasks={"label": "classification", "score": "regression"})

    # Execute
    train, _, spec = _build(
        tmp_path / "t.parquet", ctx, target=["label", "score", "tag1"], features=["a", "b"]
    )

    # Assert
    assert spec.kind == "multitask" and set(spec.heads) == {"label", "score"}
    assert spec.heads["label"].kind == "classification" and spec.heads["label"].size == 3
    assert spec.heads["score"].kind == "regression" and spec.heads["score"].size == 1
    _, target = train.get_batch(np.arange(6))
    assert set(target) == {"label", "score", "tag1"}
    assert target["label"].dtype == torch.int64 and target["label"].shape == (6,)
    assert target["score"].dtype == torch.float32 and target["tag1"].dtype == torch.float32


def test_ranking_lists_are_padded_with_minus_one(tmp_path: Path) -> None:
    # Prepare: lists of 1 to 5 rows under query ids
    rng = np.random.default_rng(1)
    sizes = [3, 1, 5, 2, 4, 3, 2, 5, 1, 4]
    q = np.repeat(np.arange(len(sizes)) * 7, sizes)
    n = len(q)
    t = pa.table({"q": q, "f1": rng.normal(size=n), "f2": rng.normal(size=n), "rel": rng.integers(0, 4, n)})
    pq.write_table(t, tmp_path / "t.parquet")

    # Execute
    train, val, spec = _build(tmp_path / "t.parquet", target="rel", group="q", val_fraction=0.2)
    inputs, target = train.get_batch(np.arange(len(train)))

    # Assert
    assert isinstance(train, RankingDataset)
    assert spec.kind == "ranking" and spec.num_classes == 1 and spec.input_shape == (2,)
    assert len(train) == 8 and len(val) == 2
    lengths = [len(train[i][1]) for i in range(len(train))]
    assert inputs.shape == (8, max(lengths), 2) and target.shape == (8, max(lengths))
    for i, length in enumerate(lengths):
        x_i, y_i = train[i]
        torch.testing.assert_close(inputs[i, :length], x_i)
        torch.testing.assert_close(target[i, :length], y_i)
        assert (target[i, length:] == -1).all() and (inputs[i, length:] == 0).all()
    assert (target[target >= 0] == target[target >= 0].round()).all()


def test_onehot_categories_unseen_values_are_all_zeros(tmp_path: Path) -> None:
    # Prepare: 'violet' appears only in validation rows
    t = pa.table(
        {
            "a": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
            "color": ["red", "blue", "red", "blue", "violet", "red"],
            "y": [0.0, 1.0, 0.0, 1.0, 0.5, 0.2],
            "split": ["train", "train", "train", "train", "val", "val"],
        }
    )
    pq.write_table(t, tmp_path / "t.parquet")

    # Execute
    train, val, spec = _build(tmp_path / "t.parquet", target="y", categorical=["color"], split_column="split")

    # Assert
    assert spec.feature_names == ("a", "color=blue", "color=red") and spec.input_shape == (3,)
    assert spec.categorical == {}
    x_tr, _ = train.get_batch(np.arange(4))
    np.testing.assert_array_equal(x_tr[:, 1:].numpy(), [[0, 1], [1, 0], [0, 1], [1, 0]])
    x_va, _ = val.get_batch(np.arange(2))
    np.testing.assert_array_equal(x_va[:, 1:].numpy(), [[0, 0], [0, 1]])


def test_embedding_categories_give_ids_with_zero_for_unseen(tmp_path: Path) -> None:
    # Prepare
    t = pa.table(
        {
            "a": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
            "shape": [3, 1, 3, 1, 9, 3],  # integers read as categories
            "color": ["red", "blue", "red", "green", "violet", "red"],
            "y": ["p", "q", "p", "q", "p", "q"],
            "split": ["train", "train", "train", "train", "val", "val"],
        }
    )
    pq.write_table(t, tmp_path / "t.parquet")

    # Execute
    train, val, spec = _build(
        tmp_path / "t.parquet",
        target="y",
        categorical=["color", "shape"],
        categorical_encoding="embedding",
        split_column="split",
    )

    # Assert: ids 1..K by sorted training value, in column order; inputs are a dict
    assert spec.categorical == {"shape": 3, "color": 4} and list(spec.categorical) == ["shape", "color"]
    assert spec.input_shape == (1,) and spec.feature_names == ("a",)
    inputs, _ = train.get_batch(np.arange(4))
    assert set(inputs) == {"x", "ids"} and inputs["ids"].dtype == torch.int64
    np.testing.assert_array_equal(inputs["ids"].numpy(), [[2, 3], [1, 1], [2, 3], [1, 2]])
    inputs, _ = val.get_batch(np.arange(2))
    np.testing.assert_array_equal(inputs["ids"].numpy(), [[0, 0], [2, 3]])


def test_split_column_and_val_fraction(tmp_path: Path) -> None:
    # Prepare
    t = _table(50).append_column("split", pa.array(["val" if i % 5 == 0 else "train" for i in range(50)]))
    pq.write_table(t, tmp_path / "t.parquet")

    # Execute
    by_column = _build(tmp_path / "t.parquet", target="label", features=["a"], split_column="split")
    seeded = [
        _build(tmp_path / "t.parquet", DataContext(seed=s), target="label", features=["a"]) for s in (0, 0, 1)
    ]

    # Assert
    assert (len(by_column[0]), len(by_column[1])) == (40, 10)
    sizes = [(len(tr), len(va)) for tr, va, _ in seeded]
    assert sizes == [(40, 10)] * 3
    same = torch.equal(seeded[0][1].fields["x"], seeded[1][1].fields["x"])
    other = torch.equal(seeded[0][1].fields["x"], seeded[2][1].fields["x"])
    assert same and not other


def test_get_batch_equals_item_collation(tmp_path: Path) -> None:
    # Prepare
    pq.write_table(_table(), tmp_path / "t.parquet")
    idx = np.array([5, 0, 17, 3, 3])
    built = [
        _build(tmp_path / "t.parquet", target="label", categorical=["color"], categorical_encoding=enc)
        for enc in ("onehot", "embedding")
    ]
    ctx = DataContext(task="multitask", head_tasks={"label": "classification"})
    built.append(_build(tmp_path / "t.parquet", ctx, target=["label", "score"], features=["a", "b"]))

    for train, _, _ in built:
        # Execute
        batch = train.get_batch(idx)
        collated = default_collate([train[int(i)] for i in idx])

        # Assert
        torch.testing.assert_close(batch, collated, rtol=0, atol=0)


# --- fitted preprocessing -------------------------------------------------------------------


def test_standardisation_statistics_come_from_training_rows_only(tmp_path: Path) -> None:
    # Prepare: validation rows far from the training rows, so a leak would move mean and std
    rng = np.random.default_rng(2)
    a = np.concatenate([rng.normal(0.0, 1.0, 40), rng.normal(1000.0, 50.0, 10)])
    split = ["train"] * 40 + ["val"] * 10
    pq.write_table(pa.table({"a": a, "y": rng.normal(size=50), "split": split}), tmp_path / "t.parquet")
    run_dir = tmp_path / "run"

    # Execute
    train, val, _ = _build(
        tmp_path / "t.parquet", DataContext(run_dir=run_dir), target="y", split_column="split"
    )
    saved = _saved(run_dir)

    # Assert: float64 statistics of the train rows (population std), not of all rows
    a32 = a.astype(np.float32).astype(np.float64)
    np.testing.assert_allclose(saved["mean"], [a32[:40].mean()], rtol=1e-12)
    np.testing.assert_allclose(saved["std"], [a32[:40].std()], rtol=1e-12)
    assert abs(saved["mean"][0] - a32.mean()) > 100 and abs(saved["std"][0] - a32.std()) > 100
    x_tr = train.fields["x"][:, 0].double()
    assert abs(float(x_tr.mean())) < 1e-6 and abs(float(x_tr.std(unbiased=False)) - 1) < 1e-5
    assert float(val.fields["x"].mean()) > 500  # val scaled with the train statistics


def test_saved_preprocessing_is_reused_on_a_second_build(tmp_path: Path) -> None:
    # Prepare: build once, then change the data (same columns) and build again in the same run folder
    run_dir = tmp_path / "run"
    ctx = DataContext(run_dir=run_dir)
    kw = {"target": "label", "features": ["a", "b", "color"], "categorical": ["color"]}
    pq.write_table(_table(seed=0), tmp_path / "t.parquet")
    first = _build(tmp_path / "t.parquet", ctx, **kw)
    before = _saved(run_dir)
    changed = _table(seed=0).set_column(0, "a", pa.array(np.full(60, 100.0)))
    pq.write_table(changed, tmp_path / "t.parquet")

    # Execute
    train, _, spec = _build(tmp_path / "t.parquet", ctx, **kw)

    # Assert: the old statistics scale the new values; the file is unchanged
    assert _saved(run_dir) == before and spec == first[2]
    expected = (100.0 - before["mean"][0]) / before["std"][0]
    torch.testing.assert_close(
        train.fields["x"][:, 0], torch.full((len(train),), expected), rtol=1e-5, atol=1e-4
    )
    with pytest.raises(ConfigError, match="was fitted for features"):
        _build(tmp_path / "t.parquet", ctx, target="label", features=["a"])


def test_only_rank_zero_writes_the_preprocessing(tmp_path: Path) -> None:
    # Prepare
    pq.write_table(_table(), tmp_path / "t.parquet")

    # Execute
    _build(
        tmp_path / "t.parquet",
        DataContext(rank=1, world_size=2, run_dir=tmp_path / "run"),
        target="label",
        features=["a", "b"],
    )

    # Assert
    assert not (tmp_path / "run" / "data" / "preprocess.json").exists()


def test_missing_values_dropped_or_filled_with_the_training_mean(tmp_path: Path) -> None:
    # Prepare
    t = pa.table(
        {
            "a": [1.0, None, 3.0, 5.0, float("nan"), 7.0],
            "y": [0.0, 1.0, 2.0, None, 4.0, 5.0],
            "split": ["train", "train", "train", "train", "train", "val"],
        }
    )
    pq.write_table(t, tmp_path / "t.parquet")
    kw = {"target": "y", "split_column": "split", "standardize": False}

    # Execute
    dropped = _build(tmp_path / "t.parquet", nan="drop", **kw)
    with pytest.raises(ConfigError, match="missing target") as err:
        _build(tmp_path / "t.parquet", nan="mean", **kw)
    t2 = t.set_column(1, "y", pa.array([0.0, 1.0, 2.0, 3.0, 4.0, 5.0]))
    pq.write_table(t2, tmp_path / "t.parquet")
    filled = _build(tmp_path / "t.parquet", nan="mean", **kw)

    # Assert
    assert "'y' (1 of 6 rows)" in str(err.value)
    assert dropped[0].fields["x"][:, 0].tolist() == [1.0, 3.0]
    assert filled[0].fields["x"][:, 0].tolist() == [1.0, 3.0, 3.0, 5.0, 3.0]  # train mean of 1, 3, 5


@pytest.mark.parametrize(
    ("path", "kw", "match"),
    [
        ("", {}, "data.path: set it"),
        ("missing.parquet", {}, "does not exist"),
        ("*.feather", {}, "matches no file"),
        ("t.json", {}, "neither CSV"),
        (
            "t.parquet",
            {"target": "nope"},
            "data.target: no column 'nope'; the table has columns: a, b, color",
        ),
        ("t.parquet", {"target": "label", "features": ["a", "zz"]}, "data.features: no column 'zz'"),
        (
            "t.parquet",
            {"target": "label"},
            "column 'color' is string, not numeric; add it to data.categorical",
        ),
        ("t.parquet", {"target": "label", "features": ["a"], "split_column": "b"}, "found \\['0', '1'"),
        ("t.parquet", {"target": "label", "group": "gone"}, "data.group: no column 'gone'"),
        (
            "nan.parquet",
            {"target": "y"},
            "data.nan: missing values in 'a' \\(2 of 4 rows\\), 'c' \\(1 of 4 rows\\);",
        ),
    ],
)
def test_bad_inputs_are_one_line_config_errors(
    tmp_path: Path, path: str, kw: dict[str, Any], match: str
) -> None:
    # Prepare
    pq.write_table(_table(), tmp_path / "t.parquet")
    (tmp_path / "t.json").write_text("{}")
    nan = {"a": [1.0, None, float("nan"), 2.0], "c": [None, 1, 2, 3], "y": [1.0, 2.0, 3.0, 4.0]}
    pq.write_table(pa.table(nan), tmp_path / "nan.parquet")

    # Execute
    with pytest.raises(ConfigError, match=match) as err:
        _build(str(tmp_path / path) if path else "", **kw)

    # Assert
    assert "\n" not in str(err.value)
