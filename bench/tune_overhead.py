"""Per-trial cost of ``vatra tune``'s workers against a bare optuna loop training the same model.

    python bench/tune_overhead.py [--trials 20] [--steps 300] [--reps 3] [--eval-every 50]

Both sides run in this one process, rep by rep in a rotating order, on the digits tensors vatra
builds, with the same journal-file storage and a random sampler over the learning rate:

- vatra: the trial worker's loop (``vatra.tune.workers.serve``, what each ``vatra tune`` worker
  process runs): per trial a run folder, the trial's config validated, the engine's Trainer with the
  plugins a trial gets (metrics.jsonl, summary.json, pruning reports at each evaluation);
- bare: ``study.optimize`` with an objective a user would write: the same MLP (64 → 128 → 128 → 10,
  ReLU), Adam, the same batch size and steps, random batches, an evaluation every ``--eval-every``
  steps reported with ``trial.report``, the final validation accuracy returned.

Torch is imported and the data built before timing (a worker does that once, not per trial). Reports
wall time per trial for each and the ratio; the target is ≤ 1.3×.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import optuna
import torch
from torch import nn

from _common import print_table, write_result
from vatra.cli.tune import trial_overrides
from vatra.config import load_config
from vatra.data import DataContext, build_dataset
from vatra.tune.study import Study
from vatra.tune.workers import serve

CONFIG = """
[run]
name = "overhead"
out_dir = "{out}"
[data]
name = "digits"
[model]
name = "mlp"
hidden = [128, 128]
[train]
steps = {steps}
batch_size = 32
eval_every = {every}
[optim]
name = "adam"
lr = 0.003
[tune]
trials = {trials}
sampler = "random"
[tune.space."optim.lr"]
type = "float"
low = 1e-4
high = 0.03
log = true
"""


def vatra_side(tmp: Path, args: argparse.Namespace, rep: int) -> float:
    """Seconds per trial of the worker loop."""
    path = tmp / f"vatra{rep}.toml"
    out = tmp / f"runs{rep}"
    path.write_text(CONFIG.format(out=out, steps=args.steps, every=args.eval_every, trials=args.trials))
    cfg = load_config(path, trial_overrides(path))
    run = Study(cfg, 1)
    run.open()
    t0 = time.perf_counter()
    serve(cfg, url=run.url, name=run.name)
    return (time.perf_counter() - t0) / args.trials


def bare_side(tmp: Path, args: argparse.Namespace, rep: int, data: Any) -> float:
    """Seconds per trial of a plain optuna loop over a plain torch loop."""
    train, val = data.train, data.val
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(tmp / f"bare{rep}.log"))
    )
    study = optuna.create_study(storage=storage, sampler=optuna.samplers.RandomSampler(seed=rep + 1))

    def accuracy(model: nn.Module) -> float:
        model.eval()
        with torch.no_grad():
            acc = (model(val.x).argmax(1) == val.y).float().mean().item()
        model.train()
        return acc

    def objective(trial: optuna.Trial) -> float:
        lr = trial.suggest_float("optim.lr", 1e-4, 0.03, log=True)
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)
        )
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        gen = torch.Generator().manual_seed(0)
        for step in range(1, args.steps + 1):
            idx = torch.randint(len(train.y), (32,), generator=gen)
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(train.x[idx]), train.y[idx]).backward()
            opt.step()
            if args.eval_every and step % args.eval_every == 0 and step < args.steps:
                trial.report(accuracy(model), step)
        return accuracy(model)

    t0 = time.perf_counter()
    study.optimize(objective, n_trials=args.trials)
    return (time.perf_counter() - t0) / args.trials


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    torch.set_num_threads(1)  # one worker's share of a machine running several
    data = build_dataset(load_config(None).data, DataContext(seed=0))
    rows, ratios = [], []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        warm = argparse.Namespace(**{**vars(args), "trials": 1})
        vatra_side(tmp, warm, -1)  # first-use imports and caches, on neither side's clock
        bare_side(tmp, warm, -1, data)
        for rep in range(args.reps):
            order = ("vatra", "bare") if rep % 2 == 0 else ("bare", "vatra")
            got: dict[str, float] = {}
            for side in order:
                got[side] = vatra_side(tmp, args, rep) if side == "vatra" else bare_side(tmp, args, rep, data)
            ratios.append(got["vatra"] / got["bare"])
            rows.append([rep, got["bare"], got["vatra"], ratios[-1]])
    print_table(["rep", "bare optuna s/trial", "vatra tune s/trial", "ratio"], rows)
    median = statistics.median(ratios)
    print(f"median ratio {median:.3f} (target ≤ 1.3)")
    reps = [dict(zip(("rep", "bare_s", "vatra_s", "ratio"), r, strict=True)) for r in rows]
    write_result("tune_overhead", {"args": vars(args), "reps": reps, "median_ratio": median})


if __name__ == "__main__":
    main()
