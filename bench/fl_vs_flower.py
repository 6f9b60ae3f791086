"""vatra vs Flower, side by side: FedAvg on non-IID digits, accuracy per round and the whole command's time.

    make bench-flower
    .venv/bin/python bench/fl_vs_flower.py [--seeds 0 1 2] [--rounds 30] [--flower-python PATH]
    .venv/bin/python bench/fl_vs_flower.py --clients 1000 --per-round 100 --same-clients --seeds 0  # issue 41

20 clients with label skew (Dirichlet alpha 0.1), FedAvg weighted by sample counts, every client
every round, one local epoch (⌈n_c / 16⌉ SGD steps, the last batch short), 30 rounds. For each
seed this script writes one ``.npz`` (digits' stratified train/val split of that seed: x, y, x_val,
y_val), one partition file (20 lists of train-row indices) and the initial global model, and both
sides read those same files:

- **vatra**: ``vatra federate examples/fl_digits.toml --set ...`` with ``data.name = "npz"``
  (standardize off: the rows are used as written) and ``federated.partition.method = "file"``,
  once per ``--vatra-workers`` value: ``federated.workers = 1`` (the default: every client trained
  in the command's own process) and ``= 2`` (a pool of spawned processes). A seed gives the same
  accuracy for any worker count, so only the time differs.
- **Flower**: ``bench/flower_side.py`` run by ``--flower-python``, a venv of its own with torch and
  ``flwr[simulation]`` (Ray): the same MLP, loaded with the same initial weights, SGD, loss and
  batch size; 20 virtual SuperNodes, one CPU per ClientApp actor (two at a time on 2 cores), the
  server's own evaluation on the val split.

``--clients 1000 --per-round 100`` (issue 41) keeps all of the above but trains 100 clients a
round, drawn uniformly each round by each side (vatra's ``selection = "random"`` with
``clients_per_round``, Flower's FedAvg ``fraction_train = 0.1`` with ``min_train_nodes = 100``;
the two draw different clients unless ``--same-clients``: then vatra runs first and Flower's i-th
sampled node of round r trains the i-th client vatra selected in round r). Digits' ~1,400 train
rows give each of 1,000 clients 1–3 rows (the partition never leaves one empty), so one local
epoch is one SGD step on both sides. Evaluation is the server's on the val split on both sides
(clients hold out nothing: ``val_fraction = 0``, ``fraction_evaluate = 0``).

The two differ only in the order of each client's batches (each side seeds its own shuffle), so
the accuracy figures are given as the mean and the min–max over seeds. The wall time is the whole
command, from start to exit (imports, worker or Ray start-up, the run, vatra's report), measured
from here around the subprocess; the two sides run one after the other, in alternating order.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from _common import print_table, write_result
from vatra.config import Config, config_from_dict, load_config
from vatra.data import build_dataset, partition
from vatra.federated.client import initial_weights
from vatra.rundir import read_jsonl

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TARGETS = (0.80, 0.85)
EXAMPLE = "examples/fl_digits.toml"


def vatra_overrides(seed: int, workers: int, args: argparse.Namespace, paths: dict[str, Path]) -> list[str]:
    """The ``--set`` values that turn the example into this benchmark's run."""
    overrides = {
        "run.seed": seed,
        "data.name": "npz",
        "data.path": str(paths["data"]),
        "data.standardize": False,
        "federated.strategy": "fedavg",
        "federated.rounds": args.rounds,
        "federated.clients": args.clients,
        # --per-round 0: every client every round; N: N drawn uniformly (seeded) each round, as Flower's
        # FedAvg samples fraction_train of the nodes.
        "federated.selection": "random" if args.per_round else "all",
        "federated.clients_per_round": args.per_round,
        "federated.local_epochs": 1,
        "federated.val_fraction": 0,
        "federated.partition.method": "file",
        "federated.partition.file": str(paths["partition"]),
        "federated.workers": workers,
    }
    return [f"{k}={json.dumps(v)}" for k, v in overrides.items()]


def vatra_command(
    seed: int, workers: int, args: argparse.Namespace, paths: dict[str, Path], run_dir: Path
) -> list[str]:
    sets = [a for s in vatra_overrides(seed, workers, args, paths) for a in ("--set", s)]
    vatra = Path(sys.executable).parent / "vatra"
    return [str(vatra), "federate", EXAMPLE, "--run-dir", str(run_dir), *sets]


def local_training(cfg: Config) -> dict[str, float | int]:
    """The local-training settings Flower's side is given, after checking it implements all of them."""
    o, t, m = cfg.optim, cfg.train, cfg.model
    plain = (o.name, o.weight_decay, o.schedule, o.warmup_steps) == ("sgd", 0.0, "constant", 0)
    plain &= (t.clip_grad_norm, t.label_smoothing, t.class_weights, t.grad_accum) == (0.0, 0.0, [], 1)
    if not plain or (m.name, m.hidden, m.dropout) != ("mlp", [64], 0.0):
        sys.exit(f"{EXAMPLE}: flower_side.py mirrors plain SGD on MLP(64) only; it has {o}, {t}, {m}")
    return {"lr": o.lr, "momentum": o.momentum, "batch_size": t.batch_size}


def write_inputs(seed: int, args: argparse.Namespace, folder: Path) -> tuple[dict[str, Path], Config]:
    """The seed's data split, partition and initial weights, as files both sides read."""
    train, val, _ = build_dataset(config_from_dict({"data": {"name": "digits"}}).data, seed)
    paths = {
        "data": folder / "digits.npz",
        "partition": folder / "partition.json",
        "init": folder / "init.pt",
    }
    np.savez(paths["data"], x=train.x.numpy(), y=train.y.numpy(), x_val=val.x.numpy(), y_val=val.y.numpy())
    shards = partition(len(train), train.y.numpy(), args.clients, "dirichlet", seed=seed, alpha=args.alpha)
    paths["partition"].write_text(json.dumps([s.tolist() for s in shards]))
    # The very config vatra federate loads, so the initial model is the one it starts from.
    cfg = load_config(ROOT / EXAMPLE, vatra_overrides(seed, 1, args, paths))
    _, _, spec = build_dataset(cfg.data, seed)
    model, _, _ = initial_weights(cfg, spec)
    torch.save(model.state_dict(), paths["init"])
    return paths, cfg


def flower_command(
    seed: int, args: argparse.Namespace, paths: dict[str, Path], cfg: Config, out: Path
) -> list[str]:
    local = [a for k, v in local_training(cfg).items() for a in (f"--{k.replace('_', '-')}", str(v))]
    return [
        args.flower_python,
        str(HERE / "flower_side.py"),
        *("--data", str(paths["data"]), "--partition", str(paths["partition"]), "--init", str(paths["init"])),
        *("--seed", str(seed), "--rounds", str(args.rounds), "--per-round", str(args.per_round)),
        *(*local, "--out", str(out)),
        *(("--same-clients", str(out.parent / "selected.json")) if args.same_clients else ()),
    ]


def timed(cmd: list[str], log: Path) -> float:
    """Wall seconds of the whole command, start to exit; its output goes to ``log``."""
    with log.open("w") as f:
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, check=False)
        wall = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(f"{shlex.join(cmd)} exited with {proc.returncode}; its output:\n{log.read_text()[-4000:]}")
    return wall


def scores(accuracy: list[float], round_time_s: list[float], wall_s: float) -> dict[str, Any]:
    """Rounds to each target, mean and final accuracy, and where the command's time went."""
    out: dict[str, Any] = {
        f"rounds_to_{round(t * 100)}": next((r for r, a in enumerate(accuracy, 1) if a >= t), None)
        for t in TARGETS
    }
    out.update(mean_accuracy=statistics.fmean(accuracy), final_accuracy=accuracy[-1], wall_s=wall_s)
    # Round 1 holds the workers' (or Ray actors') start-up; "other" is imports, set-up, report, exit.
    out.update(first_round_s=round_time_s[0], later_rounds_s=sum(round_time_s[1:]))
    out.update(other_s=wall_s - sum(round_time_s), accuracy=accuracy, round_time_s=round_time_s)
    return out


def run_vatra(
    seed: int, workers: int, args: argparse.Namespace, paths: dict[str, Path], folder: Path
) -> dict[str, Any]:
    run_dir = folder / f"vatra-w{workers}-run"
    wall = timed(vatra_command(seed, workers, args, paths, run_dir), folder / f"vatra-w{workers}.log")
    rows = read_jsonl(run_dir / "metrics.jsonl")
    if json.loads((run_dir / "partition.json").read_text()) != json.loads(paths["partition"].read_text()):
        sys.exit(f"vatra's run folder holds another partition than {paths['partition']}")
    accuracy = [float(r["global_accuracy"]) for r in rows]
    return scores(accuracy, [float(r["round_time_s"]) for r in rows], wall)


def run_flower(
    seed: int, args: argparse.Namespace, paths: dict[str, Path], cfg: Config, folder: Path
) -> dict[str, Any]:
    out = folder / "flower.json"
    if args.same_clients:  # the clients vatra's first run trained, round by round
        rows = read_jsonl(folder / f"vatra-w{args.vatra_workers[0]}-run" / "metrics.jsonl")
        (folder / "selected.json").write_text(json.dumps([r["selected"] for r in rows]))
    wall = timed(flower_command(seed, args, paths, cfg, out), folder / "flower.log")
    res = json.loads(out.read_text())
    return scores(res["accuracy"], res["round_time_s"], wall)


def spread(values: list[Any]) -> dict[str, Any]:
    """Mean and min–max; a seed that never reached a target makes the mean None."""
    if any(v is None for v in values):
        return {"mean": None, "min": None, "max": None, "values": values}
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "values": values}


def fmt(s: dict[str, Any], digits: int = 3) -> str:
    if s["mean"] is None:
        return "not reached (" + ", ".join("-" if v is None else str(v) for v in s["values"]) + ")"
    return f"{s['mean']:.{digits}f} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


def run_all(
    args: argparse.Namespace, names: list[str]
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, str], Config]:
    """Every side on every seed, one command at a time; the order alternates from seed to seed.

    Returns the results per side and seed, the last seed's commands and its vatra config.
    """
    per_seed: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    commands: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(args.keep or tmp)
        for i, seed in enumerate(args.seeds):
            folder = base / f"seed{seed}"
            folder.mkdir(parents=True, exist_ok=True)
            paths, cfg = write_inputs(seed, args, folder)
            runs: dict[str, Callable[[], dict[str, Any]]] = {
                f"vatra w{w}": partial(run_vatra, seed, w, args, paths, folder) for w in args.vatra_workers
            }
            runs["flower"] = partial(run_flower, seed, args, paths, cfg, folder)
            for w in args.vatra_workers:
                run_dir = folder / f"vatra-w{w}-run"
                commands[f"vatra w{w}"] = shlex.join(vatra_command(seed, w, args, paths, run_dir))
            commands["flower"] = shlex.join(flower_command(seed, args, paths, cfg, folder / "flower.json"))
            # Alternate the order (the machine drifts), unless Flower must follow vatra's selection.
            for name in names[:: 1 if i % 2 == 0 or args.same_clients else -1]:
                res = runs[name]()
                per_seed[name].append({"seed": seed, **res})
                print(
                    f"seed {seed} {name}: wall {res['wall_s']:.1f} s, mean acc {res['mean_accuracy']:.4f}, "
                    f"rounds to 80 % {res['rounds_to_80']}, to 85 % {res['rounds_to_85']}",
                    flush=True,
                )
    print("\ncommands (last seed):\n" + "\n".join(f"  {name}: {cmd}" for name, cmd in commands.items()))
    return per_seed, commands, cfg


def summarise(per_seed: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Mean and min–max over seeds of every figure; each vatra run's wall time over Flower's."""
    keys = ["rounds_to_80", "rounds_to_85", "mean_accuracy", "final_accuracy", "wall_s"]
    keys += ["first_round_s", "later_rounds_s", "other_s"]
    summary: dict[str, Any] = {
        name: {k: spread([r[k] for r in runs]) for k in keys} for name, runs in per_seed.items()
    }
    flower = per_seed["flower"]
    for name in [n for n in per_seed if n != "flower"]:
        ratios = [v["wall_s"] / f["wall_s"] for v, f in zip(per_seed[name], flower, strict=True)]
        summary[name]["wall_ratio_over_flower"] = spread(ratios)
    return summary


def print_tables(
    args: argparse.Namespace, names: list[str], per_seed: dict[str, Any], summary: dict[str, Any]
) -> None:
    print("\naccuracy of the global model per round (mean over seeds, min–max):")
    rows = [
        [r + 1, *(fmt(spread([run["accuracy"][r] for run in per_seed[name]])) for name in names)]
        for r in range(args.rounds)
    ]
    print_table(["round", *names], rows)
    print()
    metrics = [("rounds to 80 %", "rounds_to_80", 1), ("rounds to 85 %", "rounds_to_85", 1)]
    metrics += [(f"mean accuracy, {args.rounds} rounds", "mean_accuracy", 4)]
    metrics += [("final accuracy", "final_accuracy", 4), ("whole command, s", "wall_s", 1)]
    metrics += [("wall time / flower's", "wall_ratio_over_flower", 3)]
    metrics += [("  round 1, s", "first_round_s", 1), (f"  rounds 2–{args.rounds}, s", "later_rounds_s", 1)]
    metrics += [("  outside the rounds, s", "other_s", 1)]
    table = [
        [label, *(fmt(summary[name][key], d) if key in summary[name] else "" for name in names)]
        for label, key, d in metrics
    ]
    print_table(["over seeds " + " ".join(map(str, args.seeds)), *names], table)


def check_targets(
    summary: dict[str, Any], per_seed: dict[str, list[dict[str, Any]]]
) -> dict[str, dict[str, bool]]:
    """The issues' targets for each vatra run, on the means over seeds.

    Issue 14 (20 clients): rounds to 80 / 85 % ≤ Flower's, mean accuracy ≥ Flower's, time ≤ 0.5×.
    Issue 41 (1,000 clients, 100 a round): accuracy ≥ Flower's in every round, time ≤ 0.3×.
    """
    f = summary["flower"]

    def per_round_mean(name: str) -> list[float]:
        return [statistics.fmean(acc) for acc in zip(*(r["accuracy"] for r in per_seed[name]), strict=True)]

    targets = {}
    for name, v in summary.items():
        if name == "flower":
            continue
        every = all(a >= b for a, b in zip(per_round_mean(name), per_round_mean("flower"), strict=True))
        targets[name] = {
            "rounds_to_80_le_flower": _le(v["rounds_to_80"]["mean"], f["rounds_to_80"]["mean"]),
            "rounds_to_85_le_flower": _le(v["rounds_to_85"]["mean"], f["rounds_to_85"]["mean"]),
            "mean_accuracy_ge_flower": v["mean_accuracy"]["mean"] >= f["mean_accuracy"]["mean"],
            "accuracy_ge_flower_every_round": every,
            "wall_ratio_le_0.5": v["wall_ratio_over_flower"]["mean"] <= 0.5,
            "wall_ratio_le_0.3": v["wall_ratio_over_flower"]["mean"] <= 0.3,
        }
        met = ", ".join(f"{k} {'yes' if ok else 'no'}" for k, ok in targets[name].items())
        print(f"targets, {name} (on the means over seeds): {met}")
    return targets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument(
        "--per-round",
        type=int,
        default=0,
        help="clients trained per round on both sides (0, the default: all); "
        "vatra's federated.clients_per_round, Flower's fraction_train",
    )
    parser.add_argument(
        "--same-clients",
        action="store_true",
        help="with --per-round: Flower's sampled nodes train the clients vatra selected each round "
        "(vatra runs first), so only the engines differ",
    )
    parser.add_argument("--alpha", type=float, default=0.1)
    parser.add_argument(
        "--vatra-workers",
        type=int,
        nargs="+",
        default=[1, 2],
        help="federated.workers of each vatra run (1, the default, trains in process; 2 is a pool)",
    )
    parser.add_argument(
        "--flower-python",
        default=str(ROOT / ".venv-flower" / "bin" / "python"),
        help="python of a venv with torch and flwr[simulation] (make bench-flower creates .venv-flower)",
    )
    parser.add_argument("--keep", default="", help="keep each seed's files, logs and run folders here")
    args = parser.parse_args()
    print(
        "reproduce: " + shlex.join([".venv/bin/python", "bench/fl_vs_flower.py", *sys.argv[1:]]), flush=True
    )
    names = [f"vatra w{w}" for w in args.vatra_workers] + ["flower"]
    per_seed, commands, cfg = run_all(args, names)
    summary = summarise(per_seed)
    print_tables(args, names, per_seed, summary)
    print()
    targets = check_targets(summary, per_seed)
    write_result(
        f"fl_vs_flower_{args.clients}x{args.per_round}" if args.per_round else "fl_vs_flower",
        {
            "args": vars(args),
            "flower": _flower_versions(args.flower_python),
            "local_training": local_training(cfg),
            "commands_last_seed": commands,
            "summary": summary,
            "targets_met": targets,
            "per_seed": per_seed,
        },
    )


def _le(a: float | None, b: float | None) -> bool:
    """a ≤ b for rounds to a target; never reaching it counts as more rounds than any."""
    if a is None:
        return b is None
    return b is None or a <= b


def _flower_versions(python: str) -> dict[str, str]:
    code = "import flwr, ray, torch; print(flwr.__version__, ray.__version__, torch.__version__)"
    flwr_v, ray_v, torch_v = subprocess.check_output([python, "-c", code], text=True).split()
    return {"flwr": flwr_v, "ray": ray_v, "torch": torch_v, "python": python}


if __name__ == "__main__":
    main()
