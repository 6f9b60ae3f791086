"""``energy`` part of bench/gpu_check.py: a Zeus-style search over GPU power limit × batch size.

Zeus (You et al., NSDI 2023) picks the batch size and power limit that minimise
``η · energy-to-target + (1 − η) · max power · time-to-target``. Here each (limit, batch) pair trains
a fresh MLP on a fixed, learnable synthetic task (labels = argmax of a random projection) until the
training loss reaches the target (or a step cap), with the GPU's energy read from NVML's total-energy
counter (:class:`vatra.monitor.energy.NvmlMeter`, so the reader runs on a real GPU here) and the
time from the wall clock after a synchronise. The table gives every pair's energy and time to target
and the one Zeus would choose, against the default (the largest limit, the base batch size).

Power limits are changed only with ``--energy-set-limits`` (it needs root, and changes a setting of
the device: it is restored afterwards); without it every batch size runs at the current limit. On the
CPU (``--smoke``) the same sweep runs with the labelled estimate instead of NVML and no limits: it
checks the script, not the figures.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from vatra.monitor.energy import EnergyMeter, EstimateMeter, NvmlMeter

FEATURES, CLASSES = 256, 16


def task(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, FEATURES, generator=g)
    y = (x @ torch.randn(FEATURES, CLASSES, generator=g)).argmax(1)
    return x.to(device), y.to(device)


def to_target(
    batch: int, args: argparse.Namespace, device: torch.device, meter: EnergyMeter
) -> dict[str, Any]:
    """Train until the loss over the last 10 steps is at or below the target: joules, seconds, steps."""
    torch.manual_seed(0)
    hidden = 64 if args.smoke else 4096
    model = nn.Sequential(
        nn.Linear(FEATURES, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, CLASSES),
    ).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = task(2_000 if args.smoke else 200_000, device)
    g = torch.Generator(device=device).manual_seed(1)
    last = float("inf")
    if device.type == "cuda":
        torch.cuda.synchronize()
    j0, t0 = meter.read_j(), time.perf_counter()
    steps, cap = 0, 20 if args.smoke else args.energy_max_steps
    for steps in range(1, cap + 1):
        idx = torch.randint(0, len(y), (batch,), device=device, generator=g)
        loss = F.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if steps % 10 == 0:  # a sync point every 10 steps, not every step
            last = float(loss.detach())
            if last <= args.energy_target:
                break
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds, joules = time.perf_counter() - t0, meter.read_j() - j0
    reached = last <= args.energy_target
    return {"batch": batch, "steps": steps, "seconds": seconds, "joules": joules, "reached": reached}


def power_limits(gpu: NvmlMeter, sweep: bool) -> tuple[int, list[int]]:
    """The current limit (mW) and the limits to try: it alone, or 4 from the maximum down to half of it
    (below that, steps slow down past any saving) or the minimum if higher."""
    current = int(gpu.nvml.nvmlDeviceGetPowerManagementLimit(gpu.handle))
    if not sweep:
        return current, [current]
    lo, hi = (int(v) for v in gpu.nvml.nvmlDeviceGetPowerManagementLimitConstraints(gpu.handle))
    lo = max(lo, hi // 2)
    return current, [int(hi - i * (hi - lo) / 3) for i in range(4)]


def check_energy(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    gpu = NvmlMeter(device.index or 0) if device.type == "cuda" else None
    meter: EnergyMeter = gpu if gpu is not None else EstimateMeter()
    current, limits = power_limits(gpu, args.energy_set_limits) if gpu is not None else (0, [0])
    runs: list[dict[str, Any]] = []
    try:
        for limit in limits:
            if gpu is not None and args.energy_set_limits:
                gpu.nvml.nvmlDeviceSetPowerManagementLimit(gpu.handle, limit)
            for batch in [16, 32] if args.smoke else args.energy_batches:
                r = {"limit_w": limit / 1000 if gpu else None, **to_target(batch, args, device, meter)}
                runs.append(r)
                print(f"  limit {r['limit_w']} W, batch {batch}: {r['joules']:.0f} J, {r['seconds']:.1f} s")
    finally:
        if gpu is not None and args.energy_set_limits:
            gpu.nvml.nvmlDeviceSetPowerManagementLimit(gpu.handle, current)  # as it was
        meter.close()
    # Zeus's cost: η·energy + (1 − η)·max power·time; on the CPU (no limit) energy alone
    max_w, eta = max(r["limit_w"] or 0.0 for r in runs), args.energy_eta
    for r in runs:
        r["zeus_cost"] = eta * r["joules"] + (1 - eta) * max_w * r["seconds"]
    reached = [r for r in runs if r["reached"]]
    best = min(reached, key=lambda r: r["zeus_cost"]) if reached else None
    base = runs[0]  # the first batch size at the largest (or current) limit
    return {
        "source": meter.source,
        "limits_set": bool(args.energy_set_limits and gpu is not None),
        "eta": eta,
        "runs": runs,
        "chosen": best,
        "energy_vs_default": best["joules"] / base["joules"] if best and base["joules"] > 0 else None,
        "passed": bool(runs) and all(r["joules"] >= 0 for r in runs),
    }


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--energy-batches", type=int, nargs="+", default=[256, 512, 1024, 2048])
    ap.add_argument("--energy-target", type=float, default=0.5, help="energy: training loss to reach")
    ap.add_argument("--energy-max-steps", type=int, default=3000, help="energy: step cap per pair")
    ap.add_argument("--energy-eta", type=float, default=0.5, help="energy: Zeus's weight of energy vs time")
    ap.add_argument(
        "--energy-set-limits", action="store_true", help="energy: sweep power limits (root; restored after)"
    )
