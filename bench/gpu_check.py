"""GPU checks, in one short run (a device is lent to some sessions only; no test needs one).

    python bench/gpu_check.py                 (CUDA; ~3 min)
    python bench/gpu_check.py --smoke         (any machine: a tiny model on the CPU, checks the script)

Mixed precision for the ``gpt`` model: fp32, bf16 and fp16 (autocast, FP32 master weights, fp16 with
the gradient scaler) through vatra's Trainer on the ``text`` source, in a rotating order: median step
time after a warm-up, peak memory (``torch.cuda.max_memory_allocated``), and the loss after the same
steps. The seed's claims to test: memory −50 %, up to 3× faster.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from _common import print_table, write_result
from vatra.config import config_from_dict
from vatra.engine import DistContext, Trainer


def gpt_config(precision: str, smoke: bool, steps: int) -> dict[str, Any]:
    size = (
        {"n_layer": 2, "n_head": 2, "n_embd": 64} if smoke else {"n_layer": 12, "n_head": 12, "n_embd": 768}
    )
    return {
        "run": {"progress": "off", "tensorboard": False},
        "data": {"name": "text", "block_size": 64 if smoke else 256, "max_chars": 200_000},
        "model": {"name": "gpt", "dropout": 0.0, **size},
        "train": {"steps": steps, "batch_size": 8 if smoke else 32, "eval_every": 0, "precision": precision},
        "optim": {"name": "adamw", "lr": 3e-4},
        "monitor": {"enabled": False},
        "checkpoint": {"enabled": False},
    }


def run_precision(precision: str, smoke: bool, steps: int, warmup: int) -> dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    cfg = config_from_dict(gpt_config(precision, smoke, steps))
    trainer = Trainer.from_config(cfg, dist=DistContext(device=device))
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, loss = [], float("nan")
    for step in range(steps):
        t0 = time.perf_counter()
        metrics = trainer.train_step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - t0)
        loss = metrics["loss"]
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else float("nan")
    fp32 = all(p.dtype == torch.float32 for p in trainer.model.parameters())
    trainer.batches.close()
    return {"s_per_step": statistics.median(times), "peak_mb": peak, "final_loss": loss, "fp32_weights": fp32}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU: checks the script only")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("error: no CUDA device here; run with --smoke to check the script on the CPU")
    precisions = ["fp32", "bf16", "fp16"]
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in precisions}
    for rep in range(args.reps):
        for p in precisions[rep % 3 :] + precisions[: rep % 3]:
            runs[p].append(run_precision(p, args.smoke, args.steps, args.warmup))
            print(p, runs[p][-1], flush=True)
    base = {k: statistics.median(r[k] for r in runs["fp32"]) for k in ("s_per_step", "peak_mb")}
    rows = []
    for p, rs in runs.items():
        step = statistics.median(r["s_per_step"] for r in rs)
        peak = statistics.median(r["peak_mb"] for r in rs)
        rows.append(
            [
                p,
                f"{1000 * step:.1f}",
                f"{base['s_per_step'] / step:.2f}×",
                f"{peak:.0f}",
                f"{peak / base['peak_mb']:.2f}" if base["peak_mb"] == base["peak_mb"] else "n/a",
                f"{statistics.median(r['final_loss'] for r in rs):.3f}",
                str(all(r["fp32_weights"] for r in rs)),
            ]
        )
    print_table(["precision", "ms/step", "speed-up", "peak MB", "vs fp32", "loss", "fp32 weights"], rows)
    device = "cpu (smoke)" if args.smoke else torch.cuda.get_device_name()
    write_result("gpu_check_smoke" if args.smoke else "gpu_check", {"device": device, "runs": runs})


if __name__ == "__main__":
    main()
