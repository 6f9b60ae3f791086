"""Serving the digits model: ``vatra model serve``'s micro-batching against a bare FastAPI endpoint.

    python bench/serve.py [--seconds 5] [--reps 2] [--clients 1 64] [--threads N]

A digits MLP is trained in process (vatra.fit, a few seconds), exported and loaded as a
``Predictor``. Each server runs on uvicorn in a thread of this process; the load comes from a
second process on loopback (``bench/_loadgen.py``: asyncio + httpx, closed loop, one digits row
per request, a random key per request). Rows, at each client count:

* ``bare FastAPI``: the endpoint a user would write first: a pydantic body, ``model.predict(rows)``
  per request in FastAPI's thread pool, no logs, no metrics;
* ``vatra, max-batch 1``: ``vatra model serve``'s app with batching off (one model call per request);
* ``vatra, micro-batching``: the same app at ``--max-batch 64 --max-wait-ms 5``.

All three call the same ``PredictorModel.predict``. The vatra rows also write predictions.jsonl and
Prometheus metrics. Each server is measured ``--reps`` times, the order rotated rep by rep so that
machine noise hits each alike; reported: the median rep's requests/s, latency p50/p99 and rows per
model call. Server and load generator share the machine's cores: ratios, not absolute figures, are
the result.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import torch
from pydantic import BaseModel

import vatra
from _common import print_table, write_result
from vatra.data.stratify import bundled_digits
from vatra.serve import export_run, load
from vatra.serve.app import ServeConfig, create_app, load_slots
from vatra.serve.server import running
from vatra.serve.sources import PredictorModel
from vatra.serve.split import Split

HERE = Path(__file__).resolve().parent


class Body(BaseModel):
    rows: list[dict[str, Any]]
    key: str | None = None


class OneVersion:
    """A model source with one version (the registry's part is not what is measured here)."""

    def __init__(self, model: PredictorModel) -> None:
        self.model = model

    def version(self, ref: str) -> str:
        return "bench"

    def load(self, ref: str, version: str) -> PredictorModel:
        return self.model


def train(tmp: Path) -> PredictorModel:
    cfg = {
        "run": {"progress": "off", "tensorboard": False},
        "data": {"name": "digits"},
        "model": {"name": "mlp", "hidden": [128, 128]},
        "train": {"steps": 200, "batch_size": 64, "eval_every": 0},
        "optim": {"name": "adamw", "lr": 0.003},
    }
    run = vatra.fit(cfg, run_dir=tmp / "run")
    return PredictorModel(load(export_run(run.run_dir, tmp / "model")))


def bare_app(model: PredictorModel) -> Any:
    from fastapi import FastAPI

    app = FastAPI()

    @app.post("/predict")
    def predict(body: Body) -> dict:
        return {"predictions": model.predict(body.rows)}

    return app


def vatra_app(model: PredictorModel, max_batch: int, log_dir: Path) -> Any:
    source = OneVersion(model)
    cfg = ServeConfig(split=Split.single("champion"), log_dir=log_dir, max_batch=max_batch, max_wait_ms=5.0)
    return create_app(source, cfg, load_slots(source, cfg.split), log=lambda line: None)


def batch_rows(base: str) -> float | None:
    text = httpx.get(f"{base}/metrics").text
    total = re.search(r'^vatra_serve_batch_rows_sum\{variant="champion"\} (\S+)$', text, re.M)
    calls = re.search(r'^vatra_serve_batch_rows_count\{variant="champion"\} (\S+)$', text, re.M)
    return (
        float(total.group(1)) / float(calls.group(1)) if total and calls and float(calls.group(1)) else None
    )


def measure(app: Any, clients: int, seconds: float, rows_file: Path) -> dict[str, Any]:
    with running(app) as base:
        cmd = [sys.executable, str(HERE / "_loadgen.py"), base, "--clients", str(clients)]
        cmd += ["--seconds", str(seconds), "--rows-file", str(rows_file)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        result: dict[str, Any] = json.loads(out)
        result["rows_per_call"] = batch_rows(base)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)  # process-wide: every server below runs with it
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        model = train(tmp)
        pixels, _ = bundled_digits()
        rows_file = tmp / "rows.json"
        rows_file.write_text(json.dumps([{"x": p.tolist()} for p in pixels[:256]]))
        servers = {
            "bare FastAPI": lambda: bare_app(model),
            "vatra, max-batch 1": lambda: vatra_app(model, 1, tmp / "log1"),
            "vatra, micro-batching": lambda: vatra_app(model, 64, tmp / "log64"),
        }
        names = list(servers)
        runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
        for rep in range(args.reps):
            for clients in args.clients:
                for name in names[rep % len(names) :] + names[: rep % len(names)]:
                    r = measure(servers[name](), clients, args.seconds, rows_file)
                    runs.setdefault((name, clients), []).append(r)
                    print(f"rep {rep}: {name:24s} clients={clients:3d} {r['rps']:8.1f} req/s", flush=True)
    results = []
    for (name, _), reps in sorted(runs.items(), key=lambda kv: (kv[0][1], names.index(kv[0][0]))):
        median = sorted(reps, key=lambda r: r["rps"])[len(reps) // 2]
        spread = [round(r["rps"], 1) for r in reps]
        results.append(
            {"server": name, **median, "rps_reps": spread, "rps_median": statistics.median(spread)}
        )
    table = [
        [
            r["server"],
            r["clients"],
            r["rps_median"],
            "/".join(map(str, r["rps_reps"])),
            r["p50_ms"],
            r["p99_ms"],
            r["rows_per_call"] or 1.0,
            r["errors"],
        ]
        for r in results
    ]
    print_table(
        ["server", "clients", "req/s", "reps req/s", "p50 ms", "p99 ms", "rows/call", "errors"], table
    )
    threads = torch.get_num_threads()
    write_result(
        "serve", {"seconds": args.seconds, "reps": args.reps, "torch_threads": threads, "results": results}
    )


if __name__ == "__main__":
    main()
