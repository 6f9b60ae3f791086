"""vatra's Trainer vs a hand-written DDP loop: a user's model on a Parquet table, same DataLoader.

    python bench/trainer_overhead.py [--world 2] [--steps 1000] [--reps 7] [--rows 100000] [--workers 0]

The table (``--rows`` × 32 float features, 10 classes) is written once and read by vatra's
``table`` source on every rank, so both loops train on the same standardised ``TableDataset``.
The model is the user's (a residual MLP defined here, not a vatra built-in). The hand-written loop
is what a user would write around DDP: a DataLoader whose sampler yields batches of a
``DistributedSampler`` and fetches each batch with one indexing call (the dataset's own batched
fetch, which vatra's loader uses too), zero_grad / forward / cross-entropy / backward / step, and
DDP with vatra's ``dist.bucket_cap_mb``. vatra's Trainer runs with what ``vatra train`` attaches
for metrics (metrics.jsonl every step, TensorBoard every 10 steps, per-step gradient norm and
timings). Both loops run in the same gloo processes, in a rotating order rep by rep, so machine
noise hits each alike. Reports samples/s per loop and their ratio per rep.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler

from _common import print_table, run_ranks, write_result
from vatra.config import config_from_dict
from vatra.data import BatchedDataset, DataContext, build_dataset
from vatra.engine import DistContext, Trainer, seed_everything
from vatra.monitor import JsonlWriter, TensorBoardWriter
from vatra.rundir import RunDir

BATCH, FEATURES, CLASSES, WIDTH = 128, 32, 10, 256


class ResidualMLP(nn.Module):
    """The user's model: input projection, three pre-LayerNorm residual blocks, a linear head."""

    def __init__(self, features: int, classes: int, width: int) -> None:
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU()) for _ in range(3)
        )
        self.out = nn.Linear(width, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)  # (B, width)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)  # (B, classes)


class _ByBatch(Dataset):
    """Indexing with a list of indices fetches that batch with the dataset's batched fetch."""

    def __init__(self, ds: BatchedDataset) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, idx: list[int]) -> Any:  # type: ignore[override]
        return self.ds.get_batch(np.asarray(idx))


def _keep(batch: Any) -> Any:
    return batch


def write_table(path: Path, rows: int) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, FEATURES)).astype(np.float32)
    w = rng.normal(size=(FEATURES, CLASSES))
    y = np.argmax(x @ w + rng.gumbel(size=(rows, CLASSES)), axis=1)
    cols = {f"f{i}": x[:, i] for i in range(FEATURES)}
    pq.write_table(pa.table({**cols, "label": y.astype(np.int64)}), path, row_group_size=65_536)


def bench_config(path: str, steps: int, workers: int) -> Any:
    return config_from_dict(
        {
            "run": {"progress": "off"},
            "data": {"name": "table", "path": path, "target": "label", "workers": workers},
            "train": {"steps": steps, "batch_size": BATCH, "eval_every": 0, "task": "classification"},
            "optim": {"name": "adamw", "lr": 1e-3},
        }
    )


def plain_ddp(ctx: DistContext, cfg: Any, train: BatchedDataset, steps: int) -> float:
    """The loop a user would write by hand; returns samples/s over ``steps`` steps."""
    seed_everything(cfg.run.seed)
    model = DDP(ResidualMLP(FEATURES, CLASSES, WIDTH), bucket_cap_mb=cfg.dist.bucket_cap_mb)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr)
    sampler = DistributedSampler(train, ctx.world_size, ctx.rank, shuffle=True, seed=cfg.run.seed)
    loader = DataLoader(
        _ByBatch(train),
        sampler=BatchSampler(sampler, BATCH, drop_last=True),
        batch_size=None,
        collate_fn=_keep,
        num_workers=cfg.data.workers,
        generator=torch.Generator(),
    )
    ctx.barrier()
    t0 = time.perf_counter()
    done, epoch = 0, 0
    while done < steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            done += 1
            if done == steps:
                break
        epoch += 1
    ctx.barrier()
    return steps * BATCH * ctx.world_size / (time.perf_counter() - t0)


def vatra_trainer(ctx: DistContext, cfg: Any, train: BatchedDataset, spec: Any, run_dir: RunDir) -> float:
    seed_everything(cfg.run.seed)
    model = ResidualMLP(FEATURES, CLASSES, WIDTH)
    plugins = [TensorBoardWriter(run_dir, every=cfg.run.tb_every), JsonlWriter(run_dir)]
    trainer = Trainer(cfg, model, train, None, spec, dist=ctx, plugins=plugins, run_dir=run_dir)
    ctx.barrier()
    t0 = time.perf_counter()
    trainer.fit()
    ctx.barrier()
    return cfg.train.steps * BATCH * ctx.world_size / (time.perf_counter() - t0)


def worker(ctx: DistContext, path: str, steps: int, reps: int, workers: int, tmp: str) -> dict:
    cfg = bench_config(path, steps, workers)
    train, _, spec = build_dataset(cfg.data, DataContext(seed=0, rank=ctx.rank, world_size=ctx.world_size))
    plain_ddp(ctx, cfg, train, 20)  # warm-up: allocator, gloo connections
    loops = {
        "plain": lambda rd: plain_ddp(ctx, cfg, train, steps),
        "vatra": lambda rd: vatra_trainer(ctx, cfg, train, spec, rd),
    }
    names = list(loops)
    rows = []
    for rep in range(reps):
        run_dir = RunDir(Path(tmp) / f"rep{rep}")
        if ctx.is_main:
            run_dir.create()
        ctx.barrier()
        order = names[rep % 2 :] + names[: rep % 2]  # rotate who goes first
        sps = {name: loops[name](run_dir) for name in order}
        rows.append(
            {
                "rep": rep,
                **{f"{k}_samples_per_s": v for k, v in sps.items()},
                "ratio": sps["vatra"] / sps["plain"],
            }
        )
    return {
        "rows": rows,
        "params": sum(p.numel() for p in ResidualMLP(FEATURES, CLASSES, WIDTH).parameters()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--workers", type=int, default=0, help="DataLoader workers per rank (both loops)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "table.parquet"
        write_table(path, args.rows)
        result = run_ranks(worker, args.world, str(path), args.steps, args.reps, args.workers, tmp)
    rows = result["rows"]
    print_table(
        ["rep", "hand-written DDP loop samples/s", "vatra Trainer samples/s", "vatra / hand-written"],
        [[r["rep"], r["plain_samples_per_s"], r["vatra_samples_per_s"], r["ratio"]] for r in rows],
    )
    median = statistics.median(r["ratio"] for r in rows)
    print(f"median samples/s ratio vatra / hand-written DDP loop = {median:.3f} (target >= 0.97)")
    write_result(
        "trainer_overhead",
        {
            "world": args.world,
            "steps": args.steps,
            "rows": args.rows,
            "workers": args.workers,
            "batch_per_rank": BATCH,
            "model_params": result["params"],
            "reps": rows,
            "median_ratio": median,
        },
    )


if __name__ == "__main__":
    main()
