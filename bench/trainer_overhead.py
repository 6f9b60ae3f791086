"""vatra's Trainer vs a plain hand-written DDP loop: same model, data, optimizer and world size.

    python bench/trainer_overhead.py [--world 4] [--steps 200] [--reps 5]

All loops run in the same 4 gloo processes, in a rotating order rep by rep, so machine noise hits
each alike. The Trainer runs with what `vatra train` attaches by default for metrics (metrics.jsonl
and TensorBoard writers, per-step grad-norm, timing); the plain loops only train. Two plain loops:
DDP with its defaults (a 1 MB first bucket, so this model's gradients go in two all-reduces), and
DDP with `bucket_cap_mb` = vatra's `dist.bucket_cap_mb` (one all-reduce, as in vatra): the second
isolates the Trainer's own overhead. Reports samples/s ratios per rep.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from _common import print_table, run_ranks, write_result
from vatra.config import config_from_dict
from vatra.data import ShardSampler, build_dataset, partition
from vatra.engine import DistContext, Trainer, rank_seed, seed_everything
from vatra.models import build_model, loss_fn
from vatra.monitor import JsonlWriter, TensorBoardWriter
from vatra.rundir import RunDir

BATCH = 64


def bench_config(steps: int):
    return config_from_dict(
        {
            "run": {"progress": "off"},
            "data": {"name": "synthetic", "samples": 20000, "n_features": 64, "classes": 10},
            "model": {"name": "mlp", "hidden": [512, 512]},
            "train": {"steps": steps, "batch_size": BATCH, "eval_every": 0},
            "optim": {"name": "adamw", "lr": 1e-3},
        }
    )


def plain_ddp(ctx: DistContext, cfg, train, spec, shard, bucket_cap_mb: float | None = None) -> float:
    """The loop a user would write by hand; returns samples/s over ``cfg.train.steps`` steps."""
    seed_everything(cfg.run.seed)
    model = DDP(build_model(cfg.model, spec), bucket_cap_mb=bucket_cap_mb)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr)
    sampler = ShardSampler(shard, BATCH, seed=rank_seed(cfg.run.seed, ctx.rank))
    ctx.barrier()
    t0 = time.perf_counter()
    for _ in range(cfg.train.steps):
        x, y = train.batch(sampler.next_batch())
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()
    ctx.barrier()
    return cfg.train.steps * BATCH * ctx.world_size / (time.perf_counter() - t0)


def vatra_trainer(ctx: DistContext, cfg, train, spec, shard, run_dir: RunDir) -> float:
    seed_everything(cfg.run.seed)
    model = build_model(cfg.model, spec)
    sampler = ShardSampler(shard, BATCH, seed=rank_seed(cfg.run.seed, ctx.rank))
    plugins = [TensorBoardWriter(run_dir, every=cfg.run.tb_every), JsonlWriter(run_dir)]
    trainer = Trainer(cfg, model, train, None, spec, sampler, dist=ctx, plugins=plugins, run_dir=run_dir)
    ctx.barrier()
    t0 = time.perf_counter()
    trainer.fit()
    ctx.barrier()
    return cfg.train.steps * BATCH * ctx.world_size / (time.perf_counter() - t0)


def worker(ctx: DistContext, steps: int, reps: int, tmp: str) -> dict:
    cfg = bench_config(steps)
    train, _, spec = build_dataset(cfg.data, cfg.run.seed)
    shard = partition(len(train), train.labels, ctx.world_size, "random", seed=0)[ctx.rank]
    plain_ddp(ctx, bench_config(20), train, spec, shard)  # warm-up: allocator, gloo connections
    cap = cfg.dist.bucket_cap_mb
    loops = {
        "plain": lambda rd: plain_ddp(ctx, cfg, train, spec, shard),
        "plain_same_buckets": lambda rd: plain_ddp(ctx, cfg, train, spec, shard, bucket_cap_mb=cap),
        "vatra": lambda rd: vatra_trainer(ctx, cfg, train, spec, shard, rd),
    }
    names = list(loops)
    rows = []
    for rep in range(reps):
        run_dir = RunDir(Path(tmp) / f"rep{rep}")
        if ctx.is_main:
            run_dir.create()
        order = names[rep % 3 :] + names[: rep % 3]  # rotate who goes first
        sps = {name: loops[name](run_dir) for name in order}
        rows.append(
            {
                "rep": rep,
                **{f"{k}_samples_per_s": v for k, v in sps.items()},
                "ratio": sps["vatra"] / sps["plain"],
                "ratio_same_buckets": sps["vatra"] / sps["plain_same_buckets"],
            }
        )
    return {"rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = run_ranks(worker, args.world, args.steps, args.reps, tmp)
    rows = result["rows"]
    print_table(
        ["rep", "plain DDP", "plain DDP, same buckets", "vatra", "ratio", "ratio (same buckets)"],
        [
            [r["rep"], r["plain_samples_per_s"], r["plain_same_buckets_samples_per_s"],
             r["vatra_samples_per_s"], r["ratio"], r["ratio_same_buckets"]]
            for r in rows
        ],
    )  # fmt: skip
    median = statistics.median(r["ratio"] for r in rows)
    median_same = statistics.median(r["ratio_same_buckets"] for r in rows)
    print(f"median samples/s ratio vatra/plain DDP = {median:.3f}; vs same buckets = {median_same:.3f}")
    write_result(
        "trainer_overhead",
        {
            "world": args.world,
            "steps": args.steps,
            "batch_per_rank": BATCH,
            "rows": rows,
            "median_ratio": median,
        },
    )


if __name__ == "__main__":
    main()
