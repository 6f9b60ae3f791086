"""Few-shot adaptation: how many labelled examples a new task needs, from five initialisations, and
the time of one meta-step against a plain ``higher``-style loop.

    python bench/meta.py [--seeds 2] [--meta-steps 100] [--sine-steps 400] [--episodes 15]

Digits (scikit-learn's 8×8, pixels / 16), 5-way, classes split once: 5 for (meta-)training, the
other 5 held out; every new task is 5 held-out classes in a random order. Each initialisation is
adapted on K labelled rows per class (K = 1, 5, 10, 50) by the same rule, SGD of LR ``--adapt-lr``
on all parameters for 1 and for 10 steps, the better of the two kept per initialisation and K (the
meta-learned ones were trained for 1 step; from scratch 10 do better), and scored on 15 other rows
per class:

* ``scratch``: a fresh random initialisation;
* ``pretrained``: supervised training on every row of the 5 training classes (as many Adam steps
  as meta-steps, batch 64), its head then re-initialised (a new task's labels are arbitrary) and
  the whole model fine-tuned;
* ``maml`` / ``fomaml`` / ``reptile``: vatra.meta's algorithms (the same functions ``vatra meta``
  runs), meta-trained for ``--meta-steps`` steps of 4 episodes of 5-way 5-shot, 1 inner step of LR
  0.4 (Reptile: 5 inner steps of 0.1 on support and query, outer SGD of LR 1.0).

Then the sinusoid family of the MAML paper (y = A sin(x − φ), A ∈ [0.1, 5], φ ∈ [0, π],
x ∈ [−5, 5]; MLP 1-40-40-1): mean squared error on 50 query points after 10 SGD steps (LR 0.01) on
K = 5, 10 support points (``--sine-steps`` meta-steps of 10 tasks), the same five initialisations
(``pretrained``: regression on points of random tasks, so it learns their mean).

Last, the time of one second-order MAML step (8 tasks, 1 inner step, the digits MLP) with
``vatra.meta`` (torch.func, vmap over the tasks) against a plain loop over the tasks with
``torch.autograd.grad(create_graph=True)`` and fast weights (what ``higher`` and learn2learn do;
learn2learn does not install beside torch 2.13, so the loop is written here). Figures vary with
the machine's load: compare ratios, and the spread over seeds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from _common import machine, print_table, write_result
from vatra.data.stratify import bundled_digits
from vatra.meta.algorithms import InnerLoop, TaskLoss, adapt, task_batch
from vatra.meta.tasks import ClassTasks

KS = (1, 5, 10, 50)
METHODS = ("scratch", "pretrained", "maml", "fomaml", "reptile")
TARGET = 0.8  # digits: the accuracy a new task must reach


def mlp(inputs: int, hidden: int, outputs: int, act: type[nn.Module] = nn.ReLU) -> nn.Module:
    return nn.Sequential(
        nn.Linear(inputs, hidden), act(), nn.Linear(hidden, hidden), act(), nn.Linear(hidden, outputs)
    )


def meta_train(
    model: nn.Module,
    loss: Any,
    ways: int,
    sample: Any,
    algorithm: str,
    steps: int,
    lr: float,
    *,
    inner_lr: float,
    inner_steps: int = 1,
    tasks: int = 4,
) -> None:
    """``steps`` meta-steps of ``tasks`` episodes (``sample(index)``) through vatra.meta's kernel."""
    names = tuple(n for n, _ in model.named_parameters())
    loop = InnerLoop(algorithm, inner_steps, names, ways)  # type: ignore[arg-type]
    task_loss = TaskLoss(model, loss, ways)
    reptile = algorithm == "reptile"
    opt: torch.optim.Optimizer = (
        torch.optim.SGD(model.parameters(), lr=lr) if reptile else torch.optim.Adam(model.parameters(), lr=lr)
    )
    lrs = {n: torch.tensor(inner_lr) for n in names}
    for step in range(steps):
        episodes = [sample(step * tasks + t) for t in range(tasks)]
        params = {n: p.detach() for n, p in model.named_parameters()}
        batch, _ = task_batch(task_loss, loop, params, lrs, episodes)
        for n, p in model.named_parameters():
            p.grad = batch.grads[n].mean(0)
        opt.step()


def fine_tune(
    model: nn.Module, loss: Any, ways: int, episode: tuple[torch.Tensor, ...], steps: int, lr: float
) -> float:
    """Query loss (regression) or accuracy (classification) after ``steps`` SGD steps on the support."""
    sx, sy, qx, qy = episode
    task_loss = TaskLoss(model, loss, ways)
    params = {n: p.detach() for n, p in model.named_parameters()}
    lrs = {n: torch.tensor(lr) for n in params}
    fast = adapt(task_loss, params, lrs, sx, sy, InnerLoop("fomaml", steps, tuple(params), ways))
    with torch.no_grad():
        value, acc = task_loss.with_accuracy(fast, qx, qy)
    return float(acc if ways else value)


# -------------------------------------------------------------------- digits
def digits_inits(
    seed: int, meta_steps: int
) -> tuple[dict[str, nn.Module], ClassTasks, dict[int, ClassTasks]]:
    pixels, labels = bundled_digits()
    x = torch.as_tensor(pixels / 16.0, dtype=torch.float32)
    train_tasks = ClassTasks(x, labels, ways=5, shots=5, queries=15, val=0, test=5, seed=0)
    eval_tasks = {k: ClassTasks(x, labels, ways=5, shots=k, queries=15, val=0, test=5, seed=0) for k in KS}
    ce = nn.functional.cross_entropy
    inits: dict[str, nn.Module] = {}
    torch.manual_seed(seed)
    inits["scratch"] = mlp(64, 64, 5)
    torch.manual_seed(seed)
    pre = mlp(64, 64, 5)
    train_classes = train_tasks.classes["train"]
    rows = np.flatnonzero(np.isin(labels, train_classes))
    y_train = torch.as_tensor(np.searchsorted(train_classes, labels[rows]))
    opt = torch.optim.Adam(pre.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(meta_steps):
        idx = torch.randint(len(rows), (64,), generator=gen)
        opt.zero_grad()
        ce(pre(x[rows][idx]), y_train[idx]).backward()
        opt.step()
    torch.manual_seed(seed + 1)
    pre[-1].reset_parameters()  # a fresh head for the new task's classes
    inits["pretrained"] = pre
    for algorithm in ("maml", "fomaml", "reptile"):
        torch.manual_seed(seed)
        model = mlp(64, 64, 5)
        reptile = algorithm == "reptile"
        meta_train(
            model,
            ce,
            5,
            lambda i: train_tasks.episode("train", i + seed * 10**6),
            algorithm,
            meta_steps,
            1.0 if reptile else 3e-3,
            inner_lr=0.1 if reptile else 0.4,
            inner_steps=5 if reptile else 1,
        )
        inits[algorithm] = model
    return inits, train_tasks, eval_tasks


def digits_bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for seed in range(args.seeds):
        t0 = time.perf_counter()
        inits, _, eval_tasks = digits_inits(seed, args.meta_steps)
        train_s = time.perf_counter() - t0
        for method in METHODS:
            for k in KS:
                by_steps = {
                    steps: float(
                        np.mean(
                            [
                                fine_tune(
                                    inits[method],
                                    nn.functional.cross_entropy,
                                    5,
                                    eval_tasks[k].episode("test", i),
                                    steps,
                                    args.adapt_lr,
                                )
                                for i in range(args.episodes)
                            ]
                        )
                    )
                    for steps in (1, 10)
                }
                best = max(by_steps, key=lambda st: by_steps[st])
                row = {"seed": seed, "method": method, "k": k, "accuracy": by_steps[best], "steps": best}
                rows.append(row)
        print(f"  digits seed {seed}: inits in {train_s:.1f} s", flush=True)
    return rows


# ----------------------------------------------------------------- sinusoids
def sinusoid(rng: np.random.Generator, k: int, queries: int = 50) -> tuple[torch.Tensor, ...]:
    amp, phase = rng.uniform(0.1, 5.0), rng.uniform(0.0, np.pi)
    x = rng.uniform(-5.0, 5.0, size=(k + queries, 1))
    y = amp * np.sin(x - phase)
    t = [torch.as_tensor(a, dtype=torch.float32) for a in (x[:k], y[:k, 0], x[k:], y[k:, 0])]
    return tuple(t)


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out.squeeze(-1) - y) ** 2).mean()


def sinusoid_bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for seed in range(args.seeds):
        inits: dict[str, nn.Module] = {}
        torch.manual_seed(seed)
        inits["scratch"] = mlp(1, 40, 1)
        torch.manual_seed(seed)
        pre = mlp(1, 40, 1)
        opt = torch.optim.Adam(pre.parameters(), lr=1e-3)
        rng = np.random.default_rng([seed, 1])
        for _ in range(args.sine_steps):
            sx, sy, _, _ = sinusoid(rng, 10, 0)
            opt.zero_grad()
            mse(pre(sx), sy).backward()
            opt.step()
        inits["pretrained"] = pre
        for algorithm in ("maml", "fomaml", "reptile"):
            torch.manual_seed(seed)
            model = mlp(1, 40, 1)
            reptile = algorithm == "reptile"
            meta_train(
                model,
                mse,
                0,
                lambda i, seed=seed: sinusoid(np.random.default_rng([seed, 2, i]), 10, 10),
                algorithm,
                args.sine_steps,
                1.0 if reptile else 1e-3,
                inner_lr=0.01 if not reptile else 0.02,
                inner_steps=5 if reptile else 1,
                tasks=10,
            )
            inits[algorithm] = model
        for method in METHODS:
            for k in (5, 10):
                errs = [
                    fine_tune(
                        inits[method], mse, 0, sinusoid(np.random.default_rng([seed, 3, i]), k), 10, 0.01
                    )
                    for i in range(args.episodes)
                ]
                rows.append({"seed": seed, "method": method, "k": k, "mse": float(np.mean(errs))})
    return rows


# --------------------------------------------------------- time per meta-step
def plain_maml_step(model: nn.Module, episodes: list[tuple[torch.Tensor, ...]], inner_lr: float) -> None:
    """The loop ``higher`` and learn2learn's MAML run: per task, fast weights from
    ``autograd.grad(create_graph=True)``, the query loss through them, backward into θ."""
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    for p in params:
        p.grad = None
    ce = nn.functional.cross_entropy
    for sx, sy, qx, qy in episodes:
        support = ce(functional_call(model, dict(zip(names, params, strict=True)), (sx,))[:, :5], sy)
        grads = torch.autograd.grad(support, params, create_graph=True)
        fast = {n: p - inner_lr * g for n, p, g in zip(names, params, grads, strict=True)}
        (ce(functional_call(model, fast, (qx,))[:, :5], qy) / len(episodes)).backward()


def vatra_maml_step(model: nn.Module, episodes: list[tuple[torch.Tensor, ...]], inner_lr: float) -> None:
    params = {n: p.detach() for n, p in model.named_parameters()}
    loop = InnerLoop("maml", 1, tuple(params), 5)
    lrs = {n: torch.tensor(inner_lr) for n in params}
    batch, _ = task_batch(TaskLoss(model, nn.functional.cross_entropy, 5), loop, params, lrs, episodes)
    for n, p in model.named_parameters():
        p.grad = batch.grads[n].mean(0)


def step_time_bench(args: argparse.Namespace) -> dict[str, Any]:
    pixels, labels = bundled_digits()
    x = torch.as_tensor(pixels / 16.0, dtype=torch.float32)
    tasks = ClassTasks(x, labels, ways=5, shots=5, queries=15, val=0, test=5, seed=0)
    episodes = [tasks.episode("train", i) for i in range(8)]
    torch.manual_seed(0)
    model = mlp(64, 64, 10)
    vatra_maml_step(model, episodes, 0.4)  # the same gradient, by both
    want = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    plain_maml_step(model, episodes, 0.4)
    diff = max(float((p.grad - w).abs().max()) for p, w in zip(model.parameters(), want, strict=True))  # type: ignore[operator]
    times: dict[str, list[float]] = {"vatra.meta (vmap)": [], "plain loop": []}
    for rep in range(args.timing_reps):
        order = [("vatra.meta (vmap)", vatra_maml_step), ("plain loop", plain_maml_step)]
        for name, fn in order if rep % 2 == 0 else order[::-1]:  # alternate: load hits each alike
            t0 = time.perf_counter()
            fn(model, episodes, 0.4)
            times[name].append(time.perf_counter() - t0)
    return {"max_grad_diff": diff, "ms": {k: 1000 * statistics.median(v) for k, v in times.items()}}


def needed(rows: list[dict[str, Any]], method: str, seed: int) -> str:
    reached = [
        r["k"] for r in rows if r["method"] == method and r["seed"] == seed and r["accuracy"] >= TARGET
    ]
    return str(min(reached)) if reached else f">{KS[-1]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--meta-steps", type=int, default=100)
    parser.add_argument("--sine-steps", type=int, default=400, help="sinusoids: (meta-)steps")
    parser.add_argument("--episodes", type=int, default=15, help="new tasks scored per K")
    parser.add_argument("--adapt-lr", type=float, default=0.4)
    parser.add_argument("--timing-reps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    digits = digits_bench(args)
    print(
        f"\ndigits 5-way, held-out classes: accuracy after adapting on K per class "
        f"(mean over {args.seeds} seeds, [min, max])"
    )
    table = []
    for method in METHODS:
        cells: list[Any] = [method]
        for k in KS:
            accs = [r["accuracy"] for r in digits if r["method"] == method and r["k"] == k]
            cells.append(f"{np.mean(accs):.3f} [{min(accs):.3f}, {max(accs):.3f}]")
        cells.append(" / ".join(needed(digits, method, s) for s in range(args.seeds)))
        table.append(cells)
    print_table(["init", *(f"K={k}" for k in KS), f"K for {TARGET:.0%} (per seed)"], table)
    sines = sinusoid_bench(args)
    print("\nsinusoids: query MSE after 10 SGD steps on K points (mean over seeds, [min, max])")
    table = []
    for method in METHODS:
        cells = [method]
        for k in (5, 10):
            errs = [r["mse"] for r in sines if r["method"] == method and r["k"] == k]
            cells.append(f"{np.mean(errs):.3f} [{min(errs):.3f}, {max(errs):.3f}]")
        table.append(cells)
    print_table(["init", "K=5", "K=10"], table)
    timing = step_time_bench(args)
    ms = timing["ms"]
    print(
        "\nsecond-order MAML step, 8 tasks, MLP 64-64-10 "
        f"(same gradient: max diff {timing['max_grad_diff']:.1e})"
    )
    print_table(
        ["implementation", "ms per meta-step (median)", "vs plain loop"],
        [[name, f"{v:.1f}", f"{ms['plain loop'] / v:.2f}×"] for name, v in ms.items()],
    )
    wall = time.perf_counter() - t0
    print(f"\nwall {wall:.0f} s")
    path = write_result(
        "meta",
        {
            "args": vars(args),
            "digits": digits,
            "sinusoids": sines,
            "step_time": timing,
            "wall_s": wall,
            "machine": machine(),
        },
    )
    print(f"results: {path}")


if __name__ == "__main__":
    main()
