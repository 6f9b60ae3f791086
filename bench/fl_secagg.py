"""Secure aggregation vs plain FedAvg: bytes per client and time per round at 10, 50 and 100 clients.

    python bench/fl_secagg.py [--params 110000] [--clients 10 50 100] [--k 16] [--drop 0.1] [--repeat 3]
                              [--prg aes-ctr|chacha20]

One round's upload path for a model of ``--params`` float32 parameters, measured in one process:
- plain: each client sends its update as a wire message; the server does what vatra's FedAvg
  server does with it (``wire.decode_res``, which reads the update as a read-only view of the
  message, as the secure-aggregation messages are read; the dtype/shape/finiteness check;
  the sample-weighted mean in float64);
- secagg full / secagg+ (k neighbours): the four protocol stages with every message packed as it
  travels in the deployment, client work and server work timed separately, with and without
  ``--drop`` of the clients vanishing after key sharing (the server must then rebuild their masks);
  the server's time ends with the dequantized sum, as the FedAvg server uses it.
Clients run in parallel in reality, so the modelled round time is the local training time of the
same-size model (measured here) + the slowest client's protocol work + the server's work.
Tries of every case are interleaved with plain tries, each timing is the fastest of its tries, and
the server's CPU time (process time, which excludes time the process waits for a core) is taken
beside its wall time: on a shared machine its ratio is the steadier of the two.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import torch

from _common import print_table, write_result
from vatra.config import SecureAggregationConfig
from vatra.federated._base import FitRes, weighted_mean
from vatra.federated.secagg import LocalParties, Quantizer, SecAggServer
from vatra.federated.wire import check_update, decode_res, encode_res

PLAIN = "wire.decode_res (read-only views of the messages) + check_update + weighted_mean"


def train_time(params: int, steps: int = 10, batch: int = 32) -> float:
    """Local SGD steps of an MLP with ≈ ``params`` weights on 64 inputs (digits-sized)."""
    hidden = params // (64 + 10)
    model = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(batch, 64), torch.randint(0, 10, (batch,))
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return time.perf_counter() - t0


def plain_round(updates: list[np.ndarray]) -> dict[str, Any]:
    """What the FedAvg server does with the uploads."""
    blobs = [encode_res(FitRes(c, 1, 100, u, {})) for c, u in enumerate(updates)]
    t0, c0 = time.perf_counter(), time.process_time()
    results = [decode_res(b) for b in blobs]
    if any(check_update(r, updates[0].size) for r in results):
        raise AssertionError("a plain update failed the server's check")
    mean = weighted_mean(results)
    server, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "bytes_up": float(np.mean([len(b) for b in blobs])),
        "server_s": server,
        "server_cpu_s": cpu,
        "client_s": 0.0,
        "mean": mean,
    }


class TimedParties(LocalParties):
    """Local clients whose work is timed per client (the server's time is the rest)."""

    def __init__(self, cfg: SecureAggregationConfig, inputs: Any) -> None:
        super().__init__(cfg, inputs)
        self.client_s: dict[int, float] = {}
        self.client_cpu = 0.0

    def deliver(self, stage: str, rnd: int, blobs: dict[int, bytes]) -> dict[int, bytes | str]:
        out: dict[int, bytes | str] = {}
        for cid, blob in blobs.items():
            party = self._party(cid)
            t0, c0 = time.perf_counter(), time.process_time()
            out[cid] = party.respond(blob)
            self.client_s[cid] = self.client_s.get(cid, 0.0) + time.perf_counter() - t0
            self.client_cpu += time.process_time() - c0
        return out


def secure_round(updates: list[np.ndarray], mode: str, k: int, drop: float, prg: str) -> dict[str, Any]:
    n = len(updates)
    cfg = SecureAggregationConfig(enabled=True, mode=mode, neighbours=k, prg=prg)
    parties = TimedParties(cfg, lambda cid, n1: Quantizer(cfg.bits, cfg.clip, n1).encode(updates[cid]))
    parties.trained(1, range(n))
    dropped = round(drop * n)
    if dropped:
        parties.drops[(1, "masked_input")] = set(range(n - dropped, n))
    server = SecAggServer(1, cfg, list(range(n)), updates[0].size, seed=1)
    server_s = server_cpu = 0.0

    def timed(fn: Any, *a: Any) -> Any:
        nonlocal server_s, server_cpu
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn(*a)
        server_s += time.perf_counter() - t0
        server_cpu += time.process_time() - c0
        return out

    def exchange(stage: str, requests: dict[int, Any]) -> dict[int, Any]:
        """The channel: the server's share is packing requests and unpacking replies."""
        nonlocal server_s, server_cpu
        before, before_cpu = sum(parties.client_s.values()), parties.client_cpu
        t0, c0 = time.perf_counter(), time.process_time()
        replies = parties.exchange(stage, 1, requests)
        server_s += time.perf_counter() - t0 - (sum(parties.client_s.values()) - before)
        server_cpu += time.process_time() - c0 - (parties.client_cpu - before_cpu)
        return replies

    # the driver of secure_sum, with the server's steps timed
    replies = exchange("advertise", timed(server.advertise_requests))
    replies = exchange("share_keys", timed(server.share_keys_requests, replies))
    replies = exchange("masked_input", timed(server.masked_input_requests, replies))
    replies = exchange("unmask", timed(server.unmask_requests, replies))
    total = timed(server.finish, replies)
    q = Quantizer(cfg.bits, cfg.clip, n)
    summed = timed(q.decode_sum, total)  # dequantized: what the FedAvg server divides by the weight
    survivors = range(n - dropped)
    err = float(np.abs(summed - np.sum([updates[c].astype(np.float64) for c in survivors], axis=0)).max())
    assert err <= q.max_error(n), err
    senders = n - dropped
    return {
        "bytes_up": parties.bytes_up / senders,
        "bytes_down": parties.bytes_down / n,
        "server_s": server_s,
        "server_cpu_s": server_cpu,
        "client_s": max(parties.client_s.values()),
        "threshold": server.t,
        "max_abs_error": err,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=110_000)
    ap.add_argument("--clients", type=int, nargs="+", default=[10, 50, 100])
    ap.add_argument("--k", type=int, default=16, help="secagg+ neighbours")
    ap.add_argument("--drop", type=float, default=0.1, help="share of clients dropping after key sharing")
    ap.add_argument("--repeat", type=int, default=3, help="timings: the fastest of this many runs")
    ap.add_argument("--prg", choices=["aes-ctr", "chacha20"], default="aes-ctr", help="mask expansion")
    args = ap.parse_args()
    torch.set_num_threads(1)
    train_s = min(train_time(args.params) for _ in range(3))
    rows: list[dict[str, Any]] = []
    for n in args.clients:
        rng = np.random.default_rng(n)
        updates = [rng.normal(0, 0.01, args.params).astype(np.float32) for _ in range(n)]
        cases = [("full", 0.0), ("full", args.drop), ("secagg+", 0.0), ("secagg+", args.drop)]
        cases = [(m, d) for m, d in cases if m == "full" or args.k < n - 1]
        # interleaved: every try of a case sits next to a plain try and a training try, so the
        # fastest-of-N of each spans the same stretches of a noisy, shared machine
        plains: list[dict[str, Any]] = []
        secure: dict[tuple[str, float], list[dict[str, Any]]] = {c: [] for c in cases}
        for _ in range(args.repeat):
            for case in cases:
                plains.append(plain_round(updates))
                train_s = min(train_s, train_time(args.params))
                secure[case].append(secure_round(updates, case[0], args.k, case[1], args.prg))
        plain = min(plains, key=lambda p: p["server_s"])
        plain_cpu = min(p["server_cpu_s"] for p in plains)
        for mode, drop in cases:
            tries = secure[(mode, drop)]
            fastest = ("client_s", "server_s", "server_cpu_s")
            r = {**tries[0], **{key: min(t[key] for t in tries) for key in fastest}}
            rows.append(
                {
                    "clients": n,
                    "mode": mode if mode == "full" else f"secagg+ k={args.k}",
                    "dropped": drop,
                    "plain_bytes_up": plain["bytes_up"],
                    **r,
                    "expansion": r["bytes_up"] / plain["bytes_up"],
                    "plain_server_s": plain["server_s"],
                    "server_ratio": r["server_s"] / plain["server_s"],
                    "plain_server_cpu_s": plain_cpu,
                    "server_cpu_ratio": r["server_cpu_s"] / plain_cpu,
                }
            )
            print(
                f"n={n} {rows[-1]['mode']} drop {drop:.0%}: server {r['server_s'] * 1e3:.1f} ms "
                f"= {rows[-1]['server_ratio']:.2f}x plain (CPU time: {r['server_cpu_s'] * 1e3:.1f} ms "
                f"= {rows[-1]['server_cpu_ratio']:.2f}x plain)",
                flush=True,
            )
    for row in rows:  # clients run in parallel: training + the slowest client + the server
        row["round_s"] = train_s + row["client_s"] + row["server_s"]
        row["plain_round_s"] = train_s + row["plain_server_s"]
        row["round_ratio"] = row["round_s"] / row["plain_round_s"]
    table = [
        [
            row["clients"],
            row["mode"],
            f"{row['dropped']:.0%}",
            row["bytes_up"] / 1e3,
            row["expansion"],
            row["client_s"],
            row["server_s"],
            row["plain_server_s"],
            row["server_ratio"],
            row["server_cpu_s"],
            row["plain_server_cpu_s"],
            row["server_cpu_ratio"],
            row["round_s"],
            row["round_ratio"],
        ]
        for row in rows
    ]
    print(
        f"\nmodel {args.params} params; PRG {args.prg}; local training (10 SGD steps) {train_s * 1e3:.1f} ms"
    )
    print_table(
        [
            "clients",
            "mode",
            "drop",
            "kB up/client",
            "expansion",
            "client s",
            "server s",
            "plain server s",
            "server / plain",
            "server CPU s",
            "plain CPU s",
            "server / plain (CPU)",
            "round s",
            "round / plain",
        ],
        table,
    )
    name = "fl_secagg" if args.prg == "aes-ctr" else f"fl_secagg_{args.prg}"
    write_result(
        name, {"params": args.params, "prg": args.prg, "plain": PLAIN, "train_s": train_s, "rows": rows}
    )


if __name__ == "__main__":
    main()
