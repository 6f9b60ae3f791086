"""Helpers shared by the benchmarks: spawning gloo ranks on one machine, tables and JSON results."""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

RESULTS = Path(__file__).resolve().parent / "results"


def _entry(rank: int, fn: Callable[..., Any], world: int, init_file: str, out_dir: str, args: tuple) -> None:
    import torch.distributed as dist

    from vatra.config import DistConfig
    from vatra.engine import DistContext

    torch.set_num_threads(1)
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    ctx = DistContext.init(DistConfig(), rank=rank, world_size=world, init_method=f"file://{init_file}")
    try:
        result = fn(ctx, *args)
        if rank == 0:
            (Path(out_dir) / "result.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        ctx.destroy()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any) -> Any:
    """Run ``fn(ctx, *args)`` on ``world`` gloo ranks (file rendezvous); return rank 0's JSON result."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _entry, args=(fn, world, f"{tmp}/rdzv", tmp, args), nprocs=world, start_method="spawn"
        )
        return json.loads((Path(tmp) / "result.json").read_text())


def machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _fmt(c: Any) -> str:
    if isinstance(c, float):
        return f"{c:,.0f}" if abs(c) >= 1000 else f"{c:.4g}"
    return str(c)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print(" | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    print("-|-".join("-" * w for w in widths))
    for row in cells:
        print(" | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))


def write_result(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2) + "\n")
    print(f"wrote {path}")
    return path
