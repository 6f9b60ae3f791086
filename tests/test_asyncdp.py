"""dist.mode = local_sgd / diloco: equivalence with DDP at H = 1, schedules, errors, exact resume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tests._dist import ROOT, final_weights, rewind, spawn, train_ranks
from tests.conftest import small_config, vatra_in_process

from vatra.asyncdp import computes_at, mode_plugin, split_fragments, steps_for_speed
from vatra.config import load_config
from vatra.data import ShardSampler
from vatra.engine import DistContext, Trainer, seed_everything
from vatra.errors import ConfigError
from vatra.models import build_model
from vatra.resilience.chaos import TrainingFaults
from vatra.rundir import read_jsonl

STEPS, LOCAL_BATCH, WORLD = 6, 8, 2
SGD = {"name": "sgd", "lr": 0.3, "momentum": 0.9}
# each mode is 2-rank training whose H = 1 case must equal one process on the union batch
MODES: dict[str, dict[str, Any]] = {
    "local_sgd": {"dist": {"mode": "local_sgd"}, "local_sgd": {"every": 1}},
    "diloco": {
        "dist": {"mode": "diloco"},
        "diloco": {"inner_steps": 1, "outer": "sgd", "outer_lr": 1.0, "outer_momentum": 0.0},
    },
}
STREAMING = {  # H = 4, 2 fragments, fp16 pseudo-gradients
    "dist": {"mode": "diloco"},
    "diloco": {"inner_steps": 4, "fragments": 2},
    "comm": {"method": "fp16"},
}


def _trainer(sections: dict[str, Any], indices: np.ndarray, batch: int, ctx: DistContext | None) -> Trainer:
    sections = {**sections, "dist": {**sections.get("dist", {}), "timeout_s": 120}}  # a hang fails here
    cfg = small_config(train={"steps": STEPS, "batch_size": batch}, optim=SGD, **sections)
    base = Trainer.from_config(cfg)  # dataset and spec only
    rank = ctx.rank if ctx is not None else 0
    seed_everything(cfg.run.seed + rank)  # rank 1 starts from other weights: the mode must align them
    model = build_model(cfg.model, base.spec)
    sampler = ShardSampler(indices, batch, seed=0, shuffle=False)
    plugins = [TrainingFaults(cfg.chaos)] if cfg.chaos.speed_factors else []
    if cfg.dist.mode != "sync":
        plugins.append(mode_plugin(cfg))
    return Trainer(cfg, model, base.train_data, None, base.spec, sampler, dist=ctx, plugins=plugins)


def _rank_indices(rank: int, world: int) -> np.ndarray:
    glob = np.arange(STEPS * world * LOCAL_BATCH).reshape(STEPS, world, LOCAL_BATCH)
    return glob[:, rank, :].reshape(-1)


class Keep:
    """Records each step's metrics."""

    def __init__(self) -> None:
        self.metrics: list[dict[str, Any]] = []

    def on_step_end(self, trainer: Trainer, m: dict[str, Any]) -> None:
        self.metrics.append(dict(m))


def _worker(rank: int, init_file: str, out_dir: str, world: int, runs: dict[str, dict[str, Any]]) -> None:
    torch.set_num_threads(1)
    ctx = DistContext.init(
        small_config().dist, rank=rank, world_size=world, init_method=f"file://{init_file}"
    )
    try:
        for name, sections in runs.items():
            trainer = _trainer(sections, _rank_indices(rank, world), LOCAL_BATCH, ctx)
            keep = Keep()
            trainer.plugins.by_hook["on_step_end"].append(keep.on_step_end)
            trainer.fit()
            metrics = keep.metrics
            params = [p.detach().clone() for p in trainer.model.parameters()]
            torch.save({"params": params, "metrics": metrics}, Path(out_dir) / f"{name}{rank}.pt")
    finally:
        ctx.destroy()


def test_h1_equals_single_process_and_streaming_ends_in_step(tmp_path: Path) -> None:
    # Execute: every mode on 2 ranks (one launch), and the single-process reference
    runs = {**MODES, "streaming": STREAMING}
    spawn(_worker, WORLD, (str(tmp_path / "rdzv"), str(tmp_path), WORLD, runs))
    ref = _trainer({}, np.arange(STEPS * WORLD * LOCAL_BATCH), WORLD * LOCAL_BATCH, None)
    ref.fit()
    want = [p.detach() for p in ref.model.parameters()]
    # Assert: local SGD and DiLoCo at H = 1 take DDP's steps (momentum SGD is linear in the gradient;
    # fp32 summation order differs → 1e-5 relative)
    for name in MODES:
        for r in range(WORLD):
            got = torch.load(tmp_path / f"{name}{r}.pt")
            for g, w in zip(got["params"], want, strict=True):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=f"{name} rank {r}")
            assert all(m["comm_bytes"] > 0 for m in got["metrics"])  # averaged after every step
    # streaming DiLoCo: fragments synced in turn, the last step syncs all, so the ranks end equal
    a, b = (torch.load(tmp_path / f"streaming{r}.pt") for r in range(WORLD))
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))
    assert [m["synced"] for m in a["metrics"]] == [0, 1, 0, 1, 0, 2]  # offsets 0 and 2 of H = 4
    # both fragments twice; ring share 2·(W−1)/W = 1; fp16, but tensors under comm.min_numel go exact
    small = small_config().comm.min_numel
    fp16_bytes = sum(p.numel() * (4 if p.numel() < small else 2) for p in want)
    assert sum(m["comm_bytes"] for m in a["metrics"] if m["synced"]) == 2 * fp16_bytes


@pytest.mark.slow(14)
def test_hybrid_h1_equals_single_process(tmp_path: Path) -> None:
    # 4 ranks in 2 groups of 2: DDP inside each group, DiLoCo (outer SGD at lr 1, H = 1) across
    hybrid = {**MODES["diloco"], "dist": {"mode": "hybrid"}, "hybrid": {"group_size": 2}}
    args = (str(tmp_path / "rdzv"), str(tmp_path), 4, {"hybrid": hybrid})
    spawn(_worker, 4, args)
    ref = _trainer({}, np.arange(STEPS * 4 * LOCAL_BATCH), 4 * LOCAL_BATCH, None)
    ref.fit()
    for r in range(4):
        got = torch.load(tmp_path / f"hybrid{r}.pt")
        for g, w in zip(got["params"], ref.model.parameters(), strict=True):
            torch.testing.assert_close(g, w.detach(), rtol=1e-5, atol=1e-6, msg=f"rank {r}")


def test_schedules() -> None:
    assert split_fragments([10, 10, 10, 10], 2) == [[0, 1], [2, 3]]
    assert split_fragments([100, 1, 1, 1], 3) == [[0], [1], [2, 3]]  # every fragment gets a tensor
    with pytest.raises(ConfigError, match="at most 2"):
        split_fragments([5, 5], 3)
    assert steps_for_speed([0.1, 0.3, 0.0], 32) == [32, 11, 32]
    assert steps_for_speed([1.0, 100.0], 8) == [8, 1]  # never fewer than one step a round
    for own in (1, 3, 8, 11, 32):
        assert sum(computes_at(j, own, 32) for j in range(32)) == own


@pytest.mark.parametrize(
    ("sets", "says"),
    [
        (["dist.mode=local_sgd", "comm.method=topk"], "comm.method = 'none'"),
        (["dist.mode=diloco", "comm.method=powersgd"], "powersgd"),
        (["dist.mode=diloco", "balance.method=static"], "balance.method = 'off'"),
        (["dist.mode=hybrid", "comm.method=powersgd"], "powersgd"),
        (["dist.mode=gossip"], "dist.mode"),
    ],
)
def test_config_errors(sets: list[str], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        load_config(ROOT / "examples" / "digits.toml", sets)


def test_cli_refuses_a_mode_without_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sets = ["dist.mode=local_sgd", "comm.method=topk", f"run.out_dir={tmp_path}"]
    code, _, err = vatra_in_process(
        capsys, "train", "examples/digits.toml", *[a for s in sets for a in ("--set", s)]
    )
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "local_sgd" in lines[0]


RESUMED = {
    # AdamW inner steps, Nesterov outer, 2 fragments, fp16 pseudo-gradients with error feedback
    "diloco": ["dist.mode=diloco", "diloco.inner_steps=4", "diloco.fragments=2", "comm.method=fp16"],
    "local_sgd": ["dist.mode=local_sgd", "local_sgd.every=4"],
}


@pytest.mark.slow(71)
def test_diloco_and_local_sgd_resume_repeats_losses_and_weights(tmp_path: Path) -> None:
    # Prepare: per mode, a 2-rank run of 30 steps, and a copy of it rewound to its step-10 save, in
    # the middle of a round (the ranks' parameters differ there): as if it had died after step 15
    common = ["train.steps=30", "checkpoint.every_steps=10", "optim.name=adamw", "optim.lr=0.003"]
    common += ["monitor.enabled=false", "run.progress=off", "run.tensorboard=false"]  # not under test
    for mode, sets in RESUMED.items():
        ref, hit = tmp_path / f"{mode}-ref", tmp_path / f"{mode}-hit"
        train_ranks(ref, *common, *sets)
        before = rewind(ref, hit, step=10)
        # Execute: the same command on the rewound copy resumes from step 10
        summary = train_ranks(hit, *common, *sets)
        # Assert: the resumed attempt repeats the uninterrupted run's losses exactly, to the last step
        want = {m["step"]: m["loss"] for m in read_jsonl(ref / "metrics.jsonl")}
        got = read_jsonl(hit / "metrics.jsonl")[before:]
        assert [m["step"] for m in got] == list(range(11, 31)), mode
        assert all(m["loss"] == want[m["step"]] for m in got), mode
        a, b = final_weights(ref, tmp_path, 30), final_weights(hit, tmp_path, 30)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), mode
        assert summary["dist_mode"] == mode
