"""The plain-PyTorch side of ``bench/startup.py``: what a user would write by hand for
``examples/digits.toml`` — the same MLP (64 → 128 → 128 → 10) on the same bundled digits, DDP on
gloo, AdamW with warmup + cosine, gradient clipping, a validation pass every 50 steps.

    torchrun --nproc-per-node 2 --standalone bench/_startup_plain.py --steps 60 --first-step FILE

Rank 0 writes the wall-clock time its first optimizer step finished to ``--first-step``.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's bundled 8×8 digits, pixels scaled to [0, 1] (read from its file)."""
    spec = importlib.util.find_spec("sklearn")
    assert spec is not None and spec.submodule_search_locations
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets/data/digits.csv.gz"
    table = np.loadtxt(path, delimiter=",")
    pixels, labels = table[:, :-1].astype(np.float32) / 16.0, table[:, -1].astype(np.int64)
    return torch.from_numpy(pixels), torch.from_numpy(labels)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--first-step", required=True)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    x, y = digits()
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    n_val = math.ceil(0.2 * len(y))
    val, train = order[:n_val], order[n_val:]
    shard = train[rank::world]  # this rank's share of the training set

    mlp = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    model = DDP(mlp)
    opt = torch.optim.AdamW(model.parameters(), lr=0.003)
    warmup = 20

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, args.steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    gen = torch.Generator().manual_seed(rank)
    for step in range(1, args.steps + 1):
        idx = shard[torch.randint(len(shard), (args.batch_size,), generator=gen)]
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        opt.step()
        sched.step()
        if step == 1 and rank == 0:
            Path(args.first_step).write_text(repr(time.time()))
        if step % 50 == 0 or step == args.steps:
            with torch.no_grad():
                acc = (model(x[val]).argmax(1) == y[val]).float().mean().item()
            if rank == 0:
                print(f"step {step} loss {loss.item():.3f} val_acc {acc:.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
