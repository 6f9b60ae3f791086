"""Training state per rank under FSDP: parameters + gradients + optimizer state for fsdp = 1, 2, 4.

    python bench/fsdp_memory.py [--fsdp 1 2 4] [--layers 4] [--width 256]

fsdp gloo ranks train the gpt model (AdamW) for one step through vatra's Trainer with
``parallel.fsdp`` = the world size (fsdp = 1: one process, no sharding). Each rank counts the bytes
it holds of each parameter (its local shard), of each gradient and of the optimizer's state tensors
after the step, and reads its peak resident set size (``ru_maxrss``: the whole process, with torch
itself and the activations, so it falls by far less than the state). Reported: rank 0's figures and
their ratio to fsdp = 1; the state should fall as 1/fsdp (a little less: FSDP pads each parameter to
a multiple of fsdp rows).
"""

from __future__ import annotations

import argparse
import resource
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from _common import print_table, run_ranks, write_result
from vatra.config import config_from_dict
from vatra.data import DatasetSpec, ShardSampler
from vatra.engine import DistContext, Trainer, seed_everything
from vatra.models import build_model

SEQ, VOCAB, BATCH = 64, 256, 8


def _bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def worker(ctx: DistContext | None, layers: int, width: int) -> dict[str, Any]:
    world = ctx.world_size if ctx is not None else 1
    cfg = config_from_dict(
        {
            "run": {"progress": "off", "tensorboard": False},
            "model": {"name": "gpt", "n_layer": layers, "n_head": 4, "n_embd": width},
            "train": {"steps": 1, "batch_size": BATCH, "eval_every": 0},
            "optim": {"name": "adamw"},
            "parallel": {"fsdp": world} if world > 1 else {},
        }
    )
    spec = DatasetSpec(kind="lm", input_shape=(SEQ,), num_classes=VOCAB)
    tokens = torch.randint(0, VOCAB, (BATCH * world, SEQ + 1), generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    seed_everything(0)
    model = build_model(cfg.model, spec)
    rank = ctx.rank if ctx is not None else 0
    sampler = ShardSampler(torch.arange(rank, BATCH * world, world).numpy(), BATCH, seed=0)
    trainer = Trainer(cfg, model, data, None, spec, sampler, dist=ctx)
    trainer.train_step()
    params = sum(_bytes(p) for p in trainer.model.parameters())
    grads = sum(_bytes(p.grad) for p in trainer.model.parameters() if p.grad is not None)
    optim = sum(
        _bytes(v) for s in trainer.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    )
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    mb = 2**20
    return {"params_mb": params / mb, "grads_mb": grads / mb, "optim_mb": optim / mb, "rss_mb": rss_mb}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fsdp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()
    runs, rows = [], []
    for f in args.fsdp:
        r = worker(None, args.layers, args.width) if f == 1 else run_ranks(worker, f, args.layers, args.width)
        state = r["params_mb"] + r["grads_mb"] + r["optim_mb"]
        runs.append({"fsdp": f, **r, "state_mb": state})
    base = runs[0]["state_mb"]
    for r in runs:
        figures = [r[k] for k in ("params_mb", "grads_mb", "optim_mb", "state_mb")]
        rows.append([r["fsdp"], *figures, r["state_mb"] / base, r["rss_mb"]])
    print_table(["fsdp", "params MB", "grads MB", "optim MB", "state MB", "vs fsdp 1", "peak RSS MB"], rows)
    write_result("fsdp_memory", {"layers": args.layers, "width": args.width, "runs": runs})


if __name__ == "__main__":
    main()
