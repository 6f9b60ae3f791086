"""``vatra.fit`` with what users hold (DataFrames, arrays) and one clear error for inputs or a loss
that do not fit the model, before the first step."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import Tensor, nn

import vatra
from vatra.errors import ConfigError

pd = pytest.importorskip("pandas")
pytest.importorskip("pyarrow")

QUIET = {
    "run": {"progress": "off", "tensorboard": False},
    "monitor": {"enabled": False, "report": False},
    "checkpoint": {"enabled": False},
}


def _config(target: str = "", **train: object) -> dict:
    return {
        **QUIET,
        "data": {"target": target},
        "model": {"name": "mlp", "hidden": [16]},
        "train": {"steps": 120, "batch_size": 32, "eval_every": 0, **train},
        "optim": {"lr": 0.05},
    }


def _frame(n: int, seed: int) -> pd.DataFrame:
    """y = 2a − b + 0.5·[city = 'x'] + noise; a text column to one-hot, an int column."""
    rng = np.random.default_rng(seed)
    a, b = rng.normal(size=n), rng.integers(0, 5, size=n)
    city = rng.choice(["x", "y"], size=n)
    y = 2 * a - b + 0.5 * (city == "x") + 0.05 * rng.normal(size=n)
    return pd.DataFrame({"a": a, "b": b, "city": city, "y": y})


def test_fit_takes_dataframes_through_the_table_preprocessing(tmp_path: Path) -> None:
    # Prepare
    cfg = _config("y")
    cfg["data"]["categorical"] = ["city"]

    # Execute
    result = vatra.fit(cfg, train=_frame(400, 0), val=_frame(100, 1), run_dir=tmp_path / "run")

    # Assert: a regression on 2 numeric + 2 one-hot features; val= rows are the evaluation rows
    s = result.summary
    assert s["task"] == "regression" and s["steps"] == 120
    assert s["val_r2"] > 0.9
    saved = json.loads((tmp_path / "run" / "data" / "preprocess.json").read_text())
    assert saved["feature_names"] == ["a", "b", "city=x", "city=y"]


def test_fit_takes_a_dataframe_without_val_and_trains_on_every_row(tmp_path: Path) -> None:
    result = vatra.fit(_config("y"), train=_frame(64, 0).drop(columns="city"), run_dir=tmp_path / "run")
    assert result.summary["steps"] == 120 and "val_r2" not in result.summary


def test_fit_reads_the_val_rows_of_one_dataframe_from_data_split_column(tmp_path: Path) -> None:
    frame = _frame(100, 0).drop(columns="city")
    frame["part"] = ["val" if i % 4 == 0 else "train" for i in range(100)]
    cfg = _config("y")
    cfg["data"]["split_column"] = "part"
    result = vatra.fit(cfg, train=frame, run_dir=tmp_path / "run")
    saved = json.loads((tmp_path / "run" / "data" / "preprocess.json").read_text())
    assert "val_r2" in result.summary and saved["feature_names"] == ["a", "b"]


def test_fit_takes_numpy_arrays(tmp_path: Path) -> None:
    # Prepare: two classes split by the sign of x0 + x1; val as tensors
    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 4)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int64)

    # Execute
    result = vatra.fit(
        _config(),
        train=(x[:240], y[:240]),
        val=(torch.from_numpy(x[240:]), torch.from_numpy(y[240:])),
        run_dir=tmp_path / "r",
    )

    # Assert
    assert result.summary["task"] == "classification"
    assert result.summary["val_accuracy"] > 0.85


@pytest.mark.parametrize(
    ("train", "val", "message"),
    [
        ("frame", None, "data.target: name the target column(s); the table has columns: a, b, city, y"),
        ("frame", "pair", "vatra.fit: val= is a tuple but the other is pandas DataFrames"),
        (
            "frame",
            "other_columns",
            "vatra.fit: val= has columns ['a', 'y'] but train= has ['a', 'b', 'city', 'y']",
        ),
        ("array", None, "vatra.fit: train= is one array; pass (train_X, train_y)"),
        ("short_pair", None, "vatra.fit: train= X has 10 rows but y has 9"),
        ("text", None, "vatra.fit: train= is the str 'data.csv'; pass a torch Dataset"),
    ],
)
def test_fit_refuses_what_it_cannot_read_in_one_line(
    tmp_path: Path, train: str, val: str | None, message: str
) -> None:
    x, y = np.zeros((10, 2), np.float32), np.zeros(10, np.float32)
    given = {
        "frame": _frame(20, 0),
        "pair": (x, y),
        "other_columns": _frame(20, 1)[["a", "y"]],
        "array": x,
        "short_pair": (x, y[:9]),
        "text": "data.csv",
    }
    with pytest.raises(ConfigError) as err:
        vatra.fit(_config(), train=given[train], val=given.get(val or ""), run_dir=tmp_path / "r")
    assert message in str(err.value) and "\n" not in str(err.value)


class Named(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 1)

    def forward(self, features: Tensor) -> Tensor:
        return self.lin(features)  # (B, 1)


class Dicts(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> tuple[dict[str, Tensor], Tensor]:
        return {"x": torch.full((3,), float(i))}, torch.tensor(float(i))


def test_fit_refuses_dict_keys_that_are_not_forwards_parameters(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        vatra.fit(_config(task="regression"), model=Named(), train=Dicts(), run_dir=tmp_path / "r")
    assert str(err.value) == (
        "model: the inputs are a dict with keys ['x'], passed as keyword arguments, but Named.forward "
        "takes (features); name the dict's keys after forward's parameters"
    )


def test_fit_refuses_a_user_loss_whose_shapes_would_broadcast(tmp_path: Path) -> None:
    # Prepare: the model returns (B, 1), the targets are (B,)
    class Plain(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
            return torch.full((3,), float(i)), torch.tensor(float(i))

    def mse(output: Tensor, target: Tensor) -> Tensor:
        return ((output - target) ** 2).mean()

    # Execute / Assert
    with pytest.raises(ConfigError) as err:
        vatra.fit(
            _config(task="regression"), model=nn.Linear(3, 1), train=Plain(), loss=mse, run_dir=tmp_path / "r"
        )
    assert str(err.value) == (
        "loss: the model's output has shape (32, 1) and the target (32,); an elementwise loss would "
        "broadcast them to (32, 32); make the model return the target's shape (e.g. output.squeeze(-1)) "
        "or reshape one of them in the loss"
    )
