"""Cloud-edge federated sync on the digits example: bytes per round both ways and final accuracy.

    python bench/edge_fl.py [--rounds 30] [--hidden 64]

The run is ``examples/fl_digits.toml`` (FedAvg, 20 clients, 10 a round, Dirichlet α = 0.3, MLP)
eight ways, same seed: full-precision FL (the baseline); QSGD int8 uploads (``federated.compression
= "qsgd"``, the stochastic int8 compressor a user would pick before this change, no error
feedback), fp32 download; int8 uploads with per-client error feedback, fp32 download; int8 both
ways (int8 download: one fp32 scale per row); and the same with QAT on the clients (``edge.qat =
"int8"``); int8 both ways with half of the download's matrix weights cut (``federated.edge.
download_sparsity = 0.5``); and sparse uploads, top-k 1 % without error feedback (fp32 download) and with it
(int8 download). Bytes are the whole messages (safetensors headers and metrics included), per round,
mean over rounds; accuracy and loss are the server's on its held-out split after the last round,
"client acc" the clients' on their own held-out rows, scored on the model each was sent (int8 where
the download is).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import print_table, write_result
from vatra.config import load_config
from vatra.federated.simulation import simulate
from vatra.rundir import RunDir, read_jsonl

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "fl_digits.toml"
INT8_UP = ["federated.compression=int8", "federated.edge.error_feedback=true", "comm.min_numel=256"]
TOPK_UP = ["federated.compression=topk", "comm.ratio=0.01", "comm.min_numel=256"]
VARIANTS: dict[str, list[str]] = {
    "fp32 FL (baseline)": [],
    "qsgd up (peer), fp32 down": ["federated.compression=qsgd", "comm.min_numel=256"],
    "int8+EF up, fp32 down": INT8_UP,
    "int8+EF up, int8 down": [*INT8_UP, "federated.edge.download=int8"],
    "int8 both ways + QAT": [*INT8_UP, "federated.edge.download=int8", "edge.qat=int8"],
    "int8 up, int8 50 %-pruned down": [
        *INT8_UP,
        "federated.edge.download=int8",
        "federated.edge.download_sparsity=0.5",
    ],
    "topk 1% up, fp32 down": TOPK_UP,
    "topk 1%+EF up, int8 down": [
        *TOPK_UP,
        "federated.edge.error_feedback=true",
        "federated.edge.download=int8",
    ],
}


def run(overrides: list[str], folder: Path) -> dict[str, Any]:
    cfg = load_config(
        EXAMPLE, ["run.progress=off", "run.tensorboard=false", "monitor.report=false", *overrides]
    )
    t0 = time.perf_counter()
    summary = simulate(cfg, RunDir(folder), progress=False)
    rows = read_jsonl(folder / "metrics.jsonl")
    return {
        "global_accuracy": summary["global_accuracy"],
        "server_loss": summary["server_loss"],
        "client_accuracy": summary["client_accuracy"],  # scored on the model each client was sent
        "weights_sha256": summary["weights_sha256"],
        "bytes_down": statistics.mean(r["bytes_down"] for r in rows),
        "bytes_up": statistics.mean(r["bytes_up"] for r in rows),
        "wall_s": time.perf_counter() - t0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=64)
    args = ap.parse_args()
    base = [f"federated.rounds={args.rounds}", f"model.hidden=[{args.hidden}]"]
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, extra) in enumerate(VARIANTS.items()):
            results[name] = run([*base, *extra], Path(tmp) / str(i))
            print(f"{name}: {results[name]}", flush=True)
    ref = results["fp32 FL (baseline)"]
    table = [
        [
            name,
            r["bytes_down"] / 1e3,
            ref["bytes_down"] / r["bytes_down"],
            r["bytes_up"] / 1e3,
            ref["bytes_up"] / r["bytes_up"],
            r["global_accuracy"],
            r["global_accuracy"] - ref["global_accuracy"],
            r["server_loss"],
            r["client_accuracy"],
            r["wall_s"],
        ]
        for name, r in results.items()
    ]
    print(f"\nfl_digits, MLP({args.hidden}), {args.rounds} rounds, 10 of 20 clients a round")
    print_table(
        [
            "variant",
            "kB down/round",
            "× smaller",
            "kB up/round",
            "× smaller",
            "accuracy",
            "Δ vs fp32",
            "loss",
            "client acc",
            "wall s",
        ],
        table,
    )
    write_result("edge_fl", {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
