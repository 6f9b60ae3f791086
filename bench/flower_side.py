"""The Flower half of ``fl_vs_flower.py``: FedAvg on the same digits rows and partition, in Flower.

    python bench/flower_side.py --data D.npz --partition P.json --init I.pt --seed 0 --out flower.json

Runs in its own venv (torch + ``flwr[simulation]``, no vatra), so nothing here imports vatra.
What it mirrors of ``vatra federate``: the model (Linear 64→64, ReLU, Linear 64→10, with the
attribute names of vatra's MLP so vatra's initial state dict loads as is), SGD (lr, momentum, no
weight decay) made fresh for every client every round, mean cross-entropy, batch 16, one local
epoch over the client's rows, FedAvg weighted by the clients' sample counts, every client every
round, and the server's own evaluation of the global model on the val split after each round.
The Ray backend gives each ClientApp actor one CPU, so two clients train at once on 2 cores, as
vatra's two workers do. Writes the accuracy per round to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import flwr
import numpy as np
import ray
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr.simulation import run_simulation
from torch import nn

HERE = Path(__file__).resolve().parent


class DigitsMLP(nn.Module):
    """vatra's ``MLP(64, [64], 10)`` for digits: same layers, same parameter names."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(64, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(x))  # (B, 64) -> (B, 10)


_CLIENT_DATA: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor, list[np.ndarray]]] = {}


def client_data(data: str, partition: str) -> tuple[torch.Tensor, torch.Tensor, list[np.ndarray]]:
    """Train rows and shards, read once per actor process (an actor trains many clients)."""
    key = (data, partition)
    if key not in _CLIENT_DATA:
        with np.load(data) as npz:
            x = torch.from_numpy(npz["x"].astype(np.float32))
            y = torch.from_numpy(npz["y"].astype(np.int64))
        shards = [np.asarray(s, dtype=np.int64) for s in json.loads(Path(partition).read_text())]
        _CLIENT_DATA[key] = (x, y, shards)
    return _CLIENT_DATA[key]


client_app = ClientApp()


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    """One local epoch of SGD on this node's rows; replies with the weights and the sample count."""
    torch.set_num_threads(1)
    conf = msg.content["config"]
    # --same-clients: the server names the shard; else the node's own partition.
    cid = int(conf["client"]) if "client" in conf else int(context.node_config["partition-id"])
    rnd = int(conf["server-round"])
    x_all, y_all, shards = client_data(str(conf["data"]), str(conf["partition"]))
    idx = torch.from_numpy(shards[cid])
    x, y = x_all[idx], y_all[idx]
    model = DigitsMLP()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=float(conf["lr"]), momentum=float(conf["momentum"]))
    # One epoch: a seeded shuffle of the client's rows, the last batch short (DataLoader style).
    seed = int(np.random.default_rng([int(conf["seed"]), rnd, cid]).integers(2**62))
    order = torch.randperm(len(idx), generator=torch.Generator().manual_seed(seed))
    batch = int(conf["batch-size"])
    model.train()
    for start in range(0, len(idx), batch):
        b = order[start : start + batch]
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x[b]), y[b])
        loss.backward()
        opt.step()
    content = RecordDict(
        {
            "arrays": ArrayRecord(model.state_dict()),
            "metrics": MetricRecord({"train_loss": float(loss), "num-examples": len(idx)}),
        }
    )
    return Message(content=content, reply_to=msg)


class SameClientsFedAvg(FedAvg):
    """FedAvg whose sampled nodes train the shards another run selected (``rounds[r - 1]``).

    Flower samples its nodes as usual; the i-th message of round r then names shard
    ``rounds[r - 1][i]``, so both sides train the same clients and only the engines differ.
    """

    rounds: list[list[int]]  # set before start()

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> list[Message]:
        messages = list(super().configure_train(server_round, arrays, config, grid))
        chosen = self.rounds[server_round - 1]
        if len(chosen) != len(messages):
            raise SystemExit(
                f"round {server_round}: {len(messages)} nodes sampled, {len(chosen)} shards given"
            )
        return [
            Message(
                content=RecordDict({"arrays": arrays, "config": ConfigRecord({**dict(config), "client": c})}),
                message_type=m.metadata.message_type,
                dst_node_id=m.metadata.dst_node_id,
            )
            for m, c in zip(messages, chosen, strict=True)
        ]


def build_server_app(
    args: argparse.Namespace, accuracy: dict[int, float], stamps: dict[int, float]
) -> ServerApp:
    """FedAvg over every node each round; the global model is scored on the val split after each."""
    with np.load(args.data) as npz:
        x_val = torch.from_numpy(npz["x_val"].astype(np.float32))
        y_val = torch.from_numpy(npz["y_val"].astype(np.int64))
    clients = len(json.loads(Path(args.partition).read_text()))

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model = DigitsMLP()
        model.load_state_dict(arrays.to_torch_state_dict())
        model.eval()
        with torch.no_grad():
            acc = float((model(x_val).argmax(dim=1) == y_val).double().mean())
        accuracy[server_round] = acc
        stamps[server_round] = time.perf_counter()
        return MetricRecord({"accuracy": acc})

    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        # Every node each round, or --per-round of them sampled by Flower (fraction_train of the
        # available nodes, at least min_train_nodes); the server evaluates, the clients never do.
        per_round = args.per_round or clients
        strategy = (SameClientsFedAvg if args.same_clients else FedAvg)(
            fraction_train=per_round / clients,
            fraction_evaluate=0.0,
            min_train_nodes=per_round,
            min_available_nodes=clients,
        )
        config = ConfigRecord(
            {
                "data": str(Path(args.data).resolve()),
                "partition": str(Path(args.partition).resolve()),
                "seed": args.seed,
                "lr": args.lr,
                "momentum": args.momentum,
                "batch-size": args.batch_size,
            }
        )
        if args.same_clients:
            assert isinstance(strategy, SameClientsFedAvg)
            strategy.rounds = json.loads(Path(args.same_clients).read_text())
        strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(torch.load(args.init)),
            num_rounds=args.rounds,
            train_config=config,
            evaluate_fn=evaluate,
        )

    return server_app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help=".npz with x, y (train) and x_val, y_val")
    parser.add_argument("--partition", required=True, help="JSON list of per-client train row indices")
    parser.add_argument("--init", required=True, help="torch state dict of the initial global model")
    parser.add_argument("--seed", type=int, default=0, help="seeds the clients' batch order")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--per-round", type=int, default=0, help="clients trained per round; 0 = all")
    parser.add_argument(
        "--same-clients",
        default="",
        help="JSON list per round of the shards to train (another run's selection)",
    )
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--cpus-per-client", type=float, default=1.0)
    parser.add_argument("--out", required=True, help="JSON file for the accuracy per round")
    args = parser.parse_args()
    torch.set_num_threads(1)
    accuracy: dict[int, float] = {}
    stamps: dict[int, float] = {}  # perf_counter when the global model of each round was scored
    server_app = build_server_app(args, accuracy, stamps)
    # Ray pickles the ClientApp for its actors: imported under its module name (not __main__), its
    # functions travel by reference and each actor imports this file once, keeping its data cache.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    import flower_side

    t0 = time.perf_counter()
    run_simulation(
        server_app=server_app,
        client_app=flower_side.client_app,
        num_supernodes=len(json.loads(Path(args.partition).read_text())),
        backend_config={"client_resources": {"num_cpus": args.cpus_per_client, "num_gpus": 0.0}},
    )
    sim_s = time.perf_counter() - t0
    result = {
        "accuracy": [accuracy[r] for r in range(1, args.rounds + 1)],
        "initial_accuracy": accuracy.get(0),
        "round_time_s": [stamps[r] - stamps[r - 1] for r in range(1, args.rounds + 1)],
        "simulation_s": sim_s,
        "flwr": flwr.__version__,
        "ray": ray.__version__,
    }
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
