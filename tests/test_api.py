"""The public API: ``vatra.fit`` in one plain process, ``vatra run`` on several, the batch contract."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tests._dist import ROOT, run_vatra
from tests.conftest import vatra_in_process
from torch import Tensor, nn
from torch.utils.data import Dataset, IterableDataset

import vatra
from vatra.errors import ConfigError

QUIET = {
    "run": {"progress": "off", "tensorboard": False},
    "monitor": {"enabled": False, "report": False},
    "checkpoint": {"enabled": False},
}


class Pairs(Dataset):
    """y = x·w + noise with dict inputs: ({"a": (3,), "b": (2,)}, () float)."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.a, self.b = torch.randn(n, 3, generator=g), torch.randn(n, 2, generator=g)
        self.y = self.a @ torch.tensor([1.0, -2.0, 0.5]) + self.b @ torch.tensor([0.3, 0.7])

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[dict[str, Tensor], Tensor]:
        return {"a": self.a[i], "b": self.b[i]}, self.y[i]


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 1)

    def forward(self, a: Tensor, b: Tensor) -> Tensor:  # a dict of inputs arrives as keyword arguments
        return self.lin(torch.cat([a, b], dim=1)).squeeze(1)


def _config(**train: object) -> dict:
    return {
        **QUIET,
        "train": {"steps": 150, "batch_size": 32, "eval_every": 0, **train},
        "optim": {"lr": 0.05},
    }


def test_fit_trains_a_users_model_and_data_in_one_plain_process(tmp_path: Path) -> None:
    # Prepare
    calls: list[int] = []

    def loss(output: Tensor, target: Tensor) -> Tensor:
        calls.append(len(target))
        return ((output - target) ** 2).mean()

    # Execute
    result = vatra.fit(
        _config(task="regression"),
        model=TwoInputs(),
        train=Pairs(512, seed=0),
        val=Pairs(128, seed=1),
        loss=loss,
        run_dir=tmp_path / "run",
    )

    # Assert: no process group was ever made; the user's loss trained the user's model
    assert not torch.distributed.is_initialized()
    s = result.summary
    assert s["world_size"] == 1 and s["steps"] == 150 and s["task"] == "regression"
    assert s["val_r2"] > 0.99 and s["val_rmse"] < 0.1
    assert calls[0] == 32  # batches of the configured size reached the user's loss
    assert isinstance(result.model, TwoInputs)
    written = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert written["val_mae"] == pytest.approx(s["val_mae"])
    assert (tmp_path / "run" / "metrics.jsonl").exists()


def test_fit_with_an_iterable_dataset_and_a_dict_config(tmp_path: Path) -> None:
    class Stream(IterableDataset):
        def __iter__(self):  # type: ignore[no-untyped-def]
            g = torch.Generator().manual_seed(0)
            for _ in range(200):
                x = torch.randn(4, generator=g)
                yield x, (x.sum() > 0).long()

    stream = Stream()
    stream.num_classes = 2  # type: ignore[attr-defined]
    result = vatra.fit(
        {**_config(), "model": {"name": "mlp", "hidden": [16]}},
        train=stream,
        val=None,
        run_dir=tmp_path / "run",
    )
    assert result.summary["steps"] == 150 and result.summary["task"] == "classification"


def test_fit_refuses_val_without_train(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="val= was given without train="):
        vatra.fit(_config(), val=Pairs(8, 0), run_dir=tmp_path / "run")


def test_run_name_names_the_folder_vatra_run_made_and_a_restart_finds_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare: what `vatra run train.py` (no --run-dir) hands each rank: a folder named after the
    # script, created before the script's config was read
    from vatra.api import RUN_DIR_ENV, RUN_STEM_ENV

    launched = tmp_path / "runs" / "train-20261206-101500-42"
    launched.mkdir(parents=True)
    monkeypatch.setenv(RUN_DIR_ENV, str(launched))
    monkeypatch.setenv(RUN_STEM_ENV, "train")
    cfg = {
        **_config(steps=10),
        "run": {**QUIET["run"], "name": "diabetes", "out_dir": str(tmp_path / "runs")},
    }

    # Execute: the script's vatra.fit, then the same after a restart of the group
    first = vatra.fit(cfg)
    said = capsys.readouterr().out
    again = vatra.fit(cfg)

    # Assert: the run's folder is named as run.name says, found again through the launcher's link
    named = tmp_path / "runs" / "diabetes-20261206-101500-42"
    assert first.run_dir == named and (named / "summary.json").is_file()
    assert launched.is_symlink() and launched.resolve() == named.resolve()
    assert f"vatra: run folder {named} (run.name)" in said
    assert again.run_dir == named.resolve()


@pytest.mark.slow(43)
def test_vatra_run_launches_a_users_script_on_two_processes(tmp_path: Path) -> None:
    # Execute: the example script, 2 gloo ranks, its own arguments after --; no --run-dir: the
    # folder is named as the script's config says (run.name = "energy"), under ./runs
    out = run_vatra(
        "run",
        str(ROOT / "examples" / "custom_script.py"),
        "--nproc",
        "2",
        "--",
        "--steps",
        "40",
        timeout=300,
        cwd=tmp_path,
    )

    # Assert
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()  # the launcher's link to it is gone
    assert run.name.startswith("energy-") and not run.is_symlink(), run
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 40 and summary["task"] == "regression"
    assert "val MAE" in out.stdout and out.stdout.count("val MAE") == 1  # rank 0 prints it
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 40


def test_vatra_run_usage_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = vatra_in_process(capsys, "run", str(tmp_path / "missing.py"), "--nproc", "2")
    assert code == 2
    assert err.strip().splitlines() == [
        f"error: script not found: {tmp_path / 'missing.py'} "
        "(pass a Python file, e.g. examples/custom_script.py)"
    ]
