"""2-process DDP on gloo equals one process on the concatenated batch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tests._dist import spawn
from tests.conftest import small_config

from vatra.data import ShardSampler
from vatra.engine import DistContext, Trainer, seed_everything
from vatra.models import build_model

STEPS, LOCAL_BATCH, WORLD = 4, 8, 2


def make_trainer(indices: np.ndarray, batch_size: int, ctx: DistContext | None) -> Trainer:
    cfg = small_config(train={"steps": STEPS, "batch_size": batch_size}, optim={"name": "sgd", "lr": 0.5})
    base = Trainer.from_config(cfg)  # dataset and spec only
    seed_everything(cfg.run.seed)
    model = build_model(cfg.model, base.spec)
    sampler = ShardSampler(indices, batch_size, seed=0, shuffle=False)
    return Trainer(cfg, model, base.train_data, None, base.spec, sampler, dist=ctx)


def rank_indices(rank: int) -> np.ndarray:
    """Rank r's slice of every global batch: global batch i = [i*W*B, (i+1)*W*B)."""
    glob = np.arange(STEPS * WORLD * LOCAL_BATCH).reshape(STEPS, WORLD, LOCAL_BATCH)
    return glob[:, rank, :].reshape(-1)


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    ctx = DistContext.init(
        small_config().dist, rank=rank, world_size=WORLD, init_method=f"file://{init_file}"
    )
    try:
        trainer = make_trainer(rank_indices(rank), LOCAL_BATCH, ctx)
        trainer.fit()
        torch.save([p.detach() for p in trainer.model.parameters()], Path(out_dir) / f"rank{rank}.pt")
    finally:
        ctx.destroy()


def test_two_process_ddp_equals_single_process(tmp_path: Path) -> None:
    spawn(_worker, WORLD, (str(tmp_path / "rdzv"), str(tmp_path)))
    reference = make_trainer(np.arange(STEPS * WORLD * LOCAL_BATCH), WORLD * LOCAL_BATCH, None)
    reference.fit()
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for r in range(WORLD):
        for got, want in zip(ranks[r], reference.model.parameters(), strict=True):
            # DDP averages per-rank mean gradients; the reference takes one mean over the same
            # samples. Equal in exact arithmetic; fp32 summation order differs → 1e-5 relative.
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
    for a, b in zip(ranks[0], ranks[1], strict=True):
        assert torch.equal(a, b)  # DDP keeps replicas bitwise identical
