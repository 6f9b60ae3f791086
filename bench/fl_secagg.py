"""Secure aggregation vs plain FedAvg: bytes per client and time per round at 10, 50 and 100 clients.

    python bench/fl_secagg.py [--params 110000] [--clients 10 50 100] [--k 16] [--drop 0.1] [--repeat 3]

One round's upload path for a model of ``--params`` float32 parameters, measured in one process:
- plain: each client sends its update as a wire message; the server decodes and averages;
- secagg full / secagg+ (k neighbours): the four protocol stages with every message packed as it
  travels in the deployment, client work and server work timed separately, with and without
  ``--drop`` of the clients vanishing after key sharing (the server must then rebuild their masks).
Clients run in parallel in reality, so the modelled round time is the local training time of the
same-size model (measured here) + the slowest client's protocol work + the server's work.
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
from vatra.federated.secagg.channel import ClientParty
from vatra.federated.wire import decode_res, encode_res


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
    blobs = [encode_res(FitRes(c, 1, 100, u, {})) for c, u in enumerate(updates)]
    t0 = time.perf_counter()
    mean = weighted_mean([decode_res(b) for b in blobs])
    server = time.perf_counter() - t0
    return {
        "bytes_up": float(np.mean([len(b) for b in blobs])),
        "server_s": server,
        "client_s": 0.0,
        "mean": mean,
    }


class TimedParties(LocalParties):
    """Local clients whose work is timed per client (the server's time is the rest)."""

    def __init__(self, cfg: SecureAggregationConfig, inputs: Any) -> None:
        super().__init__(cfg, inputs)
        self.client_s: dict[int, float] = {}

    def deliver(self, stage: str, rnd: int, blobs: dict[int, bytes]) -> dict[int, bytes | str]:
        out: dict[int, bytes | str] = {}
        for cid, blob in blobs.items():
            party = self.parties.setdefault(cid, ClientParty(cid, self.cfg, self.inputs))
            t0 = time.perf_counter()
            out[cid] = party.respond(blob)
            self.client_s[cid] = self.client_s.get(cid, 0.0) + time.perf_counter() - t0
        return out


def secure_round(updates: list[np.ndarray], mode: str, k: int, drop: float) -> dict[str, Any]:
    n = len(updates)
    cfg = SecureAggregationConfig(enabled=True, mode=mode, neighbours=k)
    parties = TimedParties(cfg, lambda cid, n1: Quantizer(cfg.bits, cfg.clip, n1).encode(updates[cid]))
    dropped = round(drop * n)
    if dropped:
        parties.drops[(1, "masked_input")] = set(range(n - dropped, n))
    server = SecAggServer(1, cfg, list(range(n)), updates[0].size, seed=1)
    server_s = 0.0

    def timed(fn: Any, *a: Any) -> Any:
        nonlocal server_s
        t0 = time.perf_counter()
        out = fn(*a)
        server_s += time.perf_counter() - t0
        return out

    def exchange(stage: str, requests: dict[int, Any]) -> dict[int, Any]:
        """The channel: the server's share is packing requests and unpacking replies."""
        nonlocal server_s
        before = sum(parties.client_s.values())
        t0 = time.perf_counter()
        replies = parties.exchange(stage, 1, requests)
        server_s += time.perf_counter() - t0 - (sum(parties.client_s.values()) - before)
        return replies

    # the driver of secure_sum, with the server's steps timed
    replies = exchange("advertise", timed(server.advertise_requests))
    replies = exchange("share_keys", timed(server.share_keys_requests, replies))
    replies = exchange("masked_input", timed(server.masked_input_requests, replies))
    replies = exchange("unmask", timed(server.unmask_requests, replies))
    total = timed(server.finish, replies)
    survivors = range(n - dropped)
    q = Quantizer(cfg.bits, cfg.clip, n)
    err = float(
        np.abs(q.decode_sum(total) - np.sum([updates[c].astype(np.float64) for c in survivors], axis=0)).max()
    )
    assert err <= q.max_error(n), err
    senders = n - dropped
    return {
        "bytes_up": parties.bytes_up / senders,
        "bytes_down": parties.bytes_down / n,
        "server_s": server_s,
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
    args = ap.parse_args()
    torch.set_num_threads(1)
    train_s = min(train_time(args.params) for _ in range(3))
    rows, table = [], []
    for n in args.clients:
        rng = np.random.default_rng(n)
        updates = [rng.normal(0, 0.01, args.params).astype(np.float32) for _ in range(n)]
        plain = min((plain_round(updates) for _ in range(args.repeat)), key=lambda p: p["server_s"])
        plain_round_s = train_s + plain["server_s"]
        for mode, drop in [("full", 0.0), ("full", args.drop), ("secagg+", 0.0), ("secagg+", args.drop)]:
            if mode == "secagg+" and args.k >= n - 1:
                continue
            tries = [secure_round(updates, mode, args.k, drop) for _ in range(args.repeat)]
            r = {**tries[0], **{key: min(t[key] for t in tries) for key in ("client_s", "server_s")}}
            round_s = train_s + r["client_s"] + r["server_s"]
            row = {
                "clients": n,
                "mode": mode if mode == "full" else f"secagg+ k={args.k}",
                "dropped": drop,
                "plain_bytes_up": plain["bytes_up"],
                **{k: v for k, v in r.items()},
                "expansion": r["bytes_up"] / plain["bytes_up"],
                "plain_server_s": plain["server_s"],
                "round_s": round_s,
                "plain_round_s": plain_round_s,
                "round_ratio": round_s / plain_round_s,
            }
            rows.append(row)
            table.append(
                [
                    n,
                    row["mode"],
                    f"{drop:.0%}",
                    row["bytes_up"] / 1e3,
                    row["expansion"],
                    r["client_s"],
                    r["server_s"],
                    plain["server_s"],
                    round_s,
                    row["round_ratio"],
                ]
            )
            print(f"n={n} {row['mode']} drop {drop:.0%}: round {round_s:.2f} s", flush=True)
    print(
        f"\nmodel {args.params} params; local training (10 SGD steps) {train_s * 1e3:.1f} ms; "
        "shared, noisy machine"
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
            "round s",
            "round / plain",
        ],
        table,
    )
    write_result("fl_secagg", {"params": args.params, "train_s": train_s, "rows": rows})


if __name__ == "__main__":
    main()
