"""The Ray backend's overhead: one run in process, on a local Ray, and on a local 2-node Ray cluster.

    python bench/fl_ray.py [--clients 1000] [--per-round 50] [--rounds 4] [--steps 5]

FedAvg, random selection, ``--steps`` local SGD steps (batch 16, momentum 0.9) of an MLP(64) on a
synthetic 16-feature, 10-class set split IID, evaluation sampled (20 clients) every round. The
same config (seed 0) runs three ways, one after the other in this process:

- ``inprocess``: the embedded default, every client in this process (vmapped);
- ``ray local``: ``federated.backend = "ray"``, 2 actors on a local Ray the run starts and stops;
- ``ray 2-node``: the same 2 actors on a cluster of two ``ray start`` processes of one CPU each
  (``--head --port=<free>`` and ``--address=HEAD``, started here and stopped at the end).

Whole = the simulate() call (Ray start-up and actors included); round = median of rounds 2..R
(round 1 warms up). The final weights' hash must agree across the three.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import print_table, write_result
from vatra.config import config_from_dict
from vatra.federated.simulation import simulate
from vatra.rundir import RunDir, read_jsonl

RAY = str(Path(sys.executable).with_name("ray"))


def config(args: argparse.Namespace, **fed: Any) -> Any:
    return config_from_dict(
        {
            "run": {"seed": 0, "progress": "off", "tensorboard": False},
            "monitor": {"report": False},
            "data": {"name": "synthetic", "samples": 20_000, "n_features": 16, "informative": 8},
            "model": {"name": "mlp", "hidden": [64]},
            "train": {"batch_size": 16},
            "optim": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
            "federated": {
                "rounds": args.rounds,
                "clients": args.clients,
                "clients_per_round": args.per_round,
                "local_steps": args.steps,
                "evaluate_clients": 20,
                "partition": {"method": "iid"},
                **fed,
            },
        }
    )


def timed(name: str, cfg: Any, out: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    summary = simulate(cfg, RunDir(out / name.replace(" ", "-")), progress=False)
    whole = time.perf_counter() - t0
    rows = read_jsonl(out / name.replace(" ", "-") / "metrics.jsonl")
    rounds = [r["round_time_s"] for r in rows[1:]] or [rows[0]["round_time_s"]]
    return {
        "backend": name,
        "whole_s": whole,
        "round_s": statistics.median(rounds),
        "accuracy": rows[-1].get("global_accuracy"),
        "weights_sha256": summary["weights_sha256"],
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def two_node_cluster(env: dict[str, str]) -> str:
    """Start a head and a second node of one CPU each on this machine; the head's address."""
    address = f"127.0.0.1:{free_port()}"
    head = [RAY, "start", "--head", f"--port={address.split(':')[1]}", "--num-cpus=1"]
    node = [RAY, "start", f"--address={address}", "--num-cpus=1", "--disable-usage-stats"]
    for cmd in ([*head, "--include-dashboard=false", "--disable-usage-stats"], node):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"error: {' '.join(cmd[1:])} failed:\n{done.stderr[-2000:]}")
    return address


def stop_cluster(ray_tmp: str) -> None:
    """End the processes of the cluster started here, by pid: those whose command line names its
    session folder (``ray stop`` would end every Ray on the machine, other users' too)."""

    def ours() -> list[int]:
        pids = []
        for proc in Path("/proc").iterdir():
            try:
                cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
                if proc.name.isdigit() and ray_tmp in cmdline:
                    pids.append(int(proc.name))
            except OSError:
                continue
        return pids

    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in ours():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + 10
        while ours() and time.monotonic() < deadline:
            time.sleep(0.2)
    left = ours()
    print(f"ray cluster stopped; processes left: {len(left)}")
    shutil.rmtree(ray_tmp, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--per-round", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    ray_tmp = tempfile.mkdtemp(prefix="vr-", dir="/tmp")  # short: Ray's socket paths live under it
    src = str(Path(__file__).resolve().parents[1] / "src")
    os.environ.update(RAY_TMPDIR=ray_tmp, RAY_USAGE_STATS_ENABLED="0")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        results.append(timed("inprocess", config(args), out))
        results.append(timed("ray local", config(args, backend="ray", workers=2), out))
        try:
            address = two_node_cluster(dict(os.environ))
            import ray

            ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR)
            nodes = sum(1 for n in ray.nodes() if n["Alive"])
            ray.shutdown()  # the run joins the cluster itself
            cfg = config(args, backend="ray", workers=2, ray_address=address)
            results.append(timed("ray 2-node", cfg, out) | {"nodes": nodes})
        finally:
            stop_cluster(ray_tmp)

    base = results[0]
    rows = [
        [
            r["backend"],
            r["whole_s"],
            r["whole_s"] / base["whole_s"],
            r["round_s"],
            r["round_s"] / base["round_s"],
            r["accuracy"],
            r["weights_sha256"] == base["weights_sha256"],
        ]
        for r in results
    ]
    print(
        f"{args.clients} clients, {args.per_round} a round, {args.rounds} rounds, {args.steps} steps, "
        f"MLP(64), cpus {os.cpu_count()}"
    )
    print_table(["backend", "whole s", "× inproc", "round s", "× inproc", "accuracy", "same weights"], rows)
    write_result("fl_ray", {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
