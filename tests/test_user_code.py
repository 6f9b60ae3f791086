"""A user's own model module and Parquet table through ``vatra train``; bad user input, one line each."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tests._dist import rewind, run_vatra, train_ranks
from tests.conftest import vatra_in_process

from vatra.cli import main
from vatra.rundir import read_jsonl

MODEL_PY = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, features, classes, hidden):
        super().__init__()
        layers = [nn.Linear(features, hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(hidden, classes)]
        self.body = nn.Sequential(*layers)

    def forward(self, x):
        return self.body(x)


def build(spec, hidden=16):
    return Net(spec.input_shape[0], spec.num_classes, hidden)


HIDDEN = 64


def make_list(spec, hidden=0):
    return [1, 2]


def data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g)
    return torch.utils.data.TensorDataset(x, x.sum(1)), None


def not_a_pair():
    return 5
"""

TOML = """
[run]
name = "user"
progress = "plain"
tensorboard = false

[data]
name = "table"
path = "sites.parquet"
target = "kind"
categorical = ["site"]
sharding = "stratified"

[model]
name = "usermodel:build"
kwargs = { hidden = 24 }

[train]
steps = 30
batch_size = 16
eval_every = 10

[optim]
name = "adamw"
lr = 0.01

[checkpoint]
every_steps = 10

[monitor]
report = false
"""


def _project(folder: Path) -> Path:
    """A user's folder: model module, a Parquet table (3 classes, a site category), a config."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "usermodel.py").write_text(MODEL_PY)
    rng = np.random.default_rng(0)
    n = 600
    x = rng.normal(size=(n, 4))
    kind = np.array(["alpha", "beta", "gamma"])[np.argmax(x[:, :3], axis=1)]
    table = pa.table(
        {**{f"m{i}": x[:, i] for i in range(4)}, "site": rng.choice(["n", "s"], n), "kind": kind}
    )
    pq.write_table(table, folder / "sites.parquet", row_group_size=100)
    (folder / "user.toml").write_text(TOML)
    return folder / "user.toml"


def test_user_model_and_parquet_table_on_two_ranks_resume_exactly(tmp_path: Path) -> None:
    # Prepare: the user's folder is not the working directory; the module beside the config imports.
    # A 2-rank run, and a copy of it rewound to its step-10 checkpoint (as if it died after step 15)
    config = _project(tmp_path / "project")
    a = train_ranks(tmp_path / "ref", config=config)
    done = rewind(tmp_path / "ref", tmp_path / "hit", step=10)

    # Execute: the resumed copy
    b = train_ranks(tmp_path / "hit", config=config)

    # Assert: the resumed run ends the same as the uninterrupted one
    assert a["final_loss"] == b["final_loss"]  # same weights, batches and dropout: bit for bit
    assert a["val_accuracy"] == b["val_accuracy"] and a["val_macro_f1"] == b["val_macro_f1"]
    assert a["task"] == "classification" and a["val_accuracy"] > 0.6
    resumed = [m["step"] for m in read_jsonl(tmp_path / "hit" / "metrics.jsonl")[done:]]
    assert resumed == list(range(11, 31))
    # the standardisation was fitted once (training rows only) and reused by the restarted group
    pre = json.loads((tmp_path / "hit" / "data" / "preprocess.json").read_text())
    assert pre["features"] == ["m0", "m1", "m2", "m3"] and pre["vocab"]["site"] == ["n", "s"]


def _one_error_line(out: subprocess.CompletedProcess[str]) -> str:
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("model.name=nosuchmodule:build", "model.name: cannot import module 'nosuchmodule'"),
        ("model.name=usermodel:bulid", "'usermodel' has no attribute 'bulid'; it defines: "),
        ("model.name=usermodel:HIDDEN", "model.name: 'usermodel:HIDDEN' is the int 64, not a callable"),
        ("model.name=usermodel", "model.name: unknown model 'usermodel'; choose one of: cnn, gpt, mlp"),
        ("train.loss=usermodel:HIDDEN", "train.loss: 'usermodel:HIDDEN' is the int 64"),
        ("data.target=colour", "data.target: no column 'colour'; the table has columns: m0, m1"),
        ("data.categorical=[]", "'site'"),
        ("data.features=['m0','nope']", "data.features: no column 'nope'"),
    ],
)
def test_bad_user_input_fails_before_any_worker_starts(
    tmp_path: Path, override: str, expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # In process: `vatra train` checks import strings and the table's columns before it launches.
    config = _project(tmp_path / "project")
    with pytest.raises(SystemExit) as exit_:
        main(["train", str(config), "--nproc", "2", "--set", override, "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ") and expected in err, err
    assert not (tmp_path / "r").exists()  # nothing was started or written


@pytest.mark.parametrize(
    ("override", "nproc", "expected"),
    [
        (
            "data.name=usermodel:not_a_pair",
            "2",
            "data.name: 'usermodel:not_a_pair' returned the int 5; expected",
        ),
        (
            "model.name=usermodel:make_list",
            "1",
            "'usermodel:make_list' returned a list; expected a torch.nn.Module",
        ),
    ],
)
@pytest.mark.slow(17)
def test_bad_user_code_found_in_the_workers_is_still_one_line(
    tmp_path: Path, override: str, nproc: str, expected: str
) -> None:
    config = _project(tmp_path / "project")
    out = run_vatra(
        "train", str(config), "--nproc", nproc, "--set", override, "--run-dir", str(tmp_path / "r")
    )
    assert expected in _one_error_line(out)


@pytest.mark.slow(15)
def test_bad_data_is_one_line_and_exit_2(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    # NaN values name the column and their count (found in the worker, which reads the rows)
    config = _project(tmp_path / "project")
    table = pq.read_table(tmp_path / "project" / "sites.parquet").to_pydict()
    table["m1"][3] = None
    table["m1"][9] = float("nan")
    pq.write_table(pa.table(table), tmp_path / "project" / "sites.parquet")
    # the launcher in this process (capfd: the worker's stderr too, which must add no line)
    code, _, err = vatra_in_process(capfd, "train", str(config), "--run-dir", str(tmp_path / "b"))
    nan = _one_error_line(subprocess.CompletedProcess([], code, "", err))
    assert "m1" in nan and "2" in nan and "data.nan" in nan
    dropped = run_vatra(
        "train",
        str(config),
        "--set",
        "data.nan=drop",
        "--set",
        "train.steps=3",
        "--run-dir",
        str(tmp_path / "c"),
    )
    assert dropped.returncode == 0, dropped.stderr[-2000:]
