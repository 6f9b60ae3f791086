"""Meta-learning episodes (no class leaks), its config and command line, and the meta-step in the
engine (checkpointed Meta-SGD LRs, adaptation of the learned initialisation)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tests.conftest import vatra_in_process

from vatra.config import config_from_dict
from vatra.engine import Trainer
from vatra.errors import ConfigError
from vatra.meta import ClassTasks, ColumnTasks, MetaLearner
from vatra.meta.adapt import accuracy_curve, load_init


def meta_config(**meta: Any) -> Any:
    """A small digits run of 3 meta-steps: 3-way 2-shot episodes, 4 tasks a step."""
    return config_from_dict(
        {
            "run": {"seed": 0, "progress": "off"},
            "data": {"name": "digits"},
            "model": {"name": "mlp", "hidden": [16]},
            "train": {"steps": 3, "eval_every": 0},
            "optim": {"name": "adam", "lr": 0.01},
            "meta": {
                "enabled": True,
                "ways": 3,
                "shots": 2,
                "queries": 3,
                "tasks_per_step": 4,
                "test_classes": 3,
                "val_classes": 3,
                "eval_tasks": 4,
                **meta,
            },
            "monitor": {"enabled": False},
            "checkpoint": {"enabled": False},
        }
    )


# ------------------------------------------------------------------ episodes
def test_class_episodes_never_draw_a_held_out_class() -> None:
    # Prepare: 12 classes of 10 rows; 3 held out for meta-test, 3 for meta-val
    y = np.repeat(np.arange(12), 10)
    x = torch.arange(len(y), dtype=torch.float32).unsqueeze(1)  # a row's input is its index
    tasks = ClassTasks(x, y, ways=3, shots=2, queries=3, val=3, test=3, seed=7)
    # Execute: many episodes of every split
    seen = {s: set() for s in ("train", "val", "test")}
    for split in seen:
        for i in range(200):
            sx, sy, qx, _ = tasks.episode(split, i)
            rows = torch.cat([sx, qx]).squeeze(1).long().numpy()
            seen[split] |= set(y[rows].tolist())
            # Assert: ways × shots support, ways × queries query, labels 0..ways-1, no row in both
            assert sx.shape == (6, 1) and qx.shape == (9, 1)
            assert sorted(set(sy.tolist())) == [0, 1, 2] and not set(sx.squeeze(1).tolist()) & set(
                qx.squeeze(1).tolist()
            )
    assert seen["train"].isdisjoint(seen["test"]) and seen["train"].isdisjoint(seen["val"])
    assert seen["val"].isdisjoint(seen["test"])
    assert seen["test"] == set(tasks.classes["test"].tolist()) and len(seen["train"]) == 6
    # the same (split, index) is the same episode, whoever draws it
    again = ClassTasks(x, y, ways=3, shots=2, queries=3, val=3, test=3, seed=7)
    assert all(
        torch.equal(a, b) for a, b in zip(tasks.episode("train", 5), again.episode("train", 5), strict=True)
    )


def test_column_tasks_hold_out_whole_sites() -> None:
    rng = np.random.default_rng(0)
    sites = np.repeat(np.array(["a", "b", "c", "d"]), 20)
    y = np.tile(np.arange(2), 40)
    x = torch.as_tensor(rng.normal(size=(80, 3)), dtype=torch.float32)
    tasks = ColumnTasks(x, y, sites, classes=2, shots=3, queries=4, val=0, test=1, seed=0)
    held = set(tasks.tasks["test"].tolist())
    rows_by_input = {tuple(r.tolist()): i for i, r in enumerate(x)}
    for i in range(50):
        sx, sy, qx, _ = tasks.episode("train", i)
        drawn = {sites[rows_by_input[tuple(r.tolist())]] for r in torch.cat([sx, qx])}
        assert len(drawn) == 1 and not drawn & held  # one site per episode, never a held-out one
        assert sy.tolist() == [0, 0, 0, 1, 1, 1]
    with pytest.raises(ConfigError, match="task 'a' has 10 rows of class 0"):
        ColumnTasks(x, y, sites, classes=2, shots=8, queries=4, val=0, test=1, seed=0)


def test_too_few_classes_for_the_splits_is_one_line() -> None:
    y = np.repeat(np.arange(6), 10)
    x = torch.zeros(len(y), 1)
    with pytest.raises(ConfigError, match="6 classes cannot give 5 to meta-test"):
        ClassTasks(x, y, ways=3, shots=1, queries=1, val=1, test=5, seed=0)
    with pytest.raises(ConfigError, match=r"meta-train split has 2 classes, fewer than meta\.ways = 3"):
        ClassTasks(x, y, ways=3, shots=1, queries=1, val=1, test=3, seed=0)


# ------------------------------------------------------------ config and CLI
@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("meta.algorithm=reptil", "meta.algorithm: Input should be 'maml', 'fomaml', 'anil' or 'reptile'"),
        (
            "meta.learn_inner_lr=true",
            "meta.learn_inner_lr: Meta-SGD learns the inner LR through the second-order",
        ),
        ("meta.tasks=column", "meta.tasks = 'column' needs meta.task_column"),
        ("comm.method=fp16", "meta: the meta-step gathers every task's meta-gradient uncompressed"),
        (
            "train.grad_accum=2",
            "meta.tasks_per_step sets a meta-step's batch of episodes; set train.grad_accum = 1",
        ),
    ],
)
def test_a_bad_meta_config_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], override: str, message: str
) -> None:
    # reptile for the Meta-SGD case: it takes no second-order meta-gradient
    extra = ["--set", "meta.algorithm=reptile"] if "learn_inner_lr" in override else []
    code, _, err = vatra_in_process(capsys, "meta", "examples/meta_digits.toml", *extra, "--set", override)
    assert code == 2
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1


def test_meta_keys_in_a_train_run_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = vatra_in_process(capsys, "train", "examples/meta_digits.toml")
    assert code == 2 and "a train run reads no [meta] keys" in err and "vatra meta CONFIG" in err


def test_adapt_without_a_meta_run_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text('[data]\nname = "digits"\n')
    code, _, err = vatra_in_process(capsys, "meta", "adapt", str(tmp_path), "--data", "x.csv")
    assert code == 2 and "no meta/init.pt" in err
    code, _, err = vatra_in_process(capsys, "meta", "adapt", str(tmp_path), "--data", "x.csv", "--shots", "0")
    assert code == 2 and "--shots '0'" in err
    # a damaged or hostile init.pt (a pickle that would run code) is refused in one line, never loaded
    (tmp_path / "meta").mkdir()
    for body in (b"not a checkpoint", __import__("pickle").dumps(__import__("os").system)):
        (tmp_path / "meta" / "init.pt").write_bytes(body)
        code, _, err = vatra_in_process(capsys, "meta", "adapt", str(tmp_path), "--data", "x.csv")
        assert code == 2 and "not a meta-learned initialisation" in err and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------- the engine
def test_meta_sgd_learns_its_inner_lrs_and_restores_them() -> None:
    # Prepare
    cfg = meta_config(learn_inner_lr=True, inner_lr=0.3)
    learner = MetaLearner(cfg)
    trainer = Trainer.from_config(cfg, plugins=[learner])
    # Execute
    summary = trainer.fit()
    # Assert: the LRs moved, the evaluation ran on held-out classes, and a checkpoint's state restores
    assert any(abs(float(a.detach()) - 0.3) > 1e-4 for a in learner.lrs.values())
    assert 0.0 <= summary["test_accuracy"] <= 1.0 and "val_accuracy" in summary
    saved = learner.state_dict()
    with torch.no_grad():
        for a in learner.lrs.values():
            a.fill_(9.0)
    learner.load_state_dict(saved)
    assert all(torch.equal(a, saved["lrs"][n]) for n, a in learner.lrs.items())
    assert trainer.state.rank_states["meta"] is learner


def test_too_few_model_outputs_for_the_ways_is_one_line() -> None:
    cfg = meta_config(ways=3)
    model = torch.nn.Linear(64, 2)
    with pytest.raises(ConfigError, match="the model has 2 outputs but episodes have 3 classes"):
        Trainer.from_config(cfg, model=model, plugins=[MetaLearner(cfg)])


def test_adaptation_curve_from_a_saved_initialisation(tmp_path: Path) -> None:
    # Prepare: a short MAML run that saves its initialisation, then a new "site": the held-out classes
    from vatra.rundir import RunDir

    cfg = meta_config(algorithm="fomaml", inner_steps=2)
    learner = MetaLearner(cfg, RunDir(tmp_path))
    trainer = Trainer.from_config(cfg, plugins=[learner])
    trainer.fit()
    init = load_init(tmp_path)
    held = learner.sampler.classes["test"]  # type: ignore[attr-defined]
    labels = trainer.train_data.labels
    rows = np.flatnonzero(np.isin(labels, held))
    new_x = trainer.train_data.get_batch(rows)[0]
    new_y = np.searchsorted(held, labels[rows])  # the new task's classes as 0..2
    # Execute
    points = accuracy_curve(trainer.model, trainer.loss, init, new_x, new_y, [1, 5], repeats=3)
    # Assert: one point per K, accuracies in range, and adapting on 5 examples beats the unadapted init
    assert [p.shots for p in points] == [1, 5]
    assert all(0.0 <= p.accuracy <= 1.0 for p in points)
    assert points[1].accuracy > points[1].before
    with pytest.raises(ConfigError, match="--shots 500"):
        accuracy_curve(trainer.model, trainer.loss, init, new_x, new_y, [500])


def test_a_resumed_meta_run_ends_where_an_unbroken_one_does(tmp_path: Path) -> None:
    # Prepare: Meta-SGD, so the checkpoint must also carry the inner LRs and their optimizer
    import vatra

    def cfg(steps: int, out: str) -> Any:
        c = meta_config(learn_inner_lr=True)
        c.train.steps = steps
        c.checkpoint.enabled = True
        c.checkpoint.every_steps = 2
        c.checkpoint.async_ = False
        c.run.out_dir = out
        return c

    # Execute: 4 steps in one go; 2 steps, then the same folder resumed to 4
    whole = vatra.fit(cfg(4, str(tmp_path)), run_dir=tmp_path / "whole")
    vatra.fit(cfg(2, str(tmp_path)), run_dir=tmp_path / "broken")
    resumed = vatra.fit(cfg(4, str(tmp_path)), run_dir=tmp_path / "broken")
    # Assert: the episodes of steps 3 and 4 are drawn by index, the LRs restored: the same weights
    for (name, a), b in zip(whole.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert whole.summary["meta"]["inner_lr"] == resumed.summary["meta"]["inner_lr"]


def test_one_task_per_site_from_a_table_column(tmp_path: Path) -> None:
    # Prepare: 5 sites of 40 rows; within a site the label is the sign of x0 + the site's offset·x1
    import pandas as pd

    import vatra

    rng = np.random.default_rng(0)
    frames = []
    for site, offset in zip("abcde", (-1.0, -0.5, 0.0, 0.5, 1.0), strict=True):
        x = rng.normal(size=(40, 2))
        frames.append(
            pd.DataFrame(
                {
                    "x0": x[:, 0],
                    "x1": x[:, 1],
                    "site": site,
                    "y": (x[:, 0] + offset * x[:, 1] > 0).astype(int),
                }
            )
        )
    pd.concat(frames).to_csv(tmp_path / "sites.csv", index=False)
    cfg = meta_config(tasks="column", task_column="site", test_tasks=1, val_tasks=1, shots=3, queries=4)
    cfg.data = type(cfg.data).model_validate(
        {"name": "table", "path": str(tmp_path / "sites.csv"), "target": "y"}
    )
    cfg.run.out_dir = str(tmp_path)
    # Execute
    result = vatra.fit(cfg, run_dir=tmp_path / "run")
    # Assert: the site column named the tasks and was not a feature (2 inputs), binary episodes
    assert result.model.trunk[0].in_features == 2  # type: ignore[index,union-attr]
    assert result.summary["meta"]["ways"] == 2
    assert 0.0 <= result.summary["test_accuracy"] <= 1.0 and "val_accuracy" in result.summary


def test_a_meta_batch_that_does_not_split_over_the_ranks_is_refused_before_any_start(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, _, err = vatra_in_process(
        capsys, "meta", "examples/meta_digits.toml", "--nproc", "3", "--run-dir", str(tmp_path / "run")
    )
    assert code == 2 and "meta.tasks_per_step = 8 is not a multiple of the world size 3" in err
    assert not (tmp_path / "run").exists()  # refused before the run folder or any worker


@pytest.mark.parametrize("algorithm", ["maml", "fomaml", "anil", "reptile"])
def test_every_algorithm_meta_trains_through_the_engine_with_vmap(algorithm: str) -> None:
    cfg = meta_config(algorithm=algorithm)
    learner = MetaLearner(cfg)
    trainer = Trainer.from_config(cfg, plugins=[learner])
    before = [p.detach().clone() for p in trainer.model.parameters()]
    summary = trainer.fit()
    assert summary["meta"]["algorithm"] == algorithm and summary["meta"]["vmap"] is True
    assert all(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))
    expected = (
        ("head.weight", "head.bias")
        if algorithm == "anil"
        else tuple(n for n, _ in trainer.model.named_parameters())
    )
    assert learner.loop.adapted == expected
    assert np.isfinite(summary["test_loss"])
