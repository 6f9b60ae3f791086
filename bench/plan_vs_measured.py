"""The planner's predicted step time against the measured one, for every feasible layout of 4 ranks.

    python bench/plan_vs_measured.py [--world 4] [--steps 8] [--warmup 3]

``--world`` gloo ranks (one thread each) first measure what the estimate is given, all at once, as
the job's ranks would compute: each rank times the gpt's blocks as ``vatra plan`` does (rank 0's
figures are used), then the link: the bus bandwidth of a 4 MiB all-reduce and the latency of an
8-byte one (medians). They then train every layout the planner calls feasible through vatra's
Trainer, one after the other on the same process group, on the same global batch
(``train.batch_size × world``): the median step time after ``--warmup`` steps (the slowest rank's).

Printed per layout: predicted and measured seconds; then the Spearman rank correlation of the two
orders, the mean relative error, and the mean error left after one common scale factor (the
geometric mean of measured / predicted), which separates a wrong order from a machine uniformly
slower than the estimate. Beside them the same from the blocks timed by this one process alone
(what ``vatra plan`` on an idle machine says): with fewer cores than ranks, as here, every rank
computes slower than one process alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from scipy.stats import spearmanr
from torch.utils.data import TensorDataset

from _common import print_table, run_ranks, write_result
from vatra.config import Config, config_from_dict
from vatra.data import DatasetSpec
from vatra.engine import DistContext, Trainer, seed_everything
from vatra.models import build_model
from vatra.parallel.plan import VOCAB, Costs, Estimate, measure, plan

SEQ = 64


def base_config(world: int, parallel: dict[str, Any] | None = None) -> Config:
    """The gpt the planner measures; with ``parallel``, per-rank batches that keep the global one."""
    raw: dict[str, Any] = {
        "run": {"progress": "off", "tensorboard": False},
        "data": {"block_size": SEQ},
        "model": {"name": "gpt", "n_layer": 4, "n_head": 4, "n_embd": 128, "dropout": 0.0},
        "train": {"steps": 1, "batch_size": 8, "eval_every": 0, "task": "lm"},
        "optim": {"name": "adamw", "lr": 1e-3},
        "parallel": {"schedule": "1f1b", **(parallel or {})},
    }
    cfg = config_from_dict(raw)
    if parallel is not None:
        data_world = cfg.parallel.dp * cfg.parallel.fsdp
        cfg.train.batch_size = cfg.train.batch_size * world // data_world
    return cfg


def all_reduce_s(numel: int, repeats: int) -> float:
    """Median seconds of an all-reduce of ``numel`` fp32 values (after one to warm the connections)."""
    buf = torch.zeros(numel)
    dist.all_reduce(buf)
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def link() -> tuple[float, float]:
    """(bus bandwidth in bytes/s of a 4 MiB ring all-reduce: 2·(n − 1)/n of it moved, its latency
    taken off; seconds of an 8-byte all-reduce)."""
    n = dist.get_world_size()
    latency = all_reduce_s(2, 21)
    numel = 2**20
    return 2 * (n - 1) / n * numel * 4 / max(all_reduce_s(numel, 7) - latency, 1e-9), latency


def worker(ctx: DistContext, layouts: list[dict[str, int]], steps: int, warmup: int) -> dict[str, Any]:
    world = ctx.world_size
    costs = measure(base_config(world))  # every rank at once, as they will compute; rank 0's is kept
    dist.barrier()
    bandwidth, latency = link()
    out: dict[str, Any] = {
        "costs": dataclasses.asdict(costs),
        "bandwidth": bandwidth,
        "latency": latency,
        "steps": {},
    }
    spec = DatasetSpec(kind="lm", input_shape=(SEQ,), num_classes=VOCAB)
    for layout in layouts:
        cfg = base_config(world, layout)
        cfg.train.steps = steps
        n = steps * cfg.train.batch_size * cfg.parallel.dp * cfg.parallel.fsdp
        tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=torch.Generator().manual_seed(1))
        seed_everything(0)
        model = build_model(cfg.model, spec)
        trainer = Trainer(cfg, model, TensorDataset(tokens[:, :-1], tokens[:, 1:]), None, spec, dist=ctx)
        times = []
        for _ in range(steps):
            dist.barrier()
            t0 = time.perf_counter()
            trainer.train_step()
            times.append(torch.tensor(time.perf_counter() - t0))
        trainer.batches.close()
        slowest = torch.stack(times)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank does
        key = "x".join(str(layout[k]) for k in ("dp", "fsdp", "tp", "pp"))
        out["steps"][key] = statistics.median(slowest[warmup:].tolist())
    return out


def compare(ranked: list[Estimate], measured: dict[str, float]) -> dict[str, Any]:
    """Predicted against measured seconds of the feasible layouts: ρ, mean error, scaled error."""
    keys = [f"{e.dp}x{e.fsdp}x{e.tp}x{e.pp}" for e in ranked if e.feasible]
    pred = [e.step_s for e in ranked if e.feasible]
    meas = [measured[k] for k in keys]
    scale = math.exp(statistics.mean(math.log(m / p) for m, p in zip(meas, pred, strict=True)))
    return {
        "keys": keys,
        "predicted": pred,
        "spearman": float(spearmanr(pred, meas).statistic),
        "mean_error": statistics.mean(abs(m - p) / m for p, m in zip(pred, meas, strict=True)),
        "scale": scale,
        "mean_error_scaled": statistics.mean(abs(m - scale * p) / m for p, m in zip(pred, meas, strict=True)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as each rank runs
    cfg = base_config(args.world)
    alone = measure(cfg)  # this process alone: what `vatra plan` measures
    first = plan(alone, cfg, args.world, bandwidth=1e9)  # which layouts are feasible (not timing)
    feasible = [{"dp": e.dp, "fsdp": e.fsdp, "tp": e.tp, "pp": e.pp} for e in first if e.feasible]
    measured = run_ranks(worker, args.world, feasible, args.steps, args.warmup)
    link_kw = {"bandwidth": measured["bandwidth"], "latency": measured["latency"]}
    ranks_costs = Costs(**measured["costs"])
    results = {
        "ranks": compare(plan(ranks_costs, cfg, args.world, **link_kw), measured["steps"]),
        "alone": compare(plan(alone, cfg, args.world, **link_kw), measured["steps"]),
    }
    by_layout = {k: p for k, p in zip(results["alone"]["keys"], results["alone"]["predicted"], strict=True)}
    rows = []
    main_ = results["ranks"]
    for k, p in zip(main_["keys"], main_["predicted"], strict=True):
        m = measured["steps"][k]
        rows.append([k, p, m, m / p, abs(m - main_["scale"] * p) / m, by_layout[k]])
    headers = [
        "dp x fsdp x tp x pp",
        "predicted s",
        "measured s",
        "ratio",
        "error scaled",
        "predicted alone s",
    ]
    print_table(headers, rows)
    print(
        f"{len(rows)} feasible layouts of {args.world} ranks; link {measured['bandwidth'] / 1e9:.3g} GB/s, "
        f"{measured['latency'] * 1e6:.0f} µs a message, measured; blocks "
        f"{sum(ranks_costs.block_s) * 1e3:.1f} ms (ranks at once), {sum(alone.block_s) * 1e3:.1f} ms alone"
    )
    for name, r in results.items():
        print(
            f"blocks timed {name}: Spearman ρ = {r['spearman']:.2f}; mean error {r['mean_error']:.0%}; "
            f"common scale {r['scale']:.2f}, then {r['mean_error_scaled']:.0%}"
        )
    write_result(
        "plan_vs_measured",
        {"world": args.world, "link": link_kw, "measured_s": measured["steps"], "results": results},
    )


if __name__ == "__main__":
    main()
