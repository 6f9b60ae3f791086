"""Pipeline bubble: measured idle share of a step against (p − 1)/(m + p − 1), gpipe and 1f1b.

    python bench/pipeline_bubble.py [--stages 2 4] [--micro 1 2 4 8 16] [--steps 5] [--device-ms F]

p gloo ranks (one per stage, one thread each) run vatra.parallel's pipeline of a gpt whose blocks
are split evenly (4 blocks per stage, n_embd 256, 64 tokens, 4 samples per micro-batch). Each rank
first times its own stage's forward + backward of one micro-batch alone (no communication); the
slowest stage's time t sets the pace, so a step without a bubble would take m·t. The measured
bubble is 1 − m·t / T_step (both the fastest of --steps runs after one warm-up: on a shared machine
the minimum is the least disturbed), the theory
(p − 1)/(m + p − 1) for both schedules. What the bubble does not account for (send/recv, the
schedule's own work) lands in the measured figure too.

Beside it, the figure the Trainer logs (``pp_bubble``, from :class:`vatra.parallel.StageClock`): the
share of the schedule's time a rank's stage was not computing, averaged over the ranks.

NOTE: p ranks need p free cores; on a machine with fewer, or shared, the ranks' compute overlaps
less than the schedule allows and the measured bubble is too high. ``--device-ms F`` stands in for
a device per stage: every block computes on a tiny width and then holds its rank for F ms in
forward and 2·F ms in backward (a sleep, which leaves the cores free), so the ranks overlap as
devices would and what is measured is the schedule itself: its order of micro-batches, the
send/recv between stages and its own work. The machine it ran on is in the result file.
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
TINY = 16  # the width under --device-ms: the real compute is negligible beside the held time


class _Hold(torch.autograd.Function):
    """Identity that holds the rank for ``forward_s`` in forward and ``backward_s`` in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.backward_s)
        return grad, None, None


class DeviceTime(torch.nn.Module):
    """A block that takes a fixed time per micro-batch, as on a device of its own."""

    def __init__(self, block: torch.nn.Module, forward_s: float) -> None:
        super().__init__()
        self.block, self.forward_s = block, forward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Hold.apply(self.block(x), self.forward_s, 2 * self.forward_s)


def worker(ctx: DistContext, schedule: str, micro: int, steps: int, device_ms: float) -> dict[str, Any]:
    p = ctx.world_size
    width = TINY if device_ms else WIDTH
    cfg = config_from_dict(
        {
            "model": {"name": "gpt", "n_layer": BLOCKS_PER_STAGE * p, "n_head": 4, "n_embd": width},
            "train": {"batch_size": MICRO * micro},
            "parallel": {"pp": p, "schedule": schedule, "microbatches": micro},
        }
    )
    seed_everything(0)
    model = build_model(cfg.model, DatasetSpec(kind="lm", input_shape=(SEQ,), num_classes=VOCAB))
    if device_ms:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = DeviceTime(block, device_ms / 1e3)
    x = torch.randint(0, VOCAB, (MICRO * micro, SEQ), generator=torch.Generator().manual_seed(1))
    loss_fn = torch.nn.functional.cross_entropy

    def lm_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss_fn(out.reshape(-1, VOCAB), target.reshape(-1))

    pipe = build_pipeline(model, Mesh.build(cfg.parallel, ctx.device), cfg.parallel, lm_loss, x[:MICRO])
    stage = pipe.stages[0]
    # this stage alone on one micro-batch: forward + backward, no communication
    probe = x[:MICRO] if stage.first else torch.randn(MICRO, SEQ, width)
    alone = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        out = stage(probe)
        (lm_loss(out, x[:MICRO]) if stage.last else out.sum()).backward()
        alone.append(time.perf_counter() - start)
    t_stage = torch.tensor(min(alone[1:]))
    torch.distributed.all_reduce(t_stage, op=torch.distributed.ReduceOp.MAX)
    times, logged = [], []
    for _ in range(steps + 1):
        for param in pipe.parameters():
            param.grad = None
        torch.distributed.barrier()
        pipe.clock.take()
        start = time.perf_counter()
        pipe.step(x, x)
        times.append(time.perf_counter() - start)
        logged.append(pipe.busy_and_bubble()[1])  # the Trainer's pp_bubble of this rank
    fastest = min(range(1, steps + 1), key=times.__getitem__)
    step = times[fastest]
    mine = torch.tensor(logged[fastest])
    torch.distributed.all_reduce(mine)
    return {
        "step_s": step,
        "stage_s": float(t_stage),
        "bubble": 1.0 - micro * float(t_stage) / step,
        "logged": float(mine) / p,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--micro", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device-ms", type=float, default=0.0, help="hold each block F ms (see above)")
    args = parser.parse_args()
    rows, runs = [], []
    for p in args.stages:
        for schedule in ("gpipe", "1f1b"):
            for m in args.micro:
                if m < p:
                    continue  # parallel.microbatches ≥ pp
                r = run_ranks(worker, p, schedule, m, args.steps, args.device_ms)
                theory = (p - 1) / (m + p - 1)
                runs.append({"stages": p, "schedule": schedule, "microbatches": m, "theory": theory, **r})
                error = (r["bubble"] - theory) / theory if theory else 0.0
                rows.append(
                    [p, schedule, m, theory, r["bubble"], error, r["logged"], r["step_s"], r["stage_s"]]
                )
    headers = ["p", "schedule", "m", "theory", "measured", "rel. error", "pp_bubble", "step s", "stage s"]
    print_table(headers, rows)
    name = f"pipeline_bubble_device{args.device_ms:g}ms" if args.device_ms else "pipeline_bubble"
    write_result(name, {"device_ms": args.device_ms, "runs": runs})


if __name__ == "__main__":
    main()
