"""Pipeline bubble: measured idle share of a step against (p − 1)/(m + p − 1), gpipe and 1f1b.

    python bench/pipeline_bubble.py [--stages 2 4] [--micro 1 2 4 8 16] [--steps 5]

p gloo ranks (one per stage, one thread each) run vatra.parallel's pipeline of a gpt whose blocks
are split evenly (4 blocks per stage, n_embd 256, 64 tokens, 4 samples per micro-batch). Each rank
first times its own stage's forward + backward of one micro-batch alone (no communication); the
slowest stage's time t sets the pace, so a step without a bubble would take m·t. The measured
bubble is 1 − m·t / T_step (both the fastest of --steps runs after one warm-up: on a shared machine
the minimum is the least disturbed), the theory
(p − 1)/(m + p − 1) for both schedules. What the bubble does not account for (send/recv, the
schedule's own work) lands in the measured figure too.

NOTE: p ranks need p free cores; on a machine with fewer, or shared, the ranks' compute overlaps
less than the schedule allows and the measured bubble is too high. The machine it ran on is in the
result file.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from _common import print_table, run_ranks, write_result
from vatra.config import config_from_dict
from vatra.data import DatasetSpec
from vatra.engine import DistContext, seed_everything
from vatra.models import build_model
from vatra.parallel import Mesh, build_pipeline

MICRO, SEQ, WIDTH, BLOCKS_PER_STAGE, VOCAB = 4, 64, 256, 4, 256


def worker(ctx: DistContext, schedule: str, micro: int, steps: int) -> dict[str, Any]:
    p = ctx.world_size
    cfg = config_from_dict(
        {
            "model": {"name": "gpt", "n_layer": BLOCKS_PER_STAGE * p, "n_head": 4, "n_embd": WIDTH},
            "train": {"batch_size": MICRO * micro},
            "parallel": {"pp": p, "schedule": schedule, "microbatches": micro},
        }
    )
    seed_everything(0)
    model = build_model(cfg.model, DatasetSpec(kind="lm", input_shape=(SEQ,), num_classes=VOCAB))
    x = torch.randint(0, VOCAB, (MICRO * micro, SEQ), generator=torch.Generator().manual_seed(1))
    loss_fn = torch.nn.functional.cross_entropy

    def lm_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss_fn(out.reshape(-1, VOCAB), target.reshape(-1))

    pipe = build_pipeline(model, Mesh.build(cfg.parallel, ctx.device), cfg.parallel, lm_loss, x[:MICRO])
    stage = pipe.stages[0]
    # this stage alone on one micro-batch: forward + backward, no communication
    probe = x[:MICRO] if stage.first else torch.randn(MICRO, SEQ, WIDTH)
    alone = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        out = stage(probe)
        (lm_loss(out, x[:MICRO]) if stage.last else out.sum()).backward()
        alone.append(time.perf_counter() - start)
    t_stage = torch.tensor(min(alone[1:]))
    torch.distributed.all_reduce(t_stage, op=torch.distributed.ReduceOp.MAX)
    times = []
    for _ in range(steps + 1):
        for param in pipe.parameters():
            param.grad = None
        torch.distributed.barrier()
        start = time.perf_counter()
        pipe.step(x, x)
        times.append(time.perf_counter() - start)
    step = min(times[1:])
    return {"step_s": step, "stage_s": float(t_stage), "bubble": 1.0 - micro * float(t_stage) / step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--micro", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    rows, runs = [], []
    for p in args.stages:
        for schedule in ("gpipe", "1f1b"):
            for m in args.micro:
                if m < p:
                    continue  # parallel.microbatches ≥ pp
                r = run_ranks(worker, p, schedule, m, args.steps)
                theory = (p - 1) / (m + p - 1)
                runs.append({"stages": p, "schedule": schedule, "microbatches": m, "theory": theory, **r})
                error = (r["bubble"] - theory) / theory if theory else 0.0
                rows.append([p, schedule, m, theory, r["bubble"], error, r["step_s"], r["stage_s"]])
    print_table(["p", "schedule", "m", "theory", "measured", "rel. error", "step s", "stage s"], rows)
    write_result("pipeline_bubble", {"runs": runs})


if __name__ == "__main__":
    main()
