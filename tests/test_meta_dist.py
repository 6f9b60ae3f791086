"""Meta-learning across ranks: 2 gloo ranks take the same meta-steps as one process on the same
meta-batches, because every rank sums the gathered per-task meta-gradients in episode order."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from tests._dist import TRAIN_2, rendezvous, run_vatra, spawn
from tests.conftest import vatra_in_process
from tests.test_meta import meta_config

from vatra.data.stratify import bundled_digits
from vatra.engine import DistContext, Trainer
from vatra.meta import MetaLearner


def _meta_rank(rank: int, world: int, algorithm: str, init: str, out: str) -> None:
    torch.set_num_threads(1)
    cfg = meta_config(algorithm=algorithm)
    ctx = DistContext.init(cfg.dist, rank=rank, world_size=world, init_method=init)
    try:
        trainer = Trainer.from_config(cfg, dist=ctx, plugins=[MetaLearner(cfg)])
        summary = trainer.fit()
        state = {n: p.detach() for n, p in trainer.model.named_parameters()}
        saved = {"params": state, "loss": summary["final_loss"], "comm_bytes": summary["comm_bytes"]}
        torch.save(saved, Path(out) / f"rank{rank}.pt")
    finally:
        ctx.destroy()


@pytest.mark.parametrize("algorithm", ["maml", "reptile"])
@pytest.mark.slow(6)
def test_two_ranks_take_the_meta_steps_of_one_process(tmp_path: Path, algorithm: str) -> None:
    # Prepare / Execute: 3 meta-steps of 4 episodes on 2 ranks (2 each), and in one process
    spawn(_meta_rank, 2, (2, algorithm, rendezvous(tmp_path), str(tmp_path)))
    cfg = meta_config(algorithm=algorithm)
    one = Trainer.from_config(cfg, plugins=[MetaLearner(cfg)])
    summary = one.fit()
    # Assert: bitwise the same weights and loss on every rank: the per-task terms are the same (vmap
    # over 2 tasks on a rank, 4 in one process: a task's kernels do not depend on its neighbours)
    # and are summed in the same order
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for name, want in one.model.named_parameters():
            assert torch.equal(got["params"][name], want.detach()), name
        assert got["loss"] == summary["final_loss"]
        # each rank sent its 2 tasks' rows (every parameter, loss, accuracy) in float32, 3 steps
        size = sum(p.numel() for p in one.model.parameters())
        assert got["comm_bytes"] == 3 * 2 * (size + 2) * 4
    assert summary["comm_bytes"] == 0  # one process sends nothing


@pytest.mark.slow(10)
def test_the_shipped_example_meta_trains_on_two_ranks_and_adapts_to_a_new_site(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare: a new "site" as a CSV: digits of the classes held out of meta-training
    run = tmp_path / "run"
    # Execute: the example on 2 ranks (3 meta-steps), then adaptation on 1 and 3 examples per class
    done = run_vatra(
        "meta", "examples/meta_digits.toml", *TRAIN_2, "--set", "train.steps=3", "--run-dir", str(run)
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads((run / "summary.json").read_text())
    held = [
        int(c) for c in np.sort(np.random.default_rng(0).permutation(np.arange(10))[:5])
    ]  # seed 0's test split
    pixels, labels = bundled_digits()
    rows = np.isin(labels, held)
    table = pd.DataFrame(pixels[rows] / 16.0, columns=[f"p{i}" for i in range(64)])
    table["digit"] = labels[rows]
    table.to_csv(tmp_path / "site.csv", index=False)
    args = [
        "--data",
        str(tmp_path / "site.csv"),
        "--shots",
        "1,3",
        "--repeats",
        "2",
        "--out",
        str(tmp_path / "c.json"),
    ]
    sets = ["--set", "data.target=digit", "--set", "data.standardize=false"]
    code, out, err = vatra_in_process(capsys, "meta", "adapt", str(run), *args, *sets)
    # Assert: a meta-step on 2 ranks each, the held-out classes scored, a point per K
    assert summary["world_size"] == 2 and summary["steps"] == 3 and 0 <= summary["test_accuracy"] <= 1
    assert code == 0, err
    assert "K =   1 per class" in out and "K =   3 per class" in out
    curve = json.loads((tmp_path / "c.json").read_text())["curve"]
    assert [p["shots"] for p in curve] == [1, 3] and all(0 <= p["accuracy"] <= 1 for p in curve)
